"""The transformers target's cache (backend/decoding/target.py HFTarget): a DynamicCache that grows into spare room,
cropping attention to an accepted prefix, and Gated DeltaNet states, which cannot be cropped: snapshot/restore for
prompt checkpoints and rollback by replaying the accepted positions (ReplayRollback)."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that writes into a buffer with spare room instead of re-concatenating the whole cache every
    step (a full copy per token, which dominates a CPU decode step at a few thousand tokens of context)."""

    def __init__(self):
        super().__init__()
        self._k = self._v = None
        self._n = 0

    def update(self, key_states, value_states, *args, **kwargs):
        n_new = key_states.shape[-2]
        need = self._n + n_new
        if self._k is None or need > self._k.shape[-2]:
            cap = max(256, 2 * need)
            k = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))
            v = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
            if self._n:
                k[..., : self._n, :] = self._k[..., : self._n, :]
                v[..., : self._n, :] = self._v[..., : self._n, :]
            self._k, self._v = k, v
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        self._k[..., self._n : need, :] = key_states
        self._v[..., self._n : need, :] = value_states
        self._n = need
        self.keys, self.values = self._k[..., :need, :], self._v[..., :need, :]
        return self.keys, self.values

    def get_seq_length(self, *args) -> int:
        return self._n

    def truncate(self, n: int) -> None:
        if n < self._n:
            self._n = n
            self.keys, self.values = self._k[..., :n, :], self._v[..., :n, :]

    def crop(self, max_length: int) -> None:  # negative: tokens to remove (both transformers 5.17 and 5.23)
        self.truncate(self._n + max_length if max_length < 0 else (max_length or self._n))

    def reset(self) -> None:
        self._n = 0
        self._k = self._v = self.keys = self.values = None
        self.is_initialized = False


def new_cache(model) -> DynamicCache:
    """The model's own DynamicCache layout (linear-attention layers where it has them), with plain attention layers
    swapped for GrowingLayer."""
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def decoder_layers(model) -> list:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return list(decoder.layers)


def _is_linear(layer) -> bool:
    return hasattr(layer, "recurrent_states")


def linear_slots(cache) -> list[tuple[object, object]]:
    """(holder, key) for every Gated DeltaNet conv/recurrent state tensor in the cache. transformers 5.23 keeps them
    on per-layer cache objects, in dicts keyed by state index ({0: tensor}); older layouts keep a tensor per layer
    attribute, or lists on the cache itself (Qwen3-Next style: cache.conv_states[layer_idx])."""
    slots = []
    for layer in getattr(cache, "layers", []):
        if not _is_linear(layer):
            continue
        for name in ("conv_states", "recurrent_states"):
            value = getattr(layer, name, None)
            if isinstance(value, dict):
                slots += [(value, key) for key, t in value.items() if t is not None]
            elif value is not None:
                slots.append((layer, name))
    for name in ("conv_states", "recurrent_states"):
        value = getattr(cache, name, None)
        if isinstance(value, list):
            slots += [(value, i) for i, t in enumerate(value) if isinstance(t, torch.Tensor) and t.numel()]
    return slots


def is_hybrid(cache) -> bool:
    return cache is not None and bool(linear_slots(cache))


def model_is_hybrid(model) -> bool:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def _get(holder, key):
    return holder[key] if isinstance(holder, (dict, list)) else getattr(holder, key)


def snapshot_linear_states(cache) -> list[torch.Tensor]:
    return [_get(h, k).clone() for h, k in linear_slots(cache)]


def restore_linear_states(cache, snapshot: list[torch.Tensor]) -> None:
    slots = linear_slots(cache)
    if len(slots) != len(snapshot):
        raise RuntimeError("linear-attention cache layout changed since the snapshot")
    for (holder, key), saved in zip(slots, snapshot):
        current = _get(holder, key)
        if current.shape == saved.shape:
            current.copy_(saved)  # in place: transformers marks these as static addresses
        elif isinstance(holder, (dict, list)):
            holder[key] = saved.clone()
        else:
            setattr(holder, key, saved.clone())


def crop_attention(cache, keep: int) -> None:
    """Crop every attention layer's KV to the first `keep` tokens (linear layers are handled by the caller)."""
    for layer in cache.layers:
        if _is_linear(layer) or not hasattr(layer, "keys"):
            continue
        if isinstance(layer, GrowingLayer):
            layer.truncate(keep)
        else:
            extra = layer.get_seq_length() - keep
            if extra > 0:
                layer.crop(-extra)


class ReplayRollback:
    """Brings Gated DeltaNet layers to the accepted prefix after a block verify.

    begin(): keep the linear states as they were at block start (a copy; the verify then updates the live states
    through the whole block as usual). finish(): put them back and re-run only each linear-attention layer
    (input_layernorm + linear_attn) over the accepted positions, from the layer inputs the verify already computed.
    Those inputs are exact: position j of a causal model depends only on positions <= j, so the rejected tokens
    after it changed nothing. Attention and MoE blocks are not re-run.

    The fast path (backend/models) does better: its verify kernel records the state after every position, and
    rollback is one copy.
    """

    def __init__(self, layers):
        self.layers = layers
        self.saved = None

    def begin(self, cache) -> None:
        self.saved = snapshot_linear_states(cache) if is_hybrid(cache) else None

    def finish(self, cache, hidden_states, keep: int, verified: int) -> None:
        if self.saved is None or keep == verified:  # all accepted: the verify left the states exactly right
            return
        restore_linear_states(cache, self.saved)
        for i, layer in enumerate(self.layers):
            if getattr(layer, "linear_attn", None) is not None:
                normed = layer.input_layernorm(hidden_states[i][:, :keep])
                layer.linear_attn(hidden_states=normed, cache_params=cache)
