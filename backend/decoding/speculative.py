"""DFlash speculative decoding on the host: the draft/verify cycle, the acceptance tests (greedy, speculative sampling)
and the adaptive verify length (device_cycle.py is the same cycle on the GPU). The cycle talks to the target only
through target.py (HFTarget or FastTarget).

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

from backend.sampling import sample_token, sampling_probs


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

    def seed(self, seconds: dict[int, float]) -> None:
        """Start from a curve measured up front (Engine.measure_verify_costs): every size has a mean before the first
        cycle, so no choice rests on a line through one or two sizes, nor on a first verify of a size that paid for
        capturing its CUDA graph (an outlier the running mean would keep that size from ever being chosen again)."""
        self.mean.update(seconds)

    def probe(self, n_max: int) -> int | None:
        """A size worth measuring before the line can be trusted (full block first, then about half)."""
        if n_max not in self.mean:
            return n_max
        half = max(1, n_max // 2)
        if len(self.mean) < 2 and half != n_max:
            return half
        return None

    def estimates(self, n_max: int) -> list[float]:
        """T_t(n) for n = 1..n_max (index n - 1): measured means where there are any, else the least-squares line
        through them, fitted once (fitted per size, a choice of 16 cost ~90 us of host time, on the cycle's
        critical path)."""
        mean = self.mean
        xs, ys = list(mean), list(mean.values())
        if len(xs) == 1:
            return [mean.get(n, ys[0]) for n in range(1, n_max + 1)]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12),
                    0.0)
        return [mean[n] if n in mean else max(my + slope * (n - mx), 1e-9) for n in range(1, n_max + 1)]


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
    cost_of = cost.estimates(n_max + 1)  # cost_of[k]: verifying k drafts (k + 1 tokens)
    best_k, expected, prefix = 0, 1.0, 1.0
    best_rate = expected / (draft_seconds + cost_of[0])
    for k, c in enumerate(confidence, start=1):
        prefix *= c
        expected += prefix
        rate = expected / (draft_seconds + cost_of[k])
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


class VerifyLength:
    """One engine's verify length: what its verifies cost and how its drafts are accepted, observed every cycle;
    with `adaptive`, choose() shortens a block where a shorter one commits more tokens per second.

    Every `explore_every`-th cycle that would verify less than the whole draft verifies all of it: acceptance is
    only observed at the positions a cycle verifies, so a drafter whose confidences start low (or a cost curve that
    makes short blocks look best) would otherwise keep the calibration from ever seeing the later positions, and
    the choice from ever growing. Lossless either way: the length only changes how much the target checks."""

    explore_every = 16

    def __init__(self, adaptive: bool):
        self.adaptive = adaptive
        self.cost = VerifyCostModel()  # measured T_t(n)
        self.calibration = AcceptanceCalibration()  # measured acceptance against drafter confidence
        self.since_whole = 0  # cycles since one verified the whole draft

    def choose(self, k: int, confidence: list[float], draft_seconds: float) -> int:
        if not self.adaptive or k == 0:
            return k
        self.since_whole += 1
        chosen = k if self.since_whole >= self.explore_every else choose_verify_length(
            self.calibration(confidence[:k]), self.cost, draft_seconds)
        if chosen == k:
            self.since_whole = 0
        return chosen

    def observe(self, k: int, verify_seconds: float, confidence: list[float], accepted: int) -> None:
        self.cost.observe(k + 1, verify_seconds)
        if k:
            self.calibration.observe(confidence, k, accepted)


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


def record_cycle(stats, k: int, accepted: int, emit: list[int], vocab_mask, draft_s: float, verify_s: float,
                 accept_s: float) -> None:
    """A cycle's counts and times into the GenerationStats (both cycles, host and device, keep them alike)."""
    stats.cycles += 1
    stats.draft_tokens += k
    stats.accepted_tokens += accepted
    for j in range(accepted):
        stats.accepted_per_position[j] += 1
    stats.verify_sizes[k + 1] = stats.verify_sizes.get(k + 1, 0) + 1
    stats.draft_seconds += draft_s
    stats.verify_seconds += verify_s
    stats.rollback_seconds += accept_s
    if vocab_mask is not None:  # committed tokens the restricted draft vocabulary could never have proposed
        stats.out_of_draft_vocab += sum(1 for x in emit if not bool(vocab_mask[x]))
    stats.generated_tokens += len(emit)


def speculative_decode(target, drafter, context, verify_length: VerifyLength, logits, params, budget: int, rng,
                       cancelled, stats):
    """Yield committed blocks until `budget` tokens, a stop token or cancellation. `logits`: after the prompt;
    `context`: the drafter's context (its KV over the target's features). Invariant at every yield: the target's
    cache and `context` cover exactly target.ids."""
    device = target.device
    stats.accepted_per_position = [0] * (drafter.block_size - 1)
    stop = set(params.stop_token_ids)
    vocab_mask = getattr(drafter, "target_vocab_mask", None)  # restricted draft vocabulary, or None
    token = first_token(logits, params, rng, stop, stats, vocab_mask)
    if token is None:
        return
    yield [token]
    produced = 1
    while produced < budget:
        if cancelled():
            stats.finish_reason = "cancelled"
            return
        t0 = time.perf_counter()
        k = min(drafter.block_size - 1, budget - produced - 1)  # the target's own token must fit in the budget too
        draft = drafter.draft(context, token, params.temperature, params.top_p, rng) if k else None
        t1 = _now(device)
        k = verify_length.choose(k, draft.confidence if k else [], t1 - t0)
        proposal = draft.tokens[:k] if k else []
        target_logits, features = target.verify([token] + proposal, features=True)
        q = draft.probs[:k] if k and params.temperature else None  # the drafter's distributions, when sampling
        accepted, bonus = accept(torch.tensor(proposal, dtype=torch.long, device=device), target_logits, q, params, rng)
        t2 = _now(device)
        verify_length.observe(k, t2 - t1, draft.confidence if k else [], accepted)
        committed = proposal[:accepted] + [bonus]
        stop_at = next((i for i, x in enumerate(committed) if x in stop), None)
        emit = committed if stop_at is None else committed[:stop_at]
        keep = (accepted if stop_at is None else min(stop_at, accepted)) + 1  # block tokens whose state we keep
        target.accept(keep)  # every cache now holds exactly the accepted prefix
        context.add_pending(features[:, :keep])
        t3 = _now(device)
        record_cycle(stats, k, accepted, emit, vocab_mask, t1 - t0, t2 - t1, t3 - t2)
        stats.decode_seconds += t3 - t0
        if emit:
            yield emit
        if stop_at is not None:
            stats.finish_reason = "stop"
            return
        produced += len(emit)
        token = bonus


def accept(proposal: torch.Tensor, target_logits: torch.Tensor, q, params, rng) -> tuple[int, int]:
    """The acceptance test of one cycle: (accepted drafts, the target's own next token). Greedy: exact match;
    sampling: speculative sampling against the drafter's distributions q."""
    if params.temperature == 0:
        return greedy_accept(proposal, target_logits)
    p = sampling_probs(target_logits, params.temperature, params.top_p)
    return rejection_accept(proposal, q if q is not None else p[:0], p, rng)
