"""The fused-MoE kernel (reviewer_kernels/fused_moe.py), its PyTorch fallback, and the model patch
(backend/decoding/moe_patch.py).

The Triton kernels run on the CPU through Triton's interpreter in a subprocess (TRITON_INTERPRET=1 must be set
before triton is imported, and must not leak into other tests); fp32 and fp16 only (its bf16 is wrong).
GPU tests (bf16 at Qwen3.6-35B-A3B shapes, CUDA graphs) skip without CUDA.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from reviewer_kernels import SharedExpert, fused_moe, fused_moe_torch, moe_reference
from tests import interpreter


def random_moe(num_tokens, num_experts, hidden, inter, top_k, dtype, shared="gated", seed=None, device="cpu"):
    """Fresh random inputs: a real softmax/top-k routing of random logits, renormalised like Qwen's router."""
    g = torch.Generator(device).manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    r = lambda *shape, scale=1.0: torch.randn(*shape, generator=g, device=device) * scale  # noqa: E731
    x = r(num_tokens, hidden)
    gate_up = r(num_experts, 2 * inter, hidden, scale=hidden ** -0.5)
    down = r(num_experts, hidden, inter, scale=inter ** -0.5)
    probs = r(num_tokens, num_experts).softmax(-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    sh = None
    if shared:
        sh = SharedExpert(r(inter, hidden, scale=hidden ** -0.5), r(inter, hidden, scale=hidden ** -0.5),
                          r(hidden, inter, scale=inter ** -0.5),
                          r(1, hidden, scale=hidden ** -0.5) if shared == "gated" else None)
        sh = SharedExpert(*(t.to(device, dtype) if t is not None else None for t in sh))
    cast = lambda t: t.to(device, dtype)  # noqa: E731
    return cast(x), cast(gate_up), cast(down), cast(weights), ids.to(device), sh


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def reference64(x, gate_up, down, weights, ids, shared):
    d = lambda t: t.double() if t is not None else None  # noqa: E731
    return moe_reference(d(x), d(gate_up), d(down), d(weights), ids,
                         SharedExpert(*(d(t) for t in shared)) if shared is not None else None)


# --- PyTorch fallback -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 40])
@pytest.mark.parametrize("shared", ["gated", "ungated", None])
def test_fallback_matches_reference_loop(dtype, tol, num_tokens, shared):
    inputs = random_moe(num_tokens, 12, 64, 32, 3, dtype, shared)
    out = fused_moe(*inputs, use_triton=False)
    assert out.dtype == dtype and out.shape == (num_tokens, 64)
    assert rel_err(out, reference64(*inputs)) < tol


def test_fallback_is_what_runs_on_cpu_without_the_interpreter():
    assert os.environ.get("TRITON_INTERPRET") != "1"
    inputs = random_moe(5, 8, 64, 32, 2, torch.float32)
    assert torch.equal(fused_moe(*inputs), fused_moe_torch(*inputs))


def test_fallback_writes_the_next_norm_of_its_result():
    """norm=(weight, eps, normed_out) on the PyTorch path: the result unchanged, normed_out its RMSNorm."""
    from reviewer_kernels.moe_reference import rms_norm_scaled
    inputs = random_moe(5, 8, 64, 32, 2, torch.float32)
    res, nw, normed = torch.randn(5, 64), 1 + 0.2 * torch.randn(64), torch.full((5, 64), float("nan"))
    out = fused_moe(*inputs, residual=res, norm=(nw, 1e-6, normed))
    assert torch.equal(out, fused_moe(*inputs, residual=res))
    assert torch.equal(normed, rms_norm_scaled(out, nw, 1e-6))
    with pytest.raises(ValueError, match="normed_out"):
        fused_moe(*inputs, norm=(nw, 1e-6, normed[:3]))


def test_bad_shapes_raise_clear_errors():
    x, gate_up, down, weights, ids, shared = random_moe(4, 8, 64, 32, 2, torch.float32)
    with pytest.raises(ValueError, match="hidden_states"):
        fused_moe(x[None], gate_up, down, weights, ids, shared)
    with pytest.raises(ValueError, match="down_proj"):
        fused_moe(x, gate_up, down.transpose(1, 2), weights, ids, shared)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, gate_up, down, weights[:, :1], ids, shared)
    with pytest.raises(ValueError, match="shared expert"):
        fused_moe(x, gate_up, down, weights, ids, SharedExpert(shared.gate_proj, shared.up_proj, shared.gate_proj))


# --- Triton kernels under the interpreter (subprocess) --------------------------------------------------------

# (dtype, tokens, experts, hidden, inter, top_k, shared, direct, BM, gate_up split K)
INTERPRETER_CASES = [
    (dt, *case) for dt in ("float32", "float16") for case in [
        (1, 8, 64, 32, 2, "gated", True, 16, 1),
        (1, 8, 64, 32, 2, "gated", True, 16, 4),  # a decode step in split tiles: the last split finishes
        (3, 16, 128, 64, 4, "gated", False, 16, 2),
        (16, 8, 64, 32, 2, "ungated", True, 16, 1),
        (16, 12, 64, 32, 4, "gated", False, 16, 1),
        (40, 16, 96, 48, 4, None, False, 32, 1),
        (40, 8, 80, 40, 3, "gated", False, 16, 2),  # H, I not multiples of the tiles; experts span blocks
    ]
]

