"""Fast target models: compact re-implementations of the architectures we serve most, with static caches, Gated
DeltaNet rollback by replaying a verify's recorded inputs, and CUDA graphs. transformers stays the fallback for everything
else. See README.md in this folder.

    from backend.models import load_fast
    fast = load_fast(hf_model, max_context=8192)     # FastModel, or None when the architecture has no fast path
    fast = load_fast(hf_model, numerics=invariant_numerics("a benchmark"))   # which kernels run: numerics.py
"""

from __future__ import annotations

import logging

from backend.models.fast import FastModel, Snapshot
from backend.models.llama import Llama
from backend.models.numerics import Numerics, invariant_numerics, resolve_numerics
from backend.models.qwen3_5_moe import Qwen35Moe

log = logging.getLogger("reviewer.backend")

ARCHITECTURES = (Llama, Qwen35Moe)


def fast_class(hf_config):
    """The model class that reproduces this transformers config exactly, or None."""
    for cls in ARCHITECTURES:
        if cls.supports(hf_config) is None:
            return cls
    return None


def no_fast_path(hf_config) -> str | None:
    """Why no fast implementation covers this config (every architecture's reason), or None when one does."""
    if fast_class(hf_config) is not None:
        return None
    return "; ".join(c.supports(hf_config) for c in ARCHITECTURES)


def load_fast(hf_model, max_context: int | None = None, max_block: int = 16, *,
              cuda_graphs: bool | None = None, compile: bool | str = False,
              numerics: Numerics | None = None) -> FastModel | None:
    """Wrap a loaded transformers causal LM in a FastModel sharing its weights, or None (with the reason logged) when
    no fast implementation covers its architecture. max_context defaults to the config's max_position_embeddings.
    numerics: which kernels its decode steps and verifies run (default Numerics(): the one-token path)."""
    config = hf_model.config
    cls = fast_class(config)
    if cls is None:
        log.info("no fast path for this model (%s): using transformers", no_fast_path(config))
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    max_context = max_context or getattr(text, "max_position_embeddings", None) or 4096
    return FastModel(cls.from_hf(hf_model), max_context, max_block, cuda_graphs=cuda_graphs, compile=compile,
                     numerics=numerics)


__all__ = ["ARCHITECTURES", "FastModel", "Llama", "Numerics", "Qwen35Moe", "Snapshot", "fast_class",
           "invariant_numerics", "load_fast", "no_fast_path", "resolve_numerics"]
