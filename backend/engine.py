"""The decoding engine: batch-1 generation over a transformers causal LM, with prefix reuse across requests and,
when a drafter is given, DFlash speculative decoding (backend/speculative.py).

Data flow: server -> Engine.generate(prompt_ids, params) -> yields committed token ids -> server.
The engine owns one target cache and remembers which token ids it covers, so the next request (an agent resends its
whole conversation every turn) only prefills what is new.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from backend import speculative as spec


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these (it is not yielded)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the previous request's cache
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = "length"  # "stop" | "length" | "cancelled"
    # speculative decoding (all zero on the plain path)
    cycles: int = 0
    draft_tokens: int = 0  # drafted tokens sent to verification
    accepted_tokens: int = 0  # drafted tokens accepted (not counting the target's own token)
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: cycles whose draft position k was accepted
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rollback_seconds: float = 0.0  # bringing caches to the accepted prefix (crop + linear-attention replay)
    # committed tokens the restricted draft vocabulary could never have proposed (0 without a restricted vocabulary)
    out_of_draft_vocab: int = 0
    # verify blocks by size (number of tokens sent to the target, including the known token) -> count
    verify_sizes: dict[int, int] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Mean tokens committed per speculative cycle (accepted drafts + the target's own token)."""
        return (self.accepted_tokens + self.cycles) / self.cycles if self.cycles else 0.0