INTERPRETER_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_fused_moe import INTERPRETER_CASES, random_moe, reference64, rel_err
from reviewer_kernels import fused_moe
from reviewer_kernels.moe_reference import rms_norm_scaled
for case in INTERPRETER_CASES:
    dt, m, e, h, i, k, shared, direct, bm, split = case
    inputs = random_moe(m, e, h, i, k, getattr(torch, dt), shared)
    config = {"direct": direct, "BM": bm, "decode": False,
              "gate_up": {"BN": 16, "BK": 32 if split == 1 else 16, "warps": 4, "stages": 2, "split": split},
              "down": {"BN": 32, "BK": 16, "warps": 4, "stages": 2}}
    out = fused_moe(*inputs, use_triton=True, config=config)
    # each token alone (a decode step, direct mode) in the same tiles: the row's bits whoever shares the call
    x, gate_up, down, weights, ids, sh = inputs
    alone = torch.cat([fused_moe(x[t:t + 1], gate_up, down, weights[t:t + 1], ids[t:t + 1], sh, use_triton=True,
                                 config=dict(config, direct=True)) for t in range(min(m, 5))])
    # the next layer's norm computed by the slot sum (one program a row) beside a residual: the same result, and
    # the norm of it as the PyTorch norm computes it
    res = torch.randn(m, h).to(x.dtype)
    nw, normed = 1 + 0.2 * torch.randn(h), torch.empty_like(x)
    with_norm = fused_moe(*inputs, use_triton=True, config=config, residual=res, norm=(nw, 1e-6, normed))
    plain = fused_moe(*inputs, use_triton=True, config=config, residual=res)
    # the slots summed by the down kernel's last program of each token and N-tile: the slot sum's bits, twice over
    # (its counters are left at zero), with and without the residual
    summed = dict(config, sum_in_down=True)
    in_down = [fused_moe(*inputs, use_triton=True, config=summed, residual=res) for _ in range(2)]
    print(json.dumps({"case": list(case), "err": rel_err(out, reference64(*inputs)),
                      "sum_in_down": all(torch.equal(r, plain) for r in in_down)
                      and torch.equal(fused_moe(*inputs, use_triton=True, config=summed), out),
                      "finite": bool(torch.isfinite(out).all()), "dtype": str(out.dtype),
                      "rows_alone": bool(torch.equal(alone, out[:alone.shape[0]])),
                      "repeatable": bool(torch.equal(out, fused_moe(*inputs, use_triton=True, config=config))),
                      "norm_result": bool(torch.equal(with_norm, plain)),
                      "norm_err": rel_err(normed, rms_norm_scaled(plain, nw, 1e-6))}), flush=True)
"""


def run_interpreted(script, *args, timeout=600):
    """The script's JSON lines, run under TRITON_INTERPRET=1 in a subprocess (tests/interpreter.py: usually already
    computed in the background while the rest of the suite ran)."""
    proc = interpreter.run(script, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def interpreted_by_case(script) -> dict[tuple, dict]:
    """run_interpreted(script), keyed by each line's "case" (skips without triton)."""
    pytest.importorskip("triton")
    return {tuple(r["case"]): r for r in run_interpreted(script)}


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted_by_case(INTERPRETER_SCRIPT)


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_triton_kernel_matches_reference_in_interpreter(interpreter_results, case):
    """The grouped kernels against float64, with K splits in gate_up (the last split to finish adds them): a token's
    row is bitwise the same computed alone, and again on a second call (the arrival counters are left at zero); the
    slots summed inside the down kernel ("sum_in_down") bitwise as the slot sum's launch sums them."""
    result = interpreter_results[tuple(case)]
    assert result["finite"] and result["dtype"] == f"torch.{case[0]}"
    assert result["err"] < (1e-5 if case[0] == "float32" else 2e-3), result
    assert result["rows_alone"] and result["repeatable"] and result["sum_in_down"], result
    assert result["norm_result"] and result["norm_err"] < (1e-6 if case[0] == "float32" else 1e-3), result


# One token takes reviewer_kernels/moe_decode.py: (dtype, experts, hidden, inter, top_k, shared, gate_up BN, down BH);
# sizes that are not powers of two (masked tile edges), top-k below its padded size.
DECODE_CASES = [
    (dt, *case) for dt in ("float32", "float16") for case in [
        (8, 64, 32, 2, "gated", 2, 2),
        (16, 96, 48, 3, None, 4, 1),
        (12, 80, 40, 3, "ungated", 16, 4),
        (8, 64, 32, 8, "gated", 1, 8),
    ]
]

