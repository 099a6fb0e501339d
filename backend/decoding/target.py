"""The target model and its cache, behind the few calls the engine makes. Two implementations:

HFTarget    a transformers model + DynamicCache: any architecture. Gated DeltaNet rollback by replaying the
            accepted positions (speculative.ReplayRollback).
FastTarget  a backend/models FastModel: static caches, rollback by copy, CUDA graphs on the GPU. Llama (the
            embedded model) and Qwen3.5/3.6-MoE; the engine picks it whenever load_fast() covers the model.

Both keep `ids`, the token ids their cache covers, in order, and answer:
    reuse(prompt)                  -> (tokens reused, logits after the whole prompt or None): cut the cache back to the
                                      longest prefix of `prompt` it can keep
    prefill(ids, features, cancelled) -> (logits [V] after the last id, features [1, T, F] or None); logits None when
                                      cancelled between chunks (features then cover the chunks that ran)
    remember_prompt(prompt, logits)   hybrid models: the state at the prompt's end, for the next request's reuse
    step(token)                    -> logits [V] after `token` (plain decoding)
    verify(block, features)        -> (logits [T, V], features [1, T, F] or None); the cache holds the block
                                      tentatively until accept(keep) keeps its first `keep` tokens

Exact mode (FastTarget over a FastModel built with the exact record, backend/models/numerics.py; the engine resolves it
for a CPU engine with a drafter, and for the plain reference it is compared with): every forward has exactly max_block
(16) rows: plain steps, verifies and prompt chunks are padded to it (prompt padding: pure-attention models only), and
attention spans are rounded up to a multiple of 512 columns. A position's logits and cache entries then come out of the
same kernels with the same shapes however it was reached (decoded alone, inside any verified block, as a prompt token
after any prefix reuse, whatever the cache held before), so greedy speculative decoding emits exactly the tokens plain
decoding emits, in bf16 too. Without it they drift apart: on the embedded model in bf16 a decode step and a 16-token
verify give logits up to 0.8 apart (attention over a different span and query count), and CPU matmuls pick their
algorithm by row count (1-32, 33 to a few hundred and more round differently), so a near-tie can flip. The price on this
2-core AMX CPU: a padded plain step 50 ms against 39 ms unpadded (bench/results/spec_embedded_shipped_cpu.json), and
prompts prefill at ~3 ms a token against ~0.5 ms in 1024-token chunks; speculation more than pays back the first (1.3x
over the unpadded plain speed). """

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend.decoding import hf_cache
from backend.dflash.model import select_features

PAD_TOKEN = 0  # what fills a padded block; its positions are never kept


@dataclass
class PromptCheckpoint:
    ids: tuple[int, ...]  # the prompt whose end the snapshot sits at
    state: object  # HF: linear-state tensors; fast: a FastModel Snapshot
    last_logits: torch.Tensor  # logits after the prompt's last token, so an identical prompt needs no forward


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case: the new prompt extends the old one (list compare runs in C)
        return n
    lo, hi = 0, n  # binary search on prefix equality, still in C
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Reuse:
    """Prefix reuse, shared by both targets. Attention KV can be cut to any prefix. Gated DeltaNet conv/recurrent
    states cannot: they have folded in every token so far and keep no per-token record. For hybrid models two points
    are therefore reusable: the live state (exactly self.ids, so a prompt that extends it just continues), and a copy
    of the linear states taken at the end of the previous prompt (so the next turn of a conversation whose chat
    template re-renders the previous answer differently still skips the old prompt). Anything else starts over."""

    ids: list[int]
    hybrid: bool
    checkpoint: PromptCheckpoint | None

    def reuse(self, prompt: list[int]) -> tuple[int, torch.Tensor | None]:
        common = common_prefix(self.ids, prompt)
        if not self.ids:
            return 0, None
        if not self.hybrid:
            keep = min(common, len(prompt) - 1)  # at least one token must run to produce the next logits
            self._cut(keep)
            return keep, None
        if common == len(self.ids) and len(prompt) > common:
            return common, None  # the live state is the reuse point
        ckpt = self.checkpoint
        if ckpt is not None and len(ckpt.ids) <= common:
            self._restore(ckpt)
            if len(prompt) == len(ckpt.ids):
                return len(prompt), ckpt.last_logits
            return len(ckpt.ids), None
        self.reset()
        return 0, None

    def remember_prompt(self, prompt: list[int], logits: torch.Tensor) -> None:
        if self.hybrid:
            self.checkpoint = PromptCheckpoint(tuple(prompt), self._snapshot(), logits.clone())


