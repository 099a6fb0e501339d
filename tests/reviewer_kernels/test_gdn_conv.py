"""reviewer_kernels/gdn_conv.py: the Gated DeltaNet convolution of a decode step or verify block, with its cache update,
in one launch, and of a prefill piece (gdn_conv_prefill: row blocks, then the state update), against its PyTorch twin
(the compiled glue's math).

Under Triton's CPU interpreter (a subprocess; fp32 and fp16) and, on a GPU, in bf16 at the 35B-A3B shape. The model
wired through it (the padded steps against the regular forward) is tests/backend/models/test_fast_models.py's.
"""

from __future__ import annotations

import pytest
import torch

from reviewer_kernels.gdn_conv import gdn_conv, gdn_conv_prefill, gdn_conv_torch
from tests.reviewer_kernels.test_fused_moe import interpreted_by_case

# (dtype, rows, channels, conv width W (kernel W + 1), real rows T): a decode step, a verify cut short, a whole
# verify, fewer rows than a padded step, a narrower kernel; channels not a multiple of the program's 64
CASES = [(dt, *case) for dt in ("float32", "float16") for case in [
    (16, 200, 3, 1), (16, 200, 3, 5), (16, 130, 3, 16), (5, 64, 3, 4), (16, 96, 2, 7)]]
# prefill pieces (dtype, rows T, channels, W): several row blocks with a partial last one, fewer rows than W, one row
PREFILL_CASES = [(dt, *case) for dt in ("float32", "float16") for case in [(77, 130, 3), (2, 64, 3), (1, 96, 2)]]


def make_case(R, C, W, dtype=torch.float32, device="cpu", seed=0):
    """mixed as a column slice of a wider projection (its rows strided), the conv state, the kernel."""
    g = torch.Generator(device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device).to(dtype)  # noqa: E731
    return r(R, C + 40)[:, :C], r(W, C), r(C, W + 1)


def run_both(mixed, state, w, T, use_triton=True):
    """(kernel, twin) results of both modes: {"step": (out, conv_state after), "verify": (out, window, state)}."""
    results = []
    for fn in (lambda *a, **k: gdn_conv(*a, use_triton=use_triton, **k), gdn_conv_torch):
        step_state, verify_state = state.clone(), state.clone()
        window = torch.full((state.shape[0] + 16, state.shape[1]), 7.0, dtype=state.dtype, device=state.device)
        step = fn(mixed, step_state, w, T)
        if fn is gdn_conv_torch:
            verify = fn(mixed, verify_state, w, T, window)
        else:
            verify = fn(mixed, verify_state, w, T, window_out=window)
        results.append({"step": (step, step_state), "verify": (verify, window, verify_state)})
    return results


INTERPRETER_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from reviewer_kernels.gdn_conv import gdn_conv_prefill, gdn_conv_torch
from tests.reviewer_kernels.test_gdn_conv import CASES, PREFILL_CASES, make_case, run_both
for case in CASES:
    dt, R, C, W, T = case
    mixed, state, w = make_case(R, C, W, getattr(torch, dt))
    kernel, twin = run_both(mixed, state, w, T)
    out, new_state = kernel["step"]
    ref, ref_state = twin["step"]
    v_out, window, untouched = kernel["verify"]
    print(json.dumps({"case": list(case), "err": (out.double() - ref.double()).abs().max().item(),
                      "scale": ref.abs().max().item(), "state_equal": torch.equal(new_state, ref_state),
                      "verify_same_out": torch.equal(v_out, out), "window_equal": torch.equal(window, twin["verify"][1]),
                      "verify_leaves_state": torch.equal(untouched, state)}))
for case in PREFILL_CASES:
    dt, T, C, W = case
    mixed, state, w = make_case(T, C, W, getattr(torch, dt))
    kernel_state, twin_state = state.clone(), state.clone()
    out = gdn_conv_prefill(mixed, kernel_state, w, use_triton=True)
    ref = gdn_conv_torch(mixed, twin_state, w, T)
    print(json.dumps({"case": ["prefill", *case], "err": (out.double() - ref.double()).abs().max().item(),
                      "scale": ref.abs().max().item(), "state_equal": torch.equal(kernel_state, twin_state)}))
