"""Pure-PyTorch MoE experts: the reference loop (tests, benchmarks) and the fallback used without Triton/CUDA.

Weight layout is transformers' Qwen3-MoE / Qwen3.5-MoE experts layout:
    gate_up_proj [E, 2I, H]  (rows 0..I-1 are the gate projection, rows I..2I-1 the up projection)
    down_proj    [E, H, I]
and, optionally, a shared expert (Qwen3.5/3.6) whose output is scaled by sigmoid(x @ gate.T).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class SharedExpert(NamedTuple):
    """Weights of the always-on shared expert (nn.Linear layout: [out, in])."""

    gate_proj: torch.Tensor  # [Is, H]
    up_proj: torch.Tensor  # [Is, H]
    down_proj: torch.Tensor  # [H, Is]
    gate: torch.Tensor | None = None  # [1, H]: output scaled by sigmoid(x @ gate.T); None means scale 1


def moe_reference(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """The obvious loop over tokens and their experts. Slow; exists to be obviously right.

    Computes in the dtype of its inputs: upcast them (e.g. to float64) for a high-precision reference.
    """
    x = hidden_states
    out = torch.zeros_like(x)
    num_tokens, top_k = topk_ids.shape
    inter = down_proj.shape[-1]
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(topk_ids[t, k])
            gate = gate_up_proj[e, :inter] @ x[t]
            up = gate_up_proj[e, inter:] @ x[t]
            out[t] += topk_weights[t, k].to(x.dtype) * (down_proj[e] @ (F.silu(gate) * up))
        if shared is not None:
            y = shared.down_proj @ (F.silu(shared.gate_proj @ x[t]) * (shared.up_proj @ x[t]))
            if shared.gate is not None:
                y = torch.sigmoid(shared.gate @ x[t]) * y
            out[t] += y
    return out


def fused_moe_torch(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """Same interface and rounding points as the Triton kernel, in plain PyTorch.

    (token, expert) slots are sorted by expert and each active expert runs one matmul over its tokens, so each
    expert's weights are read once. The loop over active experts needs their count on the host: fine on the CPU,
    one synchronisation on a GPU (this path is only used there when Triton is missing).
    """
    x = hidden_states
    num_tokens, top_k = topk_ids.shape
    inter = down_proj.shape[-1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0]).tolist()

    # rows[slot] = routed expert output for slot (token t = slot // top_k), scaled by its routing weight, in fp32
    acc = torch.promote_types(x.dtype, torch.float32)  # accumulate in fp32 (or fp64 for fp64 inputs)
    rows = torch.empty(flat_ids.numel(), x.shape[1], dtype=acc, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        xs = x[slots // top_k]
        gate_up = xs @ gate_up_proj[e].t()
        h = (F.silu(gate_up[:, :inter].to(acc)) * gate_up[:, inter:].to(acc)).to(x.dtype)
        rows[slots] = (h @ down_proj[e].t()).to(acc)
    rows *= topk_weights.reshape(-1, 1).to(acc)
    out = rows.view(num_tokens, top_k, -1).sum(dim=1)

    if shared is not None:
        out += shared_expert_torch(x, shared)
    return out.to(x.dtype)


def rms_norm_scaled(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, in fp32, cast to x's dtype once: Qwen3.5's RMSNorm when weight is its
    (1 + weight) in fp32. route_topk_from_hidden takes it as `rms_norm=(weight, eps)`."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def shared_expert_torch(x: torch.Tensor, shared: SharedExpert) -> torch.Tensor:
    """The shared expert's output for every token, in fp32 (fp64 for fp64 inputs), with the kernel's rounding."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = (F.silu((x @ shared.gate_proj.t()).to(acc)) * (x @ shared.up_proj.t()).to(acc)).to(x.dtype)
    y = (h @ shared.down_proj.t()).to(acc)
    if shared.gate is not None:
        y = y * torch.sigmoid((x @ shared.gate.t()).to(acc))
    return y
