"""backend/models/llama.py's prefill attention: the lower-right causal bias a FastModel prefill piece gets on CUDA
(FlashAttention, no per-shape cuDNN plan) attends exactly as the bool mask over the same columns does."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

from backend.models.llama import attention, causal_mask


def qkv(heads, kv_heads, T, L, D, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device).to(dtype)  # noqa: E731
    return r(heads, T, D), r(kv_heads, L, D), r(kv_heads, L, D)


def test_lower_right_on_the_cpu_is_the_bool_mask():
    positions = torch.arange(40, 47)
    assert torch.equal(causal_mask(positions, 47, lower_right=True), causal_mask(positions, 47))


@pytest.mark.parametrize("T, L", [(7, 47), (16, 16), (1, 30)])
def test_a_lower_right_bias_attends_as_the_bool_mask(T, L):
    """Off CUDA (or where FlashAttention cannot run) the bias becomes the bool mask: the same result, bit for bit."""
    q, k, v = qkv(6, 2, T, L, 32)
    mask = causal_mask(torch.arange(L - T, L), L)
    assert torch.equal(attention(q, k, v, causal_lower_right(T, L)), attention(q, k, v, mask))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(16, 2, 256), (9, 3, 64)], ids=["qwen3.6-35b-a3b", "smollm2"])
@pytest.mark.parametrize("T, L", [(850, 2898), (1700, 30000), (300, 300)])
def test_cuda_flash_prefill_matches_the_masked_attention(shape, T, L):
    heads, kv_heads, D = shape
    q, k, v = qkv(heads, kv_heads, T, L, D, dtype=torch.bfloat16, device="cuda")
    positions = torch.arange(L - T, L, device="cuda")
    bias = causal_mask(positions, L, lower_right=True)
    assert isinstance(bias, CausalBias)  # the bias (a tensor subclass), not a bool mask
    flash = attention(q, k, v, bias)
    masked = attention(q, k, v, causal_mask(positions, L))
    assert flash.shape == masked.shape == (T, heads * D) and flash.dtype == torch.bfloat16
    assert (flash.float() - masked.float()).abs().max().item() < 2e-2
