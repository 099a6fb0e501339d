"""Compute kernels for the backend: Triton where it can run, PyTorch otherwise. Imports torch (and triton if present)."""

from reviewer_kernels.fused_moe import fused_moe, fused_moe_triton, triton_usable
from reviewer_kernels.moe_reference import SharedExpert, fused_moe_torch, moe_reference
from reviewer_kernels.moe_routing import route_topk, route_topk_from_hidden, route_topk_torch

__all__ = ["SharedExpert", "fused_moe", "fused_moe_torch", "fused_moe_triton", "moe_reference", "route_topk",
           "route_topk_from_hidden", "route_topk_torch", "triton_usable"]