DECODE_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_fused_moe import DECODE_CASES, random_moe, reference64, rel_err
from reviewer_kernels import fused_moe
from reviewer_kernels import moe_decode
from reviewer_kernels.moe_decode import decode_moe
from reviewer_kernels.moe_reference import rms_norm_scaled
for case in DECODE_CASES:
    dt, e, h, i, k, shared, bn, bh = case
    inputs = random_moe(1, e, h, i, k, getattr(torch, dt), shared, seed=e + h)
    tiles = {"gate_up": {"BN": bn, "warps": 4}, "down": {"BH": bh, "warps": 2}}
    out = fused_moe(*inputs, use_triton=True, config={"decode": tiles})
    res = torch.randn(1, h).to(out.dtype)
    with_res = fused_moe(*inputs, use_triton=True, config={"decode": tiles}, residual=res)
    fallback = fused_moe(*inputs, use_triton=False)
    # 5 tokens through the one-token programs (gemv_tokens): each row bitwise that token's one-token call, and the
    # residual rows added as for one token
    x5, gate_up5, down5, w5, ids5, sh5 = random_moe(5, e, h, i, k, getattr(torch, dt), shared, seed=e + h + 1)
    rows = {"decode": tiles, "gemv_tokens": 16}
    res5 = torch.randn(5, h).to(out.dtype)
    together = fused_moe(x5, gate_up5, down5, w5, ids5, sh5, use_triton=True, config=rows, residual=res5)
    alone = torch.cat([fused_moe(x5[t:t + 1], gate_up5, down5, w5[t:t + 1], ids5[t:t + 1], sh5, use_triton=True,
                                 config={"decode": tiles}, residual=res5[t:t + 1]) for t in range(5)])
    plain5 = fused_moe(x5, gate_up5, down5, w5, ids5, sh5, use_triton=True, config=rows)
    # written into `out` (no copy), with the next layer's norm (after the kernels: they have no slot sum to hold it)
    nw, o5, n5 = torch.rand(h) + 0.5, torch.empty_like(together), torch.empty_like(together)
    fused_moe(x5, gate_up5, down5, w5, ids5, sh5, use_triton=True, config=rows, residual=res5, out=o5,
              norm=(nw, 1e-6, n5))
    n_alone = torch.empty_like(n5)
    for t in range(5):
        fused_moe(x5[t:t + 1], gate_up5, down5, w5[t:t + 1], ids5[t:t + 1], sh5, use_triton=True, config=rows,
                  residual=res5[t:t + 1], norm=(nw, 1e-6, n_alone[t:t + 1]))
    # the block kernels (gemv_sorted_from; the float16 cases, for time): sorted from 2 tokens, direct below, one
    # binary; each row bitwise the token alone (a direct call), the whole call bitwise its direct twin, the reference's
    # to rounding; the first case also with 20 tokens (blocks split at 16 rows)
    blocks, checks = dict(rows, gemv_sorted_from=2), {}
    if dt == "float16":
        b_together = fused_moe(x5, gate_up5, down5, w5, ids5, sh5, use_triton=True, config=blocks)
        b_alone = torch.cat([fused_moe(x5[t:t + 1], gate_up5, down5, w5[t:t + 1], ids5[t:t + 1], sh5, use_triton=True,
                                       config=blocks) for t in range(5)])
        b_direct = fused_moe(x5, gate_up5, down5, w5, ids5, sh5, use_triton=True,
                             config=dict(blocks, gemv_sorted_from=6))
        moe_decode.BLOCK_WORKERS, workers = 2, moe_decode.BLOCK_WORKERS  # each worker walks several blocks
        b_few = fused_moe(x5, gate_up5, down5, w5, ids5, sh5, use_triton=True, config=blocks)
        moe_decode.BLOCK_WORKERS = workers
        checks = {"blocks_alone": bool(torch.equal(b_together, b_alone)),
                  "blocks_few_workers": bool(torch.equal(b_together, b_few)),
                  "blocks_direct": bool(torch.equal(b_together, b_direct)),
                  "blocks_err": rel_err(b_together, reference64(x5, gate_up5, down5, w5, ids5, sh5))}
    if case == DECODE_CASES[4]:
        x20, gate_up20, down20, w20, ids20, sh20 = random_moe(20, e, h, i, k, torch.float16, shared, seed=e + h + 2)
        b20 = fused_moe(x20, gate_up20, down20, w20, ids20, sh20, use_triton=True, config=dict(blocks, gemv_tokens=32))
        checks["blocks20_err"] = rel_err(b20, reference64(x20, gate_up20, down20, w20, ids20, sh20))
    print(json.dumps({"case": list(case), "err": rel_err(out, reference64(*inputs)), **checks,
                      "tokens_alone": bool(torch.equal(together, alone)),
                      "tokens_err": rel_err(plain5, reference64(x5, gate_up5, down5, w5, ids5, sh5)),
                      "out_equal": bool(torch.equal(o5, together)), "normed_alone": bool(torch.equal(n5, n_alone)),
                      "normed_err": rel_err(n5, rms_norm_scaled(together, nw, 1e-6)),
                      "residual_equal": bool(torch.equal(with_res, res + out)),
                      "deterministic": bool(torch.equal(out, fused_moe(*inputs, use_triton=True,
                                                                        config={"decode": tiles}))),
                      "fallback_err": rel_err(out, fallback), "dtype": str(out.dtype)}), flush=True)
"""


@pytest.fixture(scope="module")
def decode_results():
    return interpreted_by_case(DECODE_SCRIPT)


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_kernels_match_reference_in_interpreter(decode_results, case):
    """One token: the two GEMV-shaped kernels give the float64 reference's output, the residual added with
    PyTorch's rounding, the same bits on a second run, and the CPU fallback's output to rounding. Several tokens
    through them (gemv_tokens): each row bitwise the token's one-token call, also when written into `out` with the
    next layer's norm (each normed row bitwise the token's own, and the PyTorch norm's to rounding). The block
    kernels (gemv_sorted_from: slots sorted by expert, one binary for every token count): each row bitwise the token
    alone, the direct blocks' call and the call whose workers walk several blocks each, the reference's to rounding,
    also with blocks split (20 tokens)."""
    r = decode_results[tuple(case)]
    tol = 1e-5 if case[0] == "float32" else 2e-3
    assert r["dtype"] == f"torch.{case[0]}" and r["err"] < tol and r["fallback_err"] < tol, r
    assert r["residual_equal"] and r["deterministic"], r
    assert r["tokens_alone"] and r["tokens_err"] < tol, r
    assert r["out_equal"] and r["normed_alone"] and r["normed_err"] < tol, r
    if case[0] == "float16":
        assert r["blocks_alone"] and r["blocks_direct"] and r["blocks_few_workers"] and r["blocks_err"] < tol, r
    if case == DECODE_CASES[4]:
        assert r["blocks20_err"] < tol, r


RESIDUAL_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_fused_moe import random_moe
from reviewer_kernels import fused_moe
for dt, m, shared in [("float32", 1, "gated"), ("float16", 5, "gated"), ("float16", 16, None)]:
    inputs = random_moe(m, 8, 64, 32, 2, getattr(torch, dt), shared, seed=m)
    res = torch.randn(m, 64).to(getattr(torch, dt))
    fused = fused_moe(*inputs, use_triton=True, residual=res)
    apart = res + fused_moe(*inputs, use_triton=True)
    print(json.dumps({"case": [dt, m, shared], "equal": bool(torch.equal(fused, apart))}))
"""


def test_residual_is_added_by_the_sum_kernel_with_pytorch_rounding():
    """fused_moe(..., residual=r) is bit-for-bit r + fused_moe(...): the model may fold its residual add in."""
    pytest.importorskip("triton")
    results = run_interpreted(RESIDUAL_SCRIPT)
    assert len(results) == 3 and all(r["equal"] for r in results), results
    inputs = random_moe(4, 8, 64, 32, 2, torch.bfloat16, "gated", seed=3)  # the CPU fallback: same contract
    res = torch.randn(4, 64).to(torch.bfloat16)
    assert torch.equal(fused_moe(*inputs, residual=res), res + fused_moe(*inputs))
    with pytest.raises(ValueError, match="residual"):
        fused_moe(*inputs, residual=res[:2])


