"""DFlash speculative decoding: the draft/verify cycle, speculative sampling, the adaptive verify length, and the
transformers cache helpers (DynamicCache growth, cropping, Gated DeltaNet rollback by replay) that backend/target.py's
HFTarget uses. The cycle talks to the target only through backend/target.py (HFTarget or FastTarget).

One cycle (block size B):
  1. the drafter proposes B-1 tokens after the last committed token, in one forward;
  2. the target verifies [last token, drafts...] in one forward;
  3. the longest prefix the target agrees with is accepted, plus the target's own next token (greedy: exact match;
     sampling: Leviathan et al. 2022 rejection sampling, so the output distribution is exactly the target's);
  4. every cache is brought to exactly the accepted prefix (target.accept): attention KV is cropped; Gated DeltaNet
     conv/recurrent states, which cannot be cropped, are copied from the per-position states the verify recorded
     (FastTarget) or put back to the block start and advanced over the accepted tokens (HFTarget, ReplayRollback);
     the drafter's context gets the verify's hidden features at the accepted positions.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# ---- cache helpers ------------------------------------------------------------------------------------------------


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


# ---- sampling -----------------------------------------------------------------------------------------------------


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution a token is sampled from (float32, last dim), after temperature and nucleus (top-p)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, rng: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax(dim=-1))
    return int(torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=rng))


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft (k,), target_logits (k+1, V) -> (accepted prefix length, the target's own next token)."""
    choice = target_logits.argmax(dim=-1)
    agree = (draft == choice[: draft.shape[0]]).int().cumprod(0)
    accepted = int(agree.sum())
    return accepted, int(choice[accepted])