"""


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted_by_case(INTERPRETER_SCRIPT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_conv_kernel_matches_its_twin_and_updates_the_cache(interpreter_results, case):
    """Every row's SiLU(conv) to rounding (fp16: the same bits here); a decode step's conv state moves on to the
    last W inputs bit for bit; a verify leaves the state alone, writes the window's first W + T rows and nothing
    else (the rest keeps its fill), and computes the same rows as the step."""
    r = interpreter_results[tuple(case)]
    assert r["scale"] > 0.1, r
    assert r["err"] < (1e-6 if case[0] == "float32" else 1e-3), r
    assert r["state_equal"] and r["verify_same_out"] and r["window_equal"] and r["verify_leaves_state"], r


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_prefill_conv_kernel_matches_its_twin_and_moves_the_state_on(interpreter_results, case):
    """A prefill piece: every row's SiLU(conv) to rounding (fp16: the same bits here), and the conv state after it
    the last W inputs bit for bit (also when the piece is shorter than W)."""
    r = interpreter_results[("prefill", *case)]
    assert r["scale"] > 0.1, r
    assert r["err"] < (1e-6 if case[0] == "float32" else 1e-3), r
    assert r["state_equal"], r


def test_twin_is_the_compiled_glues_math_and_bad_shapes_say_why():
    """On the CPU without the interpreter the twin runs; its rows are the prefill glue's (deltanet_conv: the same
    causal_conv, then its split into q, k, v), and it moves the state to window[T:T + W]."""
    from backend.models.qwen3_5_moe import deltanet_conv

    mixed, state, w = make_case(16, 48, 3)
    T = 4
    before = state.clone()
    out = gdn_conv(mixed, state, w, T)
    window, q, k, v, *_ = deltanet_conv(torch.cat([mixed, torch.zeros(16, 16 + 2)], -1), before, w, 1, 1, 16, 16)
    assert torch.equal(out, torch.cat([q.reshape(16, -1), k.reshape(16, -1), v.reshape(16, -1)], -1))
    assert torch.equal(state, window[T:T + 3])
    with pytest.raises(ValueError, match="conv_w"):
        gdn_conv(mixed, state, w[:, :3], T)
    with pytest.raises(ValueError, match="1 <= T <= R"):
        gdn_conv(mixed, state, w, 17)
    with pytest.raises(ValueError, match="window_out"):
        gdn_conv(mixed, state, w, T, window_out=torch.zeros(5, 48))
    with pytest.raises(ValueError, match="conv_w"):
        gdn_conv_prefill(mixed, state, w[:, :3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_conv_at_the_35b_shape_matches_its_twin_in_every_mode():
    """bf16 at the 35B-A3B shape (8,192 channels, kernel 4, 16 padded rows): a decode step and verifies of 1..16
    rows; the state and window updates bit for bit; a row's output does not depend on T."""
    mixed, state, w = make_case(16, 8192, 3, torch.bfloat16, "cuda", seed=1)
    outs = []
    for T in (1, 2, 7, 16):
        kernel, twin = run_both(mixed, state, w, T)
        out, new_state = kernel["step"]
        assert (out.float() - twin["step"][0].float()).abs().max().item() < 2e-2
        assert torch.equal(new_state, twin["step"][1])
        assert torch.equal(kernel["verify"][1], twin["verify"][1]) and torch.equal(kernel["verify"][2], state)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefill_conv_at_the_35b_shape_matches_its_twin():
    """bf16 at the 35B-A3B shape, an agent turn's piece (1,024 rows) and a short one: rows to rounding, the state
    moved on bit for bit."""
    for T in (1024, 70):
        mixed, state, w = make_case(T, 8192, 3, torch.bfloat16, "cuda", seed=2)
        kernel_state, twin_state = state.clone(), state.clone()
        out = gdn_conv_prefill(mixed, kernel_state, w)
        ref = gdn_conv_torch(mixed, twin_state, w, T)
        assert (out.float() - ref.float()).abs().max().item() < 2e-2
        assert torch.equal(kernel_state, twin_state)