def test_invariant_config_takes_the_tuned_entry_else_direct_blocks_for_a_decode_step():
    """The batch-invariant tile set: a device's tuned `_invariant` entry as it stands; on a device without one, the
    16-token entry's tiles with direct blocks up to 2 tokens at top-8 (no align launch in a decode step) and sorted
    blocks above. Never the one-token kernels."""
    from reviewer_kernels.fused_moe import _tuned_table, get_config, invariant_config, shape_key

    key = shape_key(256, 2048, 512, 8, True)
    tuned = _tuned_table()["NVIDIA H200"][key + "_invariant"]
    assert invariant_config("NVIDIA H200", key, 8) == dict(tuned, decode=False)
    untuned = invariant_config("NVIDIA A100-SXM4-80GB", key, 8)
    sixteen = get_config("NVIDIA A100-SXM4-80GB", key, 16, 8)
    assert sixteen["direct"] is False  # what the untuned fallback ran before: sorted, an align launch every step
    assert untuned == dict(sixteen, direct=True, direct_tokens=2, decode=False)
    assert invariant_config("cpu", shape_key(8, 64, 32, 2, True), 2)["direct_tokens"] == 8


def test_align_workspace_slices_start_on_16_byte_boundaries_for_every_token_count():
    """Triton specialises pointers on 16-byte alignment: slices at token-count-dependent offsets compiled new kernel
    variants for new prompt lengths while serving (the 35B-A3B replay's compilations after ready)."""
    from reviewer_kernels.fused_moe import align_workspace, num_blocks_bound
    for tokens in range(1, 70):
        slots = tokens * 9  # top-8 + the shared expert
        blocks = num_blocks_bound(slots, 257, 16)
        parts = align_workspace(blocks, slots, 512, "cpu")
        assert [p.numel() for p in parts] == [blocks, blocks, blocks, slots, 512]
        assert all(p.data_ptr() % 16 == 0 for p in parts), tokens
        ends = sorted((p.data_ptr(), p.data_ptr() + 4 * p.numel()) for p in parts)
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no two overlap


ALIGN_SCRIPT = r"""
import importlib, json, sys
import torch
sys.path.insert(0, sys.argv[1])
fm = importlib.import_module("reviewer_kernels.fused_moe")
# up to 128 slots: sorted in registers (a 16-token verify at top-8 of 256 among them); above, by torch.sort (its keys
# uint8 up to 256 experts, int16 above)
for m, e, k, shared, bm in [(1, 8, 2, True, 16), (37, 6, 3, True, 16), (16, 256, 8, True, 16), (5, 63, 8, False, 16),
                            (43, 6, 3, True, 16), (100, 16, 4, False, 32), (70, 8, 2, True, 64), (40, 256, 8, True, 16),
                            (40, 300, 4, True, 16)]:
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(m)])
    ids[: m // 2, 0] = 0  # one crowded expert: several blocks
    sorted_slots, bexp, bstart, bcount = fm.align_slots(ids, e, shared, bm)
    print(json.dumps({"ids": ids.tolist(), "e": e, "shared": shared, "bm": bm, "sorted": sorted_slots.tolist(),
                      "bexp": bexp.tolist(), "bstart": bstart.tolist(), "bcount": bcount.tolist()}))
"""