class HFTarget(_Reuse):
    """A transformers causal LM with a DynamicCache (attention layers swapped for speculative.GrowingLayer)."""

    def __init__(self, model, feature_layers: tuple[int, ...] = (), prefill_chunk: int = 2048):
        self.model = model
        self.device = next(model.parameters()).device
        self.hybrid = hf_cache.model_is_hybrid(model)
        self.layers = hf_cache.decoder_layers(model)
        self.feature_layers = tuple(feature_layers)
        self.prefill_chunk = prefill_chunk
        self.reset()

    def reset(self) -> None:
        self.cache = None
        self.ids: list[int] = []
        self.checkpoint = None
        self._block = None  # (length, rollback, hidden_states) of a verify awaiting accept()

    def _forward(self, ids: list[int], *, all_logits: bool = False, hidden: bool = False):
        if self.cache is None:
            self.cache = hf_cache.new_cache(self.model)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True,
                         logits_to_keep=0 if all_logits else 1, output_hidden_states=hidden)
        self.ids.extend(ids)
        return out

    def _features(self, hidden_states) -> torch.Tensor:
        return select_features(hidden_states, self.feature_layers)

    def prefill(self, ids: list[int], features: bool, cancelled: Callable[[], bool]):
        logits, feats = None, []
        for start in range(0, len(ids), self.prefill_chunk):
            if cancelled():
                return None, (torch.cat(feats, dim=1) if feats else None)
            out = self._forward(ids[start:start + self.prefill_chunk], hidden=features)
            logits = out.logits[0, -1]
            if features:
                feats.append(self._features(out.hidden_states))
        if hf_cache.is_hybrid(self.cache) != self.hybrid:
            # a transformers release whose cache keeps linear-attention state where we do not look: prefix reuse and
            # rollback would silently be wrong, so refuse
            raise RuntimeError("unrecognized linear-attention cache layout in this transformers version")
        return logits, (torch.cat(feats, dim=1) if features else None)

    def step(self, token: int) -> torch.Tensor:
        return self._forward([token]).logits[0, -1]

    def verify(self, block: list[int], features: bool):
        rollback = hf_cache.ReplayRollback(self.layers)
        if len(block) > 1:
            rollback.begin(self.cache)
        out = self._forward(block, all_logits=True, hidden=True)
        self._block = (len(block), rollback, out.hidden_states)
        return out.logits[0], (self._features(out.hidden_states) if features else None)

    def accept(self, keep: int) -> None:
        verified, rollback, hidden_states = self._block
        self._block = None
        new_len = len(self.ids) - verified + keep
        hf_cache.crop_attention(self.cache, new_len)
        del self.ids[new_len:]
        rollback.finish(self.cache, hidden_states, keep, verified)

    # reuse hooks
    def _cut(self, keep: int) -> None:
        if keep < len(self.ids):
            hf_cache.crop_attention(self.cache, keep)
            del self.ids[keep:]

    def _snapshot(self):
        return hf_cache.snapshot_linear_states(self.cache)

    def _restore(self, ckpt: PromptCheckpoint) -> None:
        hf_cache.restore_linear_states(self.cache, ckpt.state)
        keep = len(ckpt.ids)
        hf_cache.crop_attention(self.cache, keep)
        del self.ids[keep:]


