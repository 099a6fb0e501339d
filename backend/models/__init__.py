"""Fast target models: compact re-implementations of the architectures we serve most, with static caches, Gated
DeltaNet rollback by replaying a verify's recorded inputs, and CUDA graphs. transformers stays the fallback for everything
else. See README.md in this folder.

    from backend.models import load_fast
    fast = load_fast(hf_model, max_context=8192)     # FastModel, or None when the architecture has no fast path
"""

from __future__ import annotations

import logging

from backend.models.fast import FastModel, Snapshot
from backend.models.llama import Llama
from backend.models.qwen3_5_moe import Qwen35Moe

log = logging.getLogger("reviewer.backend")

ARCHITECTURES = (Llama, Qwen35Moe)


def fast_class(hf_config):
    """The model class that reproduces this transformers config exactly, or None."""
    for cls in ARCHITECTURES:
        if cls.supports(hf_config) is None:
            return cls
    return None


def load_fast(hf_model, max_context: int | None = None, max_block: int = 16, *,
              cuda_graphs: bool | None = None, compile: bool | str = False) -> FastModel | None:
    """Wrap a loaded transformers causal LM in a FastModel sharing its weights, or None (with the reason logged) when
    no fast implementation covers its architecture. max_context defaults to the config's max_position_embeddings."""
    config = hf_model.config
    cls = fast_class(config)
    if cls is None:
        reasons = "; ".join(c.supports(config) for c in ARCHITECTURES)
        log.info("no fast path for this model (%s): using transformers", reasons)
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    max_context = max_context or getattr(text, "max_position_embeddings", None) or 4096
    return FastModel(cls.from_hf(hf_model), max_context, max_block, cuda_graphs=cuda_graphs, compile=compile)


__all__ = ["ARCHITECTURES", "FastModel", "Llama", "Qwen35Moe", "Snapshot", "fast_class", "load_fast"]