def check_alignment(r: dict) -> None:
    """align_slots' outputs (r: ids, e, shared, bm, sorted, bexp, bstart, bcount as lists) are a stable sort of
    the slots by expert, cut into blocks that cover every slot once."""
    flat = [x for row in r["ids"] for x in row]
    m, k = len(r["ids"]), len(r["ids"][0])
    expert_of = flat + ([r["e"]] * m if r["shared"] else [])
    expected = sorted(range(len(expert_of)), key=lambda s: (expert_of[s], s))  # stable sort by expert
    assert r["sorted"] == expected
    covered = []
    for e, start, count in zip(r["bexp"], r["bstart"], r["bcount"]):
        if e < 0:
            assert count == 0
            continue
        assert 0 < count <= r["bm"]
        rows = r["sorted"][start:start + count]
        assert all(expert_of[s] == e for s in rows)
        covered += rows
    assert sorted(covered) == list(range(len(expert_of)))  # every slot in exactly one block
    assert len(r["bexp"]) >= sum(-(-expert_of.count(e) // r["bm"]) for e in set(expert_of))
    assert m * k == len(flat)


def test_align_kernel_sorts_slots_and_builds_the_block_table():
    pytest.importorskip("triton")
    for r in run_interpreted(ALIGN_SCRIPT):
        check_alignment(r)


ROUTE_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from reviewer_kernels import route_topk, route_topk_torch
torch.manual_seed(0)
for dt in ("float32", "float16"):
    for m, e, k, renorm in [(1, 16, 2, True), (5, 60, 8, True), (40, 256, 8, True), (33, 128, 4, False),
                           (100, 256, 8, True)]:  # the last: past SMALL_BATCH, several tokens per program
        logits = (torch.randn(m, e) * 3).to(getattr(torch, dt))
        w, ids = route_topk(logits, k, renorm, use_triton=True)
        w_ref, ids_ref = route_topk_torch(logits, k, renorm)
        probs = torch.softmax(logits, -1, dtype=torch.float)
        print(json.dumps({"case": [dt, m, e, k, renorm], "dtype": str(w.dtype), "ids_dtype": str(ids.dtype),
                          "same_ids": torch.equal(ids, ids_ref), "slots": ids.numel(),
                          "differing": int((ids != ids_ref).sum()),
                          # a differing id is fine only if it ties: the same probability at the same rank
                          "same_probs": torch.equal(probs.gather(1, ids), probs.gather(1, ids_ref)),
                          "w_err": (w.double() - w_ref.double()).abs().max().item()}))
"""


ROUTER_SCRIPT = r"""
import json, sys
import torch
import torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
from reviewer_kernels import route_topk_from_hidden, route_topk_torch
torch.manual_seed(0)
for m, e, hidden, k in [(1, 256, 640, 8), (5, 60, 96, 4), (16, 256, 640, 8), (20, 64, 96, 2)]:  # 20: F.linear path
    h, w = torch.randn(m, hidden), torch.randn(e, hidden) / hidden ** 0.5
    weights, ids = route_topk_from_hidden(h, w, k, use_triton=True)
    w_ref, ids_ref = route_topk_torch(F.linear(h, w), k)
    first_w, first_ids = route_topk_from_hidden(h[:1], w, k, use_triton=True)  # one token alone: the same bits
    # routed inside the matmul's launch (its last program), twice: the counter is left at zero
    one_w, one_ids = route_topk_from_hidden(h, w, k, use_triton=True, one_launch=True)
    again_w, again_ids = route_topk_from_hidden(h, w, k, use_triton=True, one_launch=True)
    alone_w, alone_ids = route_topk_from_hidden(h[:1], w, k, use_triton=True, one_launch=True)
    print(json.dumps({"case": [m, e, hidden, k], "same_ids": torch.equal(ids, ids_ref),
                      "w_err": (weights - w_ref).abs().max().item(),
                      "row_invariant": torch.equal(first_w[0], weights[0]) and torch.equal(first_ids[0], ids[0]),
                      "one_launch_same_ids": torch.equal(one_ids, ids_ref),
                      "one_launch_w_err": (one_w - w_ref).abs().max().item(),
                      "one_launch_repeatable": torch.equal(one_w, again_w) and torch.equal(one_ids, again_ids),
                      "one_launch_row_invariant": torch.equal(alone_w[0], one_w[0])
                      and torch.equal(alone_ids[0], one_ids[0])}))
"""


NORM_INSIDE_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from reviewer_kernels import route_topk_from_hidden
from reviewer_kernels.moe_reference import rms_norm_scaled
torch.manual_seed(0)
for dt, e, h, k, m in [("float32", 16, 96, 4, 1), ("float16", 16, 96, 4, 1), ("float32", 64, 80, 2, 1),
                       ("float32", 16, 96, 4, 3)]:  # 3 tokens: normed in PyTorch first, same contract
    x = (torch.randn(m, h) * 3 + 1).to(getattr(torch, dt))  # far from unit scale: a missing norm shows
    norm = (torch.rand(h) + 0.5, 1e-6)
    router = (torch.randn(e, h) / h ** 0.5).to(x.dtype)
    normed = torch.full_like(x, float("nan"))
    w_in, ids_in = route_topk_from_hidden(x, router, k, use_triton=True, rms_norm=norm, normed_out=normed)
    ref = rms_norm_scaled(x, *norm)
    w_ref, ids_ref = route_topk_from_hidden(ref, router, k, use_triton=True)
    print(json.dumps({"case": [dt, e, h, k, m], "same_ids": torch.equal(ids_in, ids_ref),
                      "w_err": (w_in.double() - w_ref.double()).abs().max().item(),
                      "normed_err": (normed.double() - ref.double()).abs().max().item()}))
"""


def test_rms_norm_inside_the_one_token_router_kernel():
    """route_topk_from_hidden(rms_norm=(weight, eps), normed_out=...): at one token the router matmul kernel norms
    the raw residual stream itself, routes as if given rms_norm_scaled(x), and stores the normed row for the experts
    (several tokens: the same contract, normed in PyTorch). Without normed_out it refuses."""
    pytest.importorskip("triton")
    results = run_interpreted(NORM_INSIDE_SCRIPT)
    assert len(results) == 4
    for r in results:
        tol = 1e-5 if r["case"][0] == "float32" else 2e-3
        assert r["same_ids"] and r["w_err"] < tol and r["normed_err"] < tol, r
    from reviewer_kernels import route_topk_from_hidden
    with pytest.raises(ValueError, match="normed_out"):
        route_topk_from_hidden(torch.randn(1, 8), torch.randn(4, 8), 2, rms_norm=(torch.ones(8), 1e-6))


PARTS_NORM_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from reviewer_kernels import route_topk_from_hidden
from reviewer_kernels.wide_linear import sumsq_partials_torch
torch.manual_seed(0)
for dt, e, h, k, m, parts in [("float32", 16, 96, 4, 5, 3), ("float16", 16, 128, 4, 16, 4),
                              ("float32", 64, 64, 2, 1, 1), ("float16", 16, 2048, 4, 3, 32)]:
    x = (torch.randn(m, h) * 3 + 1).to(getattr(torch, dt))
    weight, eps = torch.rand(h) + 0.5, 1e-6
    router = (torch.randn(e, h) / h ** 0.5).to(x.dtype)
    ss = sumsq_partials_torch(x, parts)  # what wide_linear(..., sumsq=True) leaves
    normed = torch.full_like(x, float("nan"))
    w_in, ids_in = route_topk_from_hidden(x, router, k, use_triton=True, rms_norm=(weight, eps), normed_out=normed,
                                          sumsq=ss)
    normed_t = torch.full_like(x, float("nan"))
    w_t, ids_t = route_topk_from_hidden(x, router, k, use_triton=False, rms_norm=(weight, eps), normed_out=normed_t,
                                        sumsq=ss)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).sum(1, keepdim=True) / h + eps) * weight).to(x.dtype)
    w_ref, ids_ref = route_topk_from_hidden(ref, router, k, use_triton=True)
    alone = [route_topk_from_hidden(x[t:t + 1], router, k, use_triton=True, rms_norm=(weight, eps),
                                    normed_out=torch.empty_like(x[:1]), sumsq=sumsq_partials_torch(x[t:t + 1], parts))
             for t in range(m)]
    print(json.dumps({"case": [dt, e, h, k, m, parts], "same_ids": torch.equal(ids_in, ids_ref),
                      "fallback_ids": torch.equal(ids_t, ids_ref),
                      "w_err": (w_in.double() - w_ref.double()).abs().max().item(),
                      "normed_err": (normed.double() - ref.double()).abs().max().item(),
                      "fallback_normed_err": (normed_t.double() - ref.double()).abs().max().item(),
                      "rows_alone": all(torch.equal(a[0][0], w_in[t]) for t, a in enumerate(alone))}))