def rejection_accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, rng: torch.Generator) -> tuple[int, int]:
    """Speculative sampling: draft (k,) sampled from q (k, V); p (k+1, V) the target's distributions.
    Accept draft j with probability min(1, p/q); on the first rejection sample from the residual max(p - q, 0).
    Returns (accepted, next token) with the next token distributed exactly as the target's."""
    k = draft.shape[0]
    if k:
        idx = draft[:, None]
        p_x, q_x = p[:k].gather(1, idx)[:, 0], q.gather(1, idx)[:, 0]
        u = torch.rand(k, generator=rng, device=p.device)
        accepted = int((u * q_x < p_x).int().cumprod(0).sum())
    else:
        accepted = 0
    if accepted == k:
        return k, int(torch.multinomial(p[k], 1, generator=rng))
    residual = (p[accepted] - q[accepted]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if total > 0 else p[accepted]
    return accepted, int(torch.multinomial(residual, 1, generator=rng))


# ---- adaptive verify length ---------------------------------------------------------------------------------------


class VerifyCostModel:
    """Measured verify time T_t(n) for a block of n tokens: a running mean per size, and a least-squares line
    through them for sizes not yet seen."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.mean: dict[int, float] = {}

    def observe(self, n: int, seconds: float) -> None:
        old = self.mean.get(n)
        self.mean[n] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def probe(self, n_max: int) -> int | None:
        """A size worth measuring before the line can be trusted (full block first, then about half)."""
        if n_max not in self.mean:
            return n_max
        half = max(1, n_max // 2)
        if len(self.mean) < 2 and half != n_max:
            return half
        return None

    def estimate(self, n: int) -> float:
        if n in self.mean:
            return self.mean[n]
        xs, ys = list(self.mean), list(self.mean.values())
        if len(xs) == 1:
            return ys[0]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
        return max(my + max(slope, 0.0) * (n - mx), 1e-9)


class AcceptanceCalibration:
    """Drafter confidence is not acceptance probability (an untrained drafter can be confident and always wrong).
    Per draft position j, compare the mean confidence at j with the measured rate at which j was accepted given
    that 1..j-1 were, and scale confidences by that ratio (starting from a weak prior of "calibrated")."""

    def __init__(self, prior: float = 2.0):
        self.prior = prior
        self.reached: dict[int, float] = {}  # cycles that verified position j with 0..j-1 accepted
        self.accepted: dict[int, float] = {}
        self.confidence: dict[int, float] = {}  # sum of confidences at those cycles

    def observe(self, confidence: list[float], verified: int, accepted: int) -> None:
        for j in range(min(verified, accepted + 1)):
            self.reached[j] = self.reached.get(j, 0.0) + 1
            self.confidence[j] = self.confidence.get(j, 0.0) + confidence[j]
            self.accepted[j] = self.accepted.get(j, 0.0) + (j < accepted)

    def __call__(self, confidence: list[float]) -> list[float]:
        out = []
        for j, c in enumerate(confidence):
            seen = self.confidence.get(j, 0.0)
            ratio = (self.accepted.get(j, 0.0) + self.prior * 0.5) / (seen + self.prior * 0.5)
            out.append(min(1.0, c * ratio))
        return out


def choose_verify_length(confidence: list[float], cost: VerifyCostModel, draft_seconds: float) -> int:
    """How many drafted tokens to verify: maximize expected committed tokens per second, where committing k drafts
    needs all of 1..k accepted (probability ~ product of the drafter's confidences) plus the target's own token.
    Lossless whatever it returns: it only shortens the block the target checks."""
    n_max = len(confidence)
    probe = cost.probe(n_max + 1)
    if probe is not None:
        return probe - 1
    best_k, expected, prefix = 0, 1.0, 1.0
    best_rate = expected / (draft_seconds + cost.estimate(1))
    for k, c in enumerate(confidence, start=1):
        prefix *= c
        expected += prefix
        rate = expected / (draft_seconds + cost.estimate(k + 1))
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


# ---- the cycle ----------------------------------------------------------------------------------------------------


def first_token(logits, params, rng, stop: set[int], stats, vocab_mask=None) -> int | None:
    """The token after the prompt, sampled from the prefill's logits (both cycles start here); None when it is a stop
    token. Fills the stats for it."""
    t = time.perf_counter()
    token = sample_token(logits, params.temperature, params.top_p, rng)
    stats.decode_seconds += time.perf_counter() - t
    if token in stop:
        stats.finish_reason = "stop"
        return None
    stats.generated_tokens = 1
    stats.out_of_draft_vocab += int(vocab_mask is not None and not bool(vocab_mask[token]))
    stats.finish_reason = "length"
    return token


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def speculative_decode(engine, logits, params, budget, rng, cancelled, stats):
    """Yield committed blocks until `budget` tokens, a stop token or cancellation. `logits`: after the prompt.
    Invariant at every yield: the target's cache and engine.draft_context cover exactly engine.target.ids."""
    drafter, ctx, device = engine.drafter, engine.draft_context, engine.device
    block_size = drafter.block_size
    stats.accepted_per_position = [0] * (block_size - 1)
    stop = set(params.stop_token_ids)
    greedy = params.temperature == 0
    vocab_mask = getattr(drafter, "target_vocab_mask", None)  # restricted draft vocabulary, or None

    token = first_token(logits, params, rng, stop, stats, vocab_mask)
    if token is None:
        return
    yield [token]
    produced = 1
    while produced < budget:
        if cancelled():
            stats.finish_reason = "cancelled"
            break
        t0 = time.perf_counter()
        k = min(block_size - 1, budget - produced - 1)  # the target's own token must fit in the budget too
        draft = drafter.draft(ctx, token, params.temperature, params.top_p, rng) if k else None
        t1 = _now(device)
        if engine.adaptive_verify and k > 0:
            k = choose_verify_length(engine.calibration(draft.confidence[:k]), engine.verify_cost, t1 - t0)
        proposal = draft.tokens[:k] if k else []
        block = [token] + proposal
        target_logits, features = engine.target.verify(block, features=True)
        draft_t = torch.tensor(proposal, dtype=torch.long, device=device)
        if greedy:
            accepted, bonus = greedy_accept(draft_t, target_logits)
        else:
            p = sampling_probs(target_logits, params.temperature, params.top_p)
            q = draft.probs[:k] if k else p[:0]
            accepted, bonus = rejection_accept(draft_t, q, p, rng)
        t2 = _now(device)
        engine.verify_cost.observe(k + 1, t2 - t1)
        if k:
            engine.calibration.observe(draft.confidence, k, accepted)

        committed = proposal[:accepted] + [bonus]
        stop_at = next((i for i, x in enumerate(committed) if x in stop), None)
        emit = committed if stop_at is None else committed[:stop_at]
        keep = (accepted if stop_at is None else min(stop_at, accepted)) + 1  # block tokens whose state we keep
        engine.target.accept(keep)  # every cache now holds exactly the accepted prefix
        ctx.add_pending(features[:, :keep])
        t3 = _now(device)

        stats.cycles += 1
        stats.draft_tokens += k
        stats.accepted_tokens += accepted
        for j in range(accepted):
            stats.accepted_per_position[j] += 1
        stats.verify_sizes[k + 1] = stats.verify_sizes.get(k + 1, 0) + 1
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1
        stats.rollback_seconds += t3 - t2
        if vocab_mask is not None:
            stats.out_of_draft_vocab += sum(1 for x in emit if not bool(vocab_mask[x]))
        stats.generated_tokens += len(emit)
        stats.decode_seconds += t3 - t0
        if emit:
            yield emit
        if stop_at is not None:
            stats.finish_reason = "stop"
            break
        produced += len(emit)
        token = bonus