class FastTarget(_Reuse):
    """A FastModel (backend/models). Exact mode (see the module docstring) where the FastModel was built with an
    exact record (its numerics' kind "exact": the FastModel rounds its spans, this target pads its blocks)."""

    def __init__(self, fast, feature_layers: tuple[int, ...] = (), prefill_chunk: int = 2048):
        self.fast = fast
        self.device = fast.device
        self.hybrid = fast.hybrid
        self.feature_layers = tuple(feature_layers)
        self.prefill_chunk = prefill_chunk
        self.exact = fast.numerics.exact
        self.reset()

    def reset(self) -> None:
        self.fast.reset()
        self.ids: list[int] = []
        self.checkpoint = None
        self._verified = 0
        self._on_device = False  # the pending verify's tokens are not in self.ids yet

    def prefill(self, ids: list[int], features: bool, cancelled: Callable[[], bool]):
        logits, feats = None, []
        for start in range(0, len(ids), self.prefill_chunk):
            if cancelled():
                return None, (torch.cat(feats)[None] if feats and features else None)
            piece = ids[start:start + self.prefill_chunk]
            block = self.fast.max_block if self.exact and not self.hybrid else 0
            logits, f = self.fast.prefill(piece, self.feature_layers if features else (), block=block)
            self.ids.extend(piece)
            feats.append(f)
        return logits, (torch.cat(feats)[None] if features else None)

    def step(self, token: int) -> torch.Tensor:
        if self.exact:
            logits, _ = self._padded_verify([token], ())
            self.fast.accept(1)
            self.ids.append(token)
            return logits[0]
        logits, _ = self.fast.decode(token)
        self.ids.append(token)
        return logits

    def verify(self, block: list[int], features: bool):
        hidden = self.feature_layers if features else ()
        if self.exact:
            logits, feats = self._padded_verify(block, hidden)
        else:
            logits, feats = self.fast.verify(block, hidden)
        self._verified = len(block)
        self.ids.extend(block)
        n = len(block)
        return logits[:n], (feats[:n][None] if feats is not None else None)

    def verify_on_device(self, tokens: torch.Tensor, features: bool):
        """verify() of a block whose tokens are a device tensor (the GPU drafter's output, never read by the host
        before the verify): returns (logits [T, V], features [T, F] or None) on the device, valid until the next
        forward. The host learns the tokens at the cycle's sync and names the kept ones in accept(keep, ids), or
        drops the block with abandon()."""
        if self.exact:
            raise RuntimeError("verify_on_device is the non-exact GPU path")
        # the graph's own buffers (fresh=False): the device cycle queues their readers before the next forward
        logits, feats = self.fast.verify(tokens, self.feature_layers if features else (), fresh=False)
        self._verified = tokens.numel()
        self._on_device = True
        return logits, feats

    def abandon(self) -> None:
        """Drop a verified block nobody accepted (the device cycle, when its consumer stops at a yield with a verify
        queued): the cache covers exactly self.ids again."""
        self.fast.abandon()
        if not self._on_device:
            del self.ids[len(self.ids) - self._verified:]
        self._verified = 0
        self._on_device = False

    def _padded_verify(self, block: list[int], hidden: tuple[int, ...]):
        pad = [PAD_TOKEN] * (self.fast.max_block - len(block))
        return self.fast.verify(list(block) + pad, hidden)

    def accept(self, keep: int, ids: list[int] | None = None) -> None:
        """Keep the first `keep` tokens of the verified block; ids: those tokens, after verify_on_device."""
        self.fast.accept(keep)
        if self._on_device:
            if ids is None or len(ids) != keep:
                raise ValueError("accept after verify_on_device needs the kept tokens")
            self.ids.extend(int(t) for t in ids)
        else:
            del self.ids[len(self.ids) - self._verified + keep:]
        self._verified = 0
        self._on_device = False

    # reuse hooks
    def _cut(self, keep: int) -> None:
        if keep < len(self.ids):
            self.fast.truncate(keep)
            del self.ids[keep:]

    def _snapshot(self):
        return self.fast.snapshot()

    def _restore(self, ckpt: PromptCheckpoint) -> None:
        self.fast.restore(ckpt.state)
        del self.ids[len(ckpt.ids):]
