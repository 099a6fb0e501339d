"""reviewer_kernels/norms.py: the prefill pieces' RMSNorms (plain, after a residual add, gated per head) against their
PyTorch twins, which are the model's own glue (backend/models/qwen3_5_moe.py imports them).

Under Triton's CPU interpreter (a subprocess; fp32 and fp16) and, on a GPU, in bf16 at the 35B-A3B shape.
"""

from __future__ import annotations

import pytest
import torch

from reviewer_kernels.norms import add_rms_norm, gated_rms_norm, gated_rms_norm_torch, rms_norm, rms_norm_torch
from tests.reviewer_kernels.test_fused_moe import interpreted_by_case

# (dtype, rows, width, heads of the gated norm): partial row blocks, widths that are not powers of two, one row
CASES = [(dt, *case) for dt in ("float32", "float16") for case in [(37, 200, 4), (1, 64, 2), (130, 48, 3)]]


def make_case(T, N, H, dtype=torch.float32, device="cpu", seed=0):
    """x and y as column slices of wider tensors (strided rows), an fp32 weight; the gated norm's x and gate as
    [T, H, N / H]-shaped views into projection rows, its weight in the input dtype."""
    g = torch.Generator(device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    x, y, w = r(T, N + 24).to(dtype)[:, :N], r(T, N + 8).to(dtype)[:, :N], r(N)
    d = N // H
    core, gate = r(T, H * d + 16).to(dtype)[:, :H * d].view(T, H, d), r(T, H, d).to(dtype)
    return x, y, w, core, gate, r(d).to(dtype)


INTERPRETER_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from reviewer_kernels.norms import PADDED_GATED_NORM, add_rms_norm, gated_rms_norm, rms_norm
from tests.reviewer_kernels.test_norms import CASES, make_case
err = lambda a, b: (a.double() - b.double()).abs().max().item()
for case in CASES:
    dt, T, N, H = case
    x, y, w, core, gate, gw = make_case(T, N, H, getattr(torch, dt))
    s, n = add_rms_norm(x, y, w, 1e-6, use_triton=True)
    s_ref, n_ref = add_rms_norm(x, y, w, 1e-6, use_triton=False)
    g = gated_rms_norm(core, gate, gw, 1e-6, use_triton=True)
    g_ref = gated_rms_norm(core, gate, gw, 1e-6, use_triton=False)
    g_pad = gated_rms_norm(core, gate, gw, 1e-6, use_triton=True, **PADDED_GATED_NORM)
    into = torch.full((T + 2, N), 7.0, dtype=x.dtype)  # rows of a larger tensor: the first T written, no others
    rms_norm(x, w, 1e-6, use_triton=True, out=into[:T])
    t = T // 2  # one token's heads alone, in the padded steps' launch shape
    alone = gated_rms_norm(core[t:t + 1], gate[t:t + 1], gw, 1e-6, use_triton=True, **PADDED_GATED_NORM)
    print(json.dumps({"case": list(case), "norm": err(rms_norm(x, w, 1e-6, use_triton=True),
                                                      rms_norm(x, w, 1e-6, use_triton=False)),
                      "into": torch.equal(into[:T], rms_norm(x, w, 1e-6, use_triton=True))
                              and bool((into[T:] == 7).all()),
                      "sum_equal": torch.equal(s, s_ref), "add_norm": err(n, n_ref), "gated": err(g, g_ref),
                      "gated_shape": list(g.shape), "scale": n_ref.abs().max().item(),
                      "padded": err(g_pad, g_ref), "padded_alone": torch.equal(alone[0], g_pad[t])}))
"""


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted_by_case(INTERPRETER_SCRIPT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_norm_kernels_match_their_twins(interpreter_results, case):
    """Each norm to rounding (fp16: the same bits here), also written into rows of a larger tensor (out=), the
    residual sum bit for bit, the gated norm [T, H * d];
    in the padded steps' launch shape too, where a token's heads alone get the bits they get among other tokens."""
    r = interpreter_results[tuple(case)]
    tol = 2e-6 if case[0] == "float32" else 1e-3
    assert r["scale"] > 0.5, r
    assert r["norm"] < tol and r["add_norm"] < tol and r["gated"] < tol and r["sum_equal"], r
    assert r["padded"] < tol and r["padded_alone"] and r["into"], r
    assert r["gated_shape"] == [case[1], case[2] // case[3] * case[3]], r


def test_twins_are_the_models_norms_and_bad_shapes_say_why():
    """Without Triton the twins run: the model's glue functions are these very ones; shapes are checked first."""
    from backend.models import qwen3_5_moe

    assert qwen3_5_moe.qwen_rms_norm is rms_norm_torch and qwen3_5_moe.gated_rms_norm is gated_rms_norm_torch
    x, y, w, core, gate, gw = make_case(5, 32, 2)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))
    assert torch.equal(gated_rms_norm(core, gate, gw, 1e-6),
                       gated_rms_norm_torch(core.reshape(-1, 16), gate.reshape(-1, 16), gw, 1e-6).reshape(5, 32))
    with pytest.raises(ValueError, match="one shape"):
        add_rms_norm(x, y[:4], w, 1e-6)
    with pytest.raises(ValueError, match=r"\[T, H, N\]"):
        gated_rms_norm(core.reshape(5, 32), gate, gw, 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        rms_norm(x.t(), w, 1e-6, use_triton=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_norms_at_the_35b_shape_match_their_twins():
    """bf16, a 1,024-token piece: hidden 2,048 (pre-norm, residual add + norm), the gated norm over 32 heads of 128;
    within one bf16 rounding of the twins, the residual sum bit for bit."""
    x, y, w, _, _, _ = make_case(1024, 2048, 16, torch.bfloat16, "cuda", seed=3)
    _, _, _, core, gate, gw = make_case(1024, 4096, 32, torch.bfloat16, "cuda", seed=4)
    tol = dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), **tol)
    s, n = add_rms_norm(x, y, w, 1e-6)
    s_ref, n_ref = add_rms_norm(x, y, w, 1e-6, use_triton=False)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(n, n_ref, **tol)
    torch.testing.assert_close(gated_rms_norm(core, gate, gw, 1e-6),
                               gated_rms_norm(core, gate, gw, 1e-6, use_triton=False), **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_padded_gated_norm_rows_are_the_same_bits_alone():
    """The padded steps' launch shape (PADDED_GATED_NORM) at the 35B-A3B shape, bf16: 16 tokens x 32 heads of 128
    within a rounding of the twin, and each token's heads computed alone (a decode step's row) bit for bit the rows
    they are among the 16 (a verify's)."""
    from reviewer_kernels.norms import PADDED_GATED_NORM
    _, _, _, core, gate, gw = make_case(16, 4096, 32, torch.bfloat16, "cuda", seed=5)
    block = gated_rms_norm(core, gate, gw, 1e-6, **PADDED_GATED_NORM)
    torch.testing.assert_close(block, gated_rms_norm(core, gate, gw, 1e-6, use_triton=False), rtol=1e-2, atol=1e-2)
    for t in range(16):
        assert torch.equal(gated_rms_norm(core[t:t + 1], gate[t:t + 1], gw, 1e-6, **PADDED_GATED_NORM)[0], block[t])