"""


def test_rms_norm_from_sums_of_squares_inside_the_router_kernel():
    """route_topk_from_hidden(rms_norm=..., normed_out=..., sumsq=partials): for up to 16 tokens the router matmul
    kernel norms the rows from the sums of squares an output projection left (wide_linear's sumsq), routes as if
    given the normed rows and stores them for the experts (the first expert tile's programs, a K slice each); a token
    alone gets the block's bits; off Triton the same contract in PyTorch. Bad partials are refused. The 2,048-wide case
    takes a slice in one K step (ROUTER_NORM_BLOCK_K), the narrow ones the loop's steps."""
    pytest.importorskip("triton")
    results = run_interpreted(PARTS_NORM_SCRIPT)
    assert len(results) == 4
    for r in results:
        tol = 1e-5 if r["case"][0] == "float32" else 2e-3
        assert r["same_ids"] and r["fallback_ids"] and r["rows_alone"], r
        assert r["w_err"] < tol and r["normed_err"] < tol and r["fallback_normed_err"] < tol, r
    from reviewer_kernels import route_topk_from_hidden
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="sumsq"):
        route_topk_from_hidden(x, torch.randn(4, 8), 2, normed_out=x.clone(), sumsq=torch.zeros(1, 16))
    with pytest.raises(ValueError, match="sumsq"):
        route_topk_from_hidden(x, torch.randn(4, 8), 2, rms_norm=(torch.ones(8), 1e-6), normed_out=x.clone(),
                               sumsq=torch.zeros(1, 8))


def test_router_matmul_kernel_routes_like_linear_then_topk():
    """route_topk_from_hidden: the router matmul in our kernel (fp32 K-slices added in order) + routing, against
    F.linear + the PyTorch router math; up to ROUTER_MAX_TOKENS (a decode step, a verify block) a token's routing
    does not depend on how many tokens share the call, to the bit. Past it (20 tokens: a prefill) the call is
    F.linear's, whose summation order is the CPU BLAS's own (it matched the kernel's bits on an Intel machine, not on
    an AMD one), so there it is checked against the reference, not bit for bit against the one-token kernel."""
    pytest.importorskip("triton")
    from reviewer_kernels.moe_routing import ROUTER_MAX_TOKENS

    results = run_interpreted(ROUTER_SCRIPT)
    assert len(results) == 4
    for r in results:
        assert r["same_ids"] and r["w_err"] < 1e-5, r
        assert r["row_invariant"] or r["case"][0] > ROUTER_MAX_TOKENS, r
        # one_launch (routing by the matmul's last program): the same experts, and its own bits for a token alone
        assert r["one_launch_same_ids"] and r["one_launch_w_err"] < 1e-5 and r["one_launch_repeatable"], r
        assert r["one_launch_row_invariant"] or r["case"][0] > ROUTER_MAX_TOKENS, r
    assert sum(r["case"][0] <= ROUTER_MAX_TOKENS for r in results) == 3  # the kernel path is what is held to bits


def test_routing_kernel_matches_transformers_router_math():
    pytest.importorskip("triton")
    results = run_interpreted(ROUTE_SCRIPT)
    assert len(results) == 10
    for r in results:
        dt = r["case"][0]
        assert r["dtype"] == f"torch.{dt}" and r["ids_dtype"] == "torch.int64"
        # the same probability at every rank; an id may differ only where two probabilities round to one value
        # (the kernel takes the lowest index among ties, torch.topk's order among ties is unspecified)
        assert r["same_probs"], r
        assert r["w_err"] < (1e-6 if dt == "float32" else 1e-3), r
    # ties are rare (fp16 logits tie most): nearly every (token, rank) slot holds the very same expert
    assert sum(r["differing"] for r in results) <= sum(r["slots"] for r in results) // 50, results


# --- The model patch ------------------------------------------------------------------------------------------

def tiny_qwen3_5_moe():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=16,
        num_experts_per_tok=4, max_position_embeddings=256, initializer_range=0.05)
    return Qwen3_5MoeForCausalLM(config).eval()


def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=256, initializer_range=0.05)
    return Qwen3MoeForCausalLM(config).eval()


def greedy(model, prompt, new_tokens=10):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)


@pytest.mark.parametrize("make_model, num_moe_layers", [(tiny_qwen3_5_moe, 4), (tiny_qwen3_moe, 2)])
def test_patched_model_decodes_token_identically(make_model, num_moe_layers):
    from backend.decoding.moe_patch import patch_moe, unpatch_moe

    torch.manual_seed(0)
    model = make_model()
    prompt = torch.randint(0, 256, (1, 12))
    stock = greedy(model, prompt)
    assert patch_moe(model) == num_moe_layers
    assert patch_moe(model) == 0  # idempotent
    block = next(m for m in model.modules() if hasattr(m, "_unfused_forward"))
    x = torch.randn(1, 7, 64)
    assert torch.allclose(block(x), block._unfused_forward(x), rtol=1e-4, atol=1e-6)
    assert torch.equal(greedy(model, prompt), stock)
    assert unpatch_moe(model) == num_moe_layers
    assert torch.equal(greedy(model, prompt), stock)


