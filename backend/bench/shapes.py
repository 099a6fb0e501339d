"""Random-weight targets and drafters at the shapes we serve, for `reviewer bench` on a GPU: what a cycle costs at the
real sizes, without the real weights (which this machine cannot fetch).

    qwen3.6-35b-a3b-shape    Qwen3.6-35B-A3B (40 layers: 30 Gated DeltaNet + 10 gated attention, 256 experts top-8 +
                             a shared expert, hidden 2048, vocab 248,320), transformers' Qwen3_5MoeTextConfig defaults
    released-shape drafter   the released z-lab Qwen3.6-35B-A3B-DFlash shape: 6 layers (5 sliding + 1 full), hidden
                             2048, 8 target layers [1, 6, 11, 16, 22, 27, 32, 37], block 16, the target's head

Random weights accept nothing, so these runs use forced acceptance (device_cycle.ForcedAcceptance) and say so.
"""

from __future__ import annotations

import torch

from backend.dflash.model import DFlashDrafter, DrafterConfig

SHAPE_MODELS = ("qwen3.6-35b-a3b-shape",)
RELEASED_DRAFTER = "released-shape"


def shape_model(spec: str, device: str):
    """A transformers model with random weights (std 0.02) at `spec`'s shape, in bf16 on `device`."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    if spec != "qwen3.6-35b-a3b-shape":
        raise ValueError(f"unknown shape {spec!r}; choose from {SHAPE_MODELS}")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig()).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def released_shape_drafter(target):
    """An untrained DFlash drafter of the released Qwen3.6-35B-A3B drafter's shape, bound to nothing yet."""
    tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    vocab = target.get_input_embeddings().weight.shape[0]
    cfg = DrafterConfig(hidden_size=tcfg.hidden_size, num_hidden_layers=6, num_attention_heads=16,
                        num_key_value_heads=4, head_dim=128, intermediate_size=6144, block_size=16,
                        mask_token_id=vocab - 1, target_layer_ids=[1, 6, 11, 16, 22, 27, 32, 37],
                        num_target_layers=tcfg.num_hidden_layers, vocab_size=vocab,
                        layer_types=["sliding_attention"] * 5 + ["full_attention"], sliding_window=2048,
                        block_attention="mixed")
    gen = torch.Generator().manual_seed(0)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return drafter.eval()
