"""DFlash speculative decoding: what the host and device cycles share, and the host cycle. DecodeRun is one
generation's loop state (set up once by Engine.generate, for plain steps too); Block is one cycle's outcome;
accept_block is the one acceptance test (greedy, speculative sampling), written on device tensors so the device cycle
(device_cycle.py) never waits for it and the host cycle reads it once; VerifyLength is the adaptive verify length.
HostCycle is the cycle on the host (CPU, transformers path, exact mode). Each cycle talks to the target only through
target.py (HFTarget or FastTarget); Engine.generate owns the loop and calls step() once a cycle.

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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backend.sampling import sample_token, sampling_probs

# ---- the acceptance test (one implementation: the host cycle and the device cycle both call accept_block) --------


@dataclass
class Acceptance:
    """Where one cycle's acceptance test writes, on the device that ran the verify (nothing here is read by the host
    until the cycle's one sync). result [B + 1]: the accepted count, then the committed tokens (accepted drafts + the
    target's own); keep [1] = accepted + 1 and token [1] = the target's own token (the device drafter's inputs for
    the next draft: its keep_dev and token_dev)."""

    result: torch.Tensor
    keep: torch.Tensor
    token: torch.Tensor

    @classmethod
    def empty(cls, block_size: int, device) -> Acceptance:
        def zeros(n):
            return torch.zeros(n, dtype=torch.long, device=device)
        return cls(result=zeros(block_size + 1), keep=zeros(1), token=zeros(1))


def accept_block(logits: torch.Tensor, proposal: torch.Tensor, k: int, params, q, rng, out: Acceptance) -> None:
    """The acceptance test of one cycle, without leaving the device: logits [k+1, V] from the verify, proposal [k]
    the drafts, q [k, V] the drafter's distributions (sampling only). Greedy: the longest prefix of drafts equal to
    the target's argmax, then the target's own argmax; sampling: speculative sampling (Leviathan et al. 2022), so
    the committed tokens are distributed exactly as the target's. Greedy is six small kernels: each kernel between
    the verify and the next draft is GPU time on the device cycle's critical path (as intermediates plus copies it
    was twelve)."""
    if params.temperature == 0:
        choice = out.result[1:k + 2]  # the target's choices; the accepted drafts equal them
        torch.argmax(logits, dim=-1, out=choice)
        if k:
            torch.sum((proposal == choice[:k]).cumprod(0), 0, keepdim=True, out=out.result[:1])
        else:
            out.result[:1].zero_()
        torch.index_select(choice, 0, out.result[:1], out=out.token)
        torch.add(out.result[:1], 1, out=out.keep)
        return
    rejection_accept(sampling_probs(logits, params.temperature, params.top_p), proposal, k, q, rng, out)


def rejection_accept(p: torch.Tensor, proposal: torch.Tensor, k: int, q, rng, out: Acceptance) -> None:
    """Speculative sampling on the device: p [k+1, V] the target's distributions, proposal [k] drafted from q [k, V].
    Draft j is accepted with probability min(1, p/q); at the first rejection the target's token is drawn from the
    residual max(p - q, 0) (after all k accepted: from p[k])."""
    device = p.device
    if k:
        idx = proposal[:, None]
        p_x, q_x = p[:k].gather(1, idx)[:, 0], q[:k].gather(1, idx)[:, 0]
        u = torch.rand(k, generator=rng, device=device)
        accepted = (u * q_x < p_x).int().cumprod(0).sum().reshape(1)
        q_pad = torch.cat([q[:k], q.new_zeros(1, q.shape[1])])
    else:
        accepted = torch.zeros(1, dtype=torch.long, device=device)
        q_pad = torch.zeros_like(p)
    residual = (p - q_pad).clamp_min(0).index_select(0, accepted)[0]
    total = residual.sum()
    row = torch.where(total > 0, residual / total.clamp_min(1e-30), p.index_select(0, accepted)[0])
    bonus = torch.multinomial(row, 1, generator=rng)
    idx = torch.arange(k + 1, device=device)
    committed = torch.where(idx < accepted, torch.cat([proposal, bonus]), bonus)
    out.result[:1].copy_(accepted)
    out.result[1:k + 2].copy_(committed)
    out.token.copy_(bonus)
    torch.add(out.result[:1], 1, out=out.keep)


def read_acceptance(result: torch.Tensor) -> tuple[int, list[int]]:
    """(accepted, committed tokens) from an Acceptance's result as the host holds it (after the cycle's sync)."""
    accepted = int(result[0])
    return accepted, result[1:accepted + 2].tolist()


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


# ---- one generation's loop state, and one cycle's outcome ---------------------------------------------------------


@dataclass
class CycleTimes:
    """One cycle's seconds by name. draft: drafting the block (the device cycle: the draft queued after this verify);
    verify: the target's forward (the host cycle: with the acceptance test); rollback: bringing the caches to the
    accepted prefix (the device cycle: its acceptance test plus the previous commit's device time)."""

    draft: float = 0.0
    verify: float = 0.0
    rollback: float = 0.0


@dataclass
class Block:
    """One cycle's outcome as the host reads it: k drafts verified, `accepted` of them kept, `committed` (accepted
    drafts + the target's own token) cut at a stop id into `emit` (what the consumer gets); the caches keep the
    verified block's first `keep` positions."""

    k: int
    accepted: int
    committed: list[int]
    emit: list[int]
    keep: int
    stopped: bool
    times: CycleTimes = field(default_factory=CycleTimes)

    @property
    def bonus(self) -> int:
        """The target's own token: the next block's first."""
        return self.committed[self.accepted]


@dataclass
class DecodeRun:
    """One generation's loop state, set up once in Engine.generate for every path (plain steps, the host cycle, the
    device cycle): the request, its budget and generator, the cancel flag, the stats it fills, its stop ids; and how
    far it got. vocab_mask: the drafter's restricted draft vocabulary (host), or None."""

    params: object  # engine.SamplingParams
    budget: int
    rng: torch.Generator
    cancelled: Callable[[], bool]
    stats: object  # engine.GenerationStats
    vocab_mask: torch.Tensor | None = None
    stop: frozenset[int] = field(init=False)  # the request's stop ids: a block is cut at the first
    produced: int = 0  # tokens committed so far
    stopped: bool = False  # a stop id ended it

    def __post_init__(self):
        self.stop = frozenset(self.params.stop_token_ids)

    def more(self) -> bool:
        """Whether another cycle may begin: no stop id yet, room in the budget, not cancelled."""
        return not self.stopped and self.produced < self.budget and not self.cancelled()

    def first_token(self, logits) -> int | None:
        """The token after the prompt, sampled from the prefill's logits (every speculative path starts here); None
        when it is a stop token. Fills the stats for it."""
        stats = self.stats
        t = time.perf_counter()
        token = sample_token(logits, self.params.temperature, self.params.top_p, self.rng)
        stats.decode_seconds += time.perf_counter() - t
        if token in self.stop:
            stats.finish_reason = "stop"
            return None
        stats.generated_tokens = 1
        stats.out_of_draft_vocab += int(self.vocab_mask is not None and not bool(self.vocab_mask[token]))
        stats.finish_reason = "length"
        self.produced = 1
        return token

    def draft_budget(self, block_size: int) -> int:
        """Drafts the next cycle may verify: the target's own token must fit in the budget too."""
        return min(block_size - 1, self.budget - self.produced - 1)

    def commit(self, k: int, accepted: int, committed: list[int]) -> Block:
        """A verified block's committed tokens, cut at the first stop id (which is never emitted; the caches keep the
        block up to it)."""
        stop_at = next((i for i, x in enumerate(committed) if x in self.stop), None)
        emit = committed if stop_at is None else committed[:stop_at]
        keep = (accepted if stop_at is None else min(stop_at, accepted)) + 1
        self.produced += len(emit)
        self.stopped = stop_at is not None
        return Block(k, accepted, committed, emit, keep, self.stopped)

    def record(self, block: Block, decode_seconds: float) -> None:
        """A cycle's counts and times into the GenerationStats (the host and device cycles alike)."""
        stats, times = self.stats, block.times
        stats.cycles += 1
        stats.draft_tokens += block.k
        stats.accepted_tokens += block.accepted
        for j in range(block.accepted):
            stats.accepted_per_position[j] += 1
        stats.verify_sizes[block.k + 1] = stats.verify_sizes.get(block.k + 1, 0) + 1
        stats.draft_seconds += times.draft
        stats.verify_seconds += times.verify
        stats.rollback_seconds += times.rollback
        if self.vocab_mask is not None:  # committed tokens the restricted draft vocabulary could never have proposed
            stats.out_of_draft_vocab += sum(1 for x in block.emit if not bool(self.vocab_mask[x]))
        stats.generated_tokens += len(block.emit)
        stats.decode_seconds += decode_seconds

    def finish(self) -> None:
        """The finish reason once the cycles end: a stop id, else cancelled short of the budget, else "length"."""
        if self.stopped:
            self.stats.finish_reason = "stop"
        elif self.produced < self.budget:
            self.stats.finish_reason = "cancelled"


# ---- the host cycle -----------------------------------------------------------------------------------------------


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class HostCycle:
    """The speculative cycle on the host (CPU, transformers, exact mode), one cycle per step() as gpt-fast's
    speculative_decode: Engine.generate owns the loop. Nothing is in flight between steps: at every yield the
    target's cache and `context` (the drafter's KV over the target's features) cover exactly target.ids."""

    in_flight = False  # the host cycle never leaves work queued behind a yield

    def __init__(self, target, drafter, context, verify_length: VerifyLength, run: DecodeRun):
        self.target, self.drafter, self.context = target, drafter, context
        self.verify_length, self.run = verify_length, run
        self.token = None  # the block's known token: the last committed one
        self.idle = False  # the last step saw the cancel flag and ran no cycle
        self.seconds = 0.0  # the last cycle's decode time

    def begin(self, token: int) -> None:
        self.token = token

    def step(self) -> Block | None:
        """One cycle: draft, verify, the acceptance test, commit. None when cancelled before it began."""
        run, device = self.run, self.target.device
        params = run.params
        if run.cancelled():
            self.idle = True
            return None
        t0 = time.perf_counter()
        k = run.draft_budget(self.drafter.block_size)
        draft = self.drafter.draft(self.context, self.token, params.temperature, params.top_p, run.rng) if k else None
        t1 = _now(device)
        confidence = draft.confidence if k else []
        k = self.verify_length.choose(k, confidence, t1 - t0)
        proposal = draft.tokens[:k] if k else []
        logits, features = self.target.verify([self.token] + proposal, features=True)
        q = draft.probs[:k] if k and params.temperature else None  # the drafter's distributions, when sampling
        out = Acceptance.empty(k + 1, logits.device)
        accept_block(logits[:k + 1], torch.tensor(proposal, dtype=torch.long, device=logits.device), k, params, q,
                     run.rng, out)
        accepted, committed = read_acceptance(out.result.cpu())
        t2 = _now(device)
        self.verify_length.observe(k, t2 - t1, confidence, accepted)
        block = run.commit(k, accepted, committed)
        self.target.accept(block.keep)  # every cache now holds exactly the accepted prefix
        self.context.add_pending(features[:, :block.keep])
        t3 = _now(device)
        block.times = CycleTimes(draft=t1 - t0, verify=t2 - t1, rollback=t3 - t2)
        self.seconds = t3 - t0
        self.token = block.bonus
        return block

    def lap(self) -> float:
        """Decode seconds of the cycle just recorded: its own compute (the consumer's time is not the engine's)."""
        return self.seconds

    def done(self) -> bool:
        run = self.run
        return self.idle or run.stopped or run.produced >= run.budget

    def abandon(self) -> None:
        """Nothing is in flight at a yield."""

    def end(self) -> None:
        """Nothing to release."""