GREEDY_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.reviewer_kernels.test_fused_moe import greedy, tiny_qwen3_5_moe
from backend.decoding.moe_patch import patch_moe
import importlib
fm = importlib.import_module("reviewer_kernels.fused_moe")
torch.manual_seed(1)
model = tiny_qwen3_5_moe()
prompt = torch.randint(0, 256, (1, 9))
stock = greedy(model, prompt, 6)
calls = []
triton_path = fm.fused_moe_triton
fm.fused_moe_triton = lambda *a, **k: calls.append(1) or triton_path(*a, **k)
patched = patch_moe(model)
fused = greedy(model, prompt, 6)
print(json.dumps({"patched": patched, "triton_calls": len(calls), "stock": stock.tolist(), "fused": fused.tolist()}))
"""


def test_patched_model_through_triton_interpreter_decodes_token_identically():
    pytest.importorskip("triton")
    (result,) = run_interpreted(GREEDY_SCRIPT)
    assert result["patched"] == 4 and result["triton_calls"] >= 4 * 6  # every layer, every step ran the kernel
    assert result["fused"] == result["stock"]


# --- GPU (bf16, real shapes) ----------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def hot_moe(seed: int):
    """16 tokens at the 35B-A3B expert shape in bf16 on the GPU, routed top-8 among 50 hot experts (a real router's
    locality: tokens share experts, which sorted blocks change): x, gate_up, down, weights, ids, shared."""
    x, gate_up, down, _, _, shared = random_moe(16, 256, 2048, 512, 8, torch.bfloat16, seed=seed, device="cuda")
    g = torch.Generator().manual_seed(seed)
    hot = torch.randperm(256, generator=g)[:50]
    ids = torch.stack([hot[torch.randperm(50, generator=g)[:8]] for _ in range(16)]).cuda()
    weights = torch.softmax(torch.randn(16, 8, generator=g), -1).to("cuda", torch.bfloat16)
    return x, gate_up, down, weights, ids, shared


def assert_rows_alone_inside_graphs(run, alone: torch.Tensor) -> None:
    """run(m) for m = 2..16 is bitwise alone[:m] (each token computed alone), and a CUDA graph of run(16) replayed
    twice gives those bits again."""
    for m in range(2, 17):
        assert torch.equal(run(m), alone[:m]), m
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = run(16)
    for _ in range(2):
        static.fill_(float("nan"))
        graph.replay()
        assert torch.equal(static, alone)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 2, 16, 64, 300])
def test_bf16_on_gpu_matches_float64_reference(num_tokens):
    inputs = random_moe(num_tokens, 256, 2048, 512, 8, torch.bfloat16, "gated", device="cuda")
    d = lambda t: t.double() if t is not None else None  # noqa: E731
    x, gate_up, down, weights, ids, shared = inputs
    ref = fused_moe_torch(d(x), d(gate_up), d(down), d(weights), ids, SharedExpert(*(d(t) for t in shared)))
    torch.full((1 << 28,), float("nan"), device="cuda")  # freed NaNs: an unwritten output would show
    out = fused_moe(*inputs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_err(out, ref) < 5e-3
    assert torch.equal(out, fused_moe(*inputs))  # deterministic: no atomics


@pytest.mark.gpu
@needs_cuda
def test_routing_kernel_on_gpu_matches_torch_router():
    from reviewer_kernels import route_topk, route_topk_torch

    logits = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    w, ids = route_topk(logits, 8)
    w_ref, ids_ref = route_topk_torch(logits, 8)
    probs = torch.softmax(logits, -1, dtype=torch.float)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ids_ref))  # same experts up to exact ties
    assert (w.float() - w_ref.float()).abs().max().item() < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_router_matmul_kernel_on_gpu_matches_linear_then_topk():
    from reviewer_kernels import route_topk_from_hidden, route_topk_torch

    torch.manual_seed(0)
    h = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(256, 2048, device="cuda") / 2048 ** 0.5).to(torch.bfloat16)
    weights, ids = route_topk_from_hidden(h, w, 8)
    logits = torch.nn.functional.linear(h, w)
    w_ref, ids_ref = route_topk_torch(logits, 8)
    # bf16 logits from another summation order may differ by an ulp: compare the chosen experts' true probabilities
    probs = torch.softmax(logits.float(), -1)
    assert (probs.gather(1, ids).sum(1) - probs.gather(1, ids_ref).sum(1)).abs().max().item() < 1e-2
    assert (weights.float() - w_ref.float()).abs().max().item() < 2e-2
    one_w, one_ids = route_topk_from_hidden(h[:1], w, 8)  # a decode step routes its token as the verify does
    assert torch.equal(one_ids[0], ids[0]) and torch.equal(one_w[0], weights[0])
    # routed inside the matmul's launch: the same experts; a token alone gets the bits it gets among 16
    fused_w, fused_ids = route_topk_from_hidden(h, w, 8, one_launch=True)
    assert torch.equal(fused_ids, ids) and (fused_w.float() - weights.float()).abs().max().item() < 1e-2
    alone_w, alone_ids = route_topk_from_hidden(h[:1], w, 8, one_launch=True)
    assert torch.equal(alone_ids[0], fused_ids[0]) and torch.equal(alone_w[0], fused_w[0])
    assert torch.equal(route_topk_from_hidden(h, w, 8, one_launch=True)[0], fused_w)  # the counter was reset


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_matches_launch():
    x, gate_up, down, weights, ids, shared = random_moe(16, 256, 2048, 512, 8, torch.bfloat16, device="cuda")
    fused_moe(x, gate_up, down, weights, ids, shared)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fused_moe(x, gate_up, down, weights, ids, shared)
    fresh = random_moe(16, 256, 2048, 512, 8, torch.bfloat16, device="cuda")
    x.copy_(fresh[0])
    weights.copy_(fresh[3])
    ids.copy_(fresh[4])
    graph.replay()
    assert torch.equal(static, fused_moe(x, gate_up, down, weights, ids, shared))


@pytest.mark.gpu
@needs_cuda
def test_invariant_tiles_compute_each_row_as_alone_on_gpu():
    """The tile set of batch-invariant steps (invariant_config: direct blocks up to its direct_tokens, blocks sorted by
    expert above) gives every row of a 2..16-token call the bits of that token computed alone, under hot-set
    routing where tokens share experts (what sorted blocks change). Speculative output equals plain decoding
    through this."""
    from reviewer_kernels.fused_moe import invariant_config, shape_key

    x, gate_up, down, weights, ids, shared = hot_moe(3)
    config = invariant_config(torch.cuda.get_device_name(), shape_key(256, 2048, 512, 8, True), 8)
    assert config["decode"] is False
    alone = torch.cat([fused_moe(x[t:t + 1], gate_up, down, weights[t:t + 1], ids[t:t + 1], shared, config=config)
                       for t in range(16)])
    assert rel_err(alone, reference64(x, gate_up, down, weights, ids, shared)) < 2e-2
    for m in range(2, 17):
        together = fused_moe(x[:m], gate_up, down, weights[:m], ids[:m], shared, config=config)
        assert torch.equal(together, alone[:m]), m


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("sorted_from", [None, 2], ids=["token-axis", "blocks"])
def test_cuda_one_token_programs_compute_each_row_as_alone_inside_graphs(sorted_from):
    """The one-token experts for every token count, at the 35B-A3B shape in bf16 under hot-set routing: decode_moe's
    token axis (gemv_tokens), or blocks_moe (gemv_sorted_from: each expert's rows read once a call). The float64
    reference's result; every row of a 2..16-token call, with its residual, bitwise the token alone (the claim the
    interpreter cannot make for a GPU build: one binary, its arithmetic the same per token); and a CUDA graph of the
    16-token call, replayed twice, the eager bits."""
    x, gate_up, down, weights, ids, shared = hot_moe(7)
    res = torch.randn(16, 2048, device="cuda").bfloat16()
    config = {"decode": None, "gemv_tokens": 16, **({"gemv_sorted_from": sorted_from} if sorted_from else {})}
    run = lambda m: fused_moe(x[:m], gate_up, down, weights[:m], ids[:m], shared, config=config,  # noqa: E731
                              residual=res[:m])
    alone = torch.cat([fused_moe(x[t:t + 1], gate_up, down, weights[t:t + 1], ids[t:t + 1], shared, config=config,
                                 residual=res[t:t + 1]) for t in range(16)])
    assert rel_err(fused_moe(x, gate_up, down, weights, ids, shared, config=config),
                   reference64(x, gate_up, down, weights, ids, shared)) < 2e-2
    assert_rows_alone_inside_graphs(run, alone)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("gate_up, down", [
    ({"BN": 32, "BK": 256, "warps": 4, "stages": 1, "split": 8}, {"BN": 64, "BK": 256, "warps": 4, "stages": 1}),
    ({"BN": 64, "BK": 128, "warps": 4, "stages": 3, "split": 4}, {"BN": 32, "BK": 512, "warps": 4, "stages": 1}),
])
def test_split_tiles_on_gpu_compute_each_row_as_alone_inside_graphs(gate_up, down):
    """K-split gate_up tiles (finished by the last split of each tile through an arrival counter): the float64
    reference's result, every row of a 2..16-token call bitwise the token alone (direct and sorted blocks), and a CUDA
    graph replayed twice gives the eager bits (the counters are left at zero)."""
    x, gate_up_w, down_w, weights, ids, shared = hot_moe(4)
    config = {"direct": True, "direct_tokens": 4, "BM": 16, "decode": False, "gate_up": gate_up, "down": down}
    run = lambda m: fused_moe(x[:m], gate_up_w, down_w, weights[:m], ids[:m], shared, config=config)  # noqa: E731
    alone = torch.cat([fused_moe(x[t:t + 1], gate_up_w, down_w, weights[t:t + 1], ids[t:t + 1], shared,
                                 config=config) for t in range(16)])
    assert rel_err(alone, reference64(x, gate_up_w, down_w, weights, ids, shared)) < 2e-2
    assert_rows_alone_inside_graphs(run, alone)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "sorted"])
def test_cuda_slots_summed_in_the_down_kernel_are_the_slot_sum_s_bits_inside_graphs(direct):
    """sum_in_down (the last down program of each token and N-tile adds its rows): bitwise the slot sum's launch at
    1..16 tokens with the residual, under hot-set routing, and a CUDA graph replayed 8 times gives the same bits each
    time (the arrival counters are left at zero; a race between the programs would show as a replay that differs)."""
    x, gate_up, down, weights, ids, shared = hot_moe(6)
    res = torch.randn(16, 2048, device="cuda").bfloat16()
    config = {"direct": direct, "direct_tokens": 16, "BM": 16, "decode": False,
              "gate_up": {"BN": 32, "BK": 256, "warps": 4, "stages": 3, "split": 1},
              "down": {"BN": 64, "BK": 128, "warps": 4, "stages": 3}}

    def run(m: int, summed: bool) -> torch.Tensor:
        return fused_moe(x[:m], gate_up, down, weights[:m], ids[:m], shared, residual=res[:m],
                         config=dict(config, sum_in_down=summed))

    for m in (1, 2, 5, 16):
        assert torch.equal(run(m, True), run(m, False)), m
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = run(16, True)
    reference = run(16, False)
    for _ in range(8):
        static.fill_(float("nan"))
        graph.replay()
        assert torch.equal(static, reference)


@pytest.mark.gpu
@needs_cuda
def test_cuda_align_slots_sorts_in_registers_and_by_torch():
    """The compiled align kernel on its two paths (<= 128 slots sorted in registers, more by torch.sort), hot-set
    routing so experts hold several slots."""
    from reviewer_kernels.fused_moe import align_slots

    g = torch.Generator().manual_seed(5)
    hot = torch.randperm(256, generator=g)[:50]
    for m, shared in [(1, True), (5, True), (16, True), (16, False), (17, True), (300, True), (1700, True)]:
        ids = torch.stack([hot[torch.randperm(50, generator=g)[:8]] for _ in range(m)]).cuda()
        sorted_slots, bexp, bstart, bcount = align_slots(ids, 256, shared, 16)
        check_alignment({"ids": ids.tolist(), "e": 256, "shared": shared, "bm": 16, "sorted": sorted_slots.tolist(),
                         "bexp": bexp.tolist(), "bstart": bstart.tolist(), "bcount": bcount.tolist()})
