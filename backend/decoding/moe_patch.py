"""Patch a loaded transformers MoE model in place so its sparse-MoE blocks run `reviewer_kernels.fused_moe`.

Works for Qwen3.5/3.6-MoE (router + routed experts + sigmoid-gated shared expert) and Qwen3-MoE (no shared
expert): any block with `gate` (the model's own router, kept as is so routing is bit-for-bit the model's),
`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] with SiLU, and optionally `shared_expert`
(gate_proj / up_proj / down_proj linears) and `shared_expert_gate`. Weights are used where they are: no copies.

    from backend.decoding.moe_patch import patch_moe
    patched = patch_moe(model)   # number of blocks now on the fused kernel
"""

from __future__ import annotations

import types

import torch
from torch import nn

from reviewer_kernels import SharedExpert, fused_moe, route_topk, triton_usable

_ORIGINAL_FORWARD = "_unfused_forward"


def _is_silu(module: nn.Module) -> bool:
    """The module's act_fn computes SiLU (checked on values: transformers' activation classes vary by version)."""
    act = getattr(module, "act_fn", None)
    if not callable(act):
        return False
    probe = torch.linspace(-6, 6, 25)
    try:
        return torch.allclose(act(probe), torch.nn.functional.silu(probe))
    except Exception:
        return False


def is_fusable_moe_block(module: nn.Module) -> bool:
    """True for a sparse-MoE block whose math the fused kernel reproduces exactly."""
    experts = getattr(module, "experts", None)
    if getattr(module, "gate", None) is None or experts is None:
        return False
    if not (isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor)):
        return False
    if experts.gate_up_proj.dim() != 3 or not _is_silu(experts):
        return False
    # transformers' experts decorator records layout variants; the kernel handles the default one only
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        return False
    if not getattr(experts, "has_gate", True) or not getattr(experts, "is_concatenated", True):
        return False
    shared = getattr(module, "shared_expert", None)
    if shared is not None:
        linears = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(lin, nn.Linear) and lin.bias is None for lin in linears) or not _is_silu(shared):
            return False
        gate = getattr(module, "shared_expert_gate", None)
        if gate is not None and (not isinstance(gate, nn.Linear) or gate.bias is not None):
            return False
    return True


def _shared_expert(block: nn.Module) -> SharedExpert | None:
    shared = getattr(block, "shared_expert", None)
    if shared is None:
        return None
    gate = getattr(block, "shared_expert_gate", None)
    return SharedExpert(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight,
                        gate.weight if gate is not None else None)


# Routers whose math reviewer_kernels.route_topk reproduces: softmax, top-k, renormalise (Qwen3-MoE: if norm_topk_prob).
FUSABLE_ROUTERS = {"Qwen3_5MoeTopKRouter", "Qwen3MoeTopKRouter"}


def _fused_router_renormalizes(gate: nn.Module) -> bool | None:
    """Whether the fused routing kernel may replace this router (and if it renormalises); None: keep the model's.

    Also None while hooks watch the router (e.g. transformers recording router logits for an aux loss)."""
    if type(gate).__name__ not in FUSABLE_ROUTERS or gate._forward_hooks or gate._forward_pre_hooks:
        return None
    return bool(getattr(gate, "norm_topk_prob", True))


def fused_block_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Drop-in forward for a sparse-MoE block: routing, then one fused call for all experts.

    On the Triton path a known router runs as its linear layer plus one routing kernel (same math); otherwise,
    and on the PyTorch fallback, the model's own router module runs."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    renormalize = _fused_router_renormalizes(self.gate) if triton_usable(x) else None
    if renormalize is None:
        _, routing_weights, selected_experts = self.gate(x)
    else:
        logits = torch.nn.functional.linear(x, self.gate.weight)
        routing_weights, selected_experts = route_topk(logits, self.gate.top_k, renormalize)
    out = fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, routing_weights, selected_experts,
                    _shared_expert(self))
    return out.reshape(shape)


def patch_moe(model: nn.Module) -> int:
    """Route every fusable MoE block of `model` through the fused kernel; returns how many were patched."""
    patched = 0
    for module in model.modules():
        if hasattr(module, _ORIGINAL_FORWARD) or not is_fusable_moe_block(module):
            continue
        setattr(module, _ORIGINAL_FORWARD, module.forward)
        module.forward = types.MethodType(fused_block_forward, module)
        patched += 1
    return patched


def unpatch_moe(model: nn.Module) -> int:
    """Undo `patch_moe`; returns how many blocks were restored."""
    restored = 0
    for module in model.modules():
        original = module.__dict__.pop(_ORIGINAL_FORWARD, None)
        if original is not None:
            del module.forward
            restored += 1
    return restored