class Engine:
    """Batch-1 generation with prefix reuse. Not thread-safe: the server drives it from one worker thread."""

    def __init__(self, model, *, drafter=None, max_context: int | None = None, prefill_chunk: int = 2048,
                 adaptive_verify: bool = False):
        self.model = model
        self.drafter = drafter
        self.device = next(model.parameters()).device
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.max_context = max_context or getattr(config, "max_position_embeddings", None) or 1 << 30
        self.prefill_chunk = prefill_chunk
        self.adaptive_verify = adaptive_verify
        self.decoder_layers = spec.decoder_layers(model)
        self.hybrid = spec.model_is_hybrid(model)  # has Gated DeltaNet (linear-attention) layers
        self.last_stats = GenerationStats()
        if drafter is not None:
            drafter.check_target(model)
        self.verify_cost = spec.VerifyCostModel()  # adaptive verify length: measured T_t(n)
        self.calibration = spec.AcceptanceCalibration()  # and measured acceptance vs drafter confidence
        self._reset()

    # ---- cache bookkeeping -------------------------------------------------------------------------------------

    def _reset(self) -> None:
        self.cache = None
        self.cache_ids: list[int] = []  # token ids whose states the target cache holds, in order
        # Hybrid models only: linear-attention state at the end of the previous prompt (see _reuse_prefix).
        self.prompt_checkpoint: spec.PromptCheckpoint | None = None
        self.draft_context = None  # drafter KV over context features, covering the same positions as self.cache

    def _new_cache(self):
        return spec.new_cache(self.model)

    def _reuse_prefix(self, prompt: list[int]) -> tuple[int, torch.Tensor | None]:
        """Bring the cache to the longest reusable prefix of `prompt`. Returns (tokens reused, logits after the
        whole prompt if the reuse covers it, else None).

        Attention KV can be cropped to any prefix. Gated DeltaNet conv/recurrent states cannot: they have folded in
        every token so far and keep no per-token record. For hybrid models two points are therefore reusable: the
        live state (exactly self.cache_ids, so a prompt that extends it just continues), and a copy of the linear
        states taken at the end of the previous prompt (so the next turn of a conversation whose chat template
        re-renders the previous answer differently still skips the old prompt). Anything else prefills from scratch.
        """
        if self.cache is None:
            return 0, None
        common = _common_prefix(self.cache_ids, prompt)
        if not self.hybrid:
            keep = min(common, len(prompt) - 1)  # at least one token must run to produce the next logits
            self._truncate(keep)
            return keep, None
        if common == len(self.cache_ids) and len(prompt) > common:
            return common, None  # the live state is the reuse point
        ckpt = self.prompt_checkpoint
        if ckpt is not None and len(ckpt.ids) <= common:
            spec.restore_linear_states(self.cache, ckpt.linear_states)
            self._truncate(len(ckpt.ids), linear_ok=True)
            if len(prompt) == len(ckpt.ids):
                return len(prompt), ckpt.last_logits
            return len(ckpt.ids), None
        self._reset()
        return 0, None

    def _truncate(self, keep: int, linear_ok: bool = False) -> None:
        """Crop attention KV (target and drafter context) to `keep` tokens. Linear states must already be right."""
        if keep < len(self.cache_ids):
            spec.crop_attention(self.cache, keep)
            del self.cache_ids[keep:]
        if self.draft_context is not None:
            self.draft_context.crop(keep)

    # ---- forward passes -----------------------------------------------------------------------------------------

    def _forward(self, ids: list[int], *, all_logits: bool = False, hidden: bool = False):
        """Run the target over `ids` after the cached tokens; extends the cache and self.cache_ids."""
        if self.cache is None:
            self.cache = self._new_cache()
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True,
                         logits_to_keep=0 if all_logits else 1, output_hidden_states=hidden)
        self.cache_ids.extend(ids)
        return out

    def _prefill(self, ids: list[int], want_features: bool, cancelled: Callable[[], bool]):
        """Feed `ids` in chunks. Returns (last logits (V,), context features for `ids` or None)."""
        logits, feats = None, []
        for start in range(0, len(ids), self.prefill_chunk):
            if cancelled():
                return None, None
            out = self._forward(ids[start:start + self.prefill_chunk], hidden=want_features)
            logits = out.logits[0, -1]
            if want_features:
                feats.append(self.drafter.select_features(out.hidden_states))
        return logits, (torch.cat(feats, dim=1) if want_features else None)

    # ---- generation ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[list[int]]:
        """Yield lists of newly committed token ids; afterwards self.last_stats holds the GenerationStats.

        Closing the generator early (generator.close()) leaves the engine consistent: the cache always matches
        self.cache_ids at every yield.
        """
        prompt = [int(t) for t in prompt_ids]
        _check_params(prompt, params, self.max_context, self.model)
        stats = self.last_stats = GenerationStats(prompt_tokens=len(prompt))
        rng = _generator(params.seed, self.device)
        budget = min(params.max_tokens, self.max_context - len(prompt))
        try:
            t0 = time.perf_counter()
            reused, logits = self._reuse_prefix(prompt)
            stats.cached_tokens = reused
            features = None
            if logits is None:
                want = self.drafter is not None
                if want and self.draft_context is None:
                    self.draft_context = self.drafter.new_context()
                logits, features = self._prefill(prompt[reused:], want, cancelled)
                if logits is None:
                    stats.finish_reason = "cancelled"
                    return
                if spec.is_hybrid(self.cache) != self.hybrid:
                    # a transformers release whose cache keeps linear-attention state where we do not look:
                    # prefix reuse and rollback would silently be wrong, so refuse
                    raise RuntimeError("unrecognized linear-attention cache layout in this transformers version")
                if self.hybrid:
                    self.prompt_checkpoint = spec.PromptCheckpoint(
                        tuple(prompt), spec.snapshot_linear_states(self.cache), logits.clone())
            _sync(self.device)
            stats.prefill_seconds = time.perf_counter() - t0
            if features is not None:
                self.draft_context.add_pending(features)  # the drafter's context always covers self.cache_ids
            if self.drafter is None or budget <= 1:
                yield from self._plain_decode(logits, params, budget, rng, cancelled, stats)
            else:
                yield from spec.speculative_decode(self, logits, params, budget, rng, cancelled, stats)
        except GeneratorExit:
            raise  # closed at a yield, where the cache always matches self.cache_ids: nothing to undo
        except BaseException:
            self._reset()  # an exception mid-forward may have left the cache half-updated
            raise

    def _plain_decode(self, logits, params, budget, rng, cancelled, stats) -> Iterator[list[int]]:
        stop = set(params.stop_token_ids)
        t = time.perf_counter()
        for i in range(budget):
            if cancelled():
                stats.finish_reason = "cancelled"
                break
            token = spec.sample_token(logits, params.temperature, params.top_p, rng)
            if token in stop:
                stats.finish_reason = "stop"
                break
            stats.generated_tokens += 1
            stats.decode_seconds += time.perf_counter() - t
            yield [token]
            t = time.perf_counter()
            if i + 1 < budget:  # the last token needs no forward: nobody reads its logits
                logits = self._forward([token]).logits[0, -1]
        else:
            stats.finish_reason = "length"
        _sync(self.device)
        stats.decode_seconds += time.perf_counter() - t


# ---- helpers ------------------------------------------------------------------------------------------------------


def _common_prefix(a: list[int], b: list[int]) -> int:
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


def _check_params(prompt: list[int], params: SamplingParams, max_context: int, model) -> None:
    if not prompt:
        raise ValueError("the prompt is empty")
    vocab = model.get_input_embeddings().weight.shape[0]
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    if len(prompt) >= max_context:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the context holds {max_context}")
    if params.max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    if params.temperature < 0:
        raise ValueError("temperature must be >= 0")
    if not 0 < params.top_p <= 1:
        raise ValueError("top_p must be in (0, 1]")


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
