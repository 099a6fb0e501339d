"""The speculative cycle on the GPU fast path (backend/dflash/fast.py + FastTarget), DeviceCycle: drafting,
verification and the acceptance test stay on the device, and the host reads one small result per cycle.
speculative.py holds what both cycles share (DecodeRun, Block, the acceptance test accept_block, the adaptive verify
length) and the host cycle; Engine.generate runs either, one step() a cycle.

One step(), k drafted tokens verified:
  1. (queued by the previous step) the drafter absorbed the last verify's features and drafted the next block;
  2. the host's one sync: the last verify's accepted count and committed tokens, and the new draft's confidences;
     it commits (target.accept: Gated DeltaNet state by copy) and picks k (adaptive verify length);
  3. the target verifies [token, drafts[:k]] straight from the drafter's device buffer;
  4. the acceptance test on the device (accept_block: greedy match; rejection sampling when sampling), and the next
     draft is queued behind it, its known token and context length being device tensors;
  5. (Engine.generate) the step's Block is recorded and yielded while the GPU works through 3-4.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from backend.decoding.speculative import (
    Acceptance,
    Block,
    CycleTimes,
    accept_block,
    read_acceptance,
)


class ForcedAcceptance:
    """Benchmarks only (`reviewer bench --forced-tau`): random weights accept nothing, so to time the real cycle at a
    real tau the drafter computes as always, then its proposal is replaced by the target's own greedy continuation
    (`reference`, from a plain run of the same prompt) up to an accept length drawn per cycle from a geometric law
    with mean tau - 1 accepted drafts, and a token that cannot match after it. The target still verifies every
    token: where its verify disagrees with its plain steps, acceptance stops there.

    The drafter's confidences, which the adaptive verify length reads, are replaced too: under the forcing's law each
    draft is accepted, given the ones before it were, with probability 1 - 1/tau, which is what a calibrated drafter
    of that tau would report (a random drafter's own confidences are near zero, and the adaptive length trusting
    them verified one token a cycle: bench/results/spec_e2e_qwen3.6-35b-a3b-shape_h200_20261202_adaptive_at_load_
    routing_trace50.json, forced_tau_4.9_adaptive).

    The forcing must not cost the cycle what the product's cycle does not pay: the draw is plain Python and the
    proposal arrives as two copies from host buffers made once (the continuation and its misses), no kernel of its
    own. (Drawn with torch.rand and built with device ops, it cost ~0.44 ms a cycle at the 35B-A3B shape on the
    H200: 0.72 ms of host time against 0.28 unforced, bench/results/spec_e2e_qwen3.6-35b-a3b-shape_h200_20261201_
    invariant_verify.json.) The buffers are never written again, so an asynchronous copy cannot race."""

    def __init__(self, reference: list[int], tau: float, vocab: int, device, seed: int = 0):
        pinned = torch.device(device).type == "cuda"
        ref = torch.tensor(list(reference) + [0] * 32, dtype=torch.long)
        self.reference = ref.pin_memory() if pinned else ref
        self.miss = ((ref + 1) % int(vocab)).pin_memory() if pinned else (ref + 1) % int(vocab)
        self.non_blocking = pinned
        self.tau, self.vocab = float(tau), int(vocab)
        self.p_stop = 1.0 / max(self.tau, 1.0)  # geometric: P(accept one more) = 1 - 1/tau, mean committed = tau
        self.rng = random.Random(seed)

    def confidence(self, k: int) -> list[float]:
        """What a calibrated drafter of this tau would report for k drafts: each accepted (given the ones before)
        with probability 1 - 1/tau."""
        return [1.0 - self.p_stop] * k

    def draw(self, k: int) -> int:
        accepted = 0
        while accepted < k and self.rng.random() >= self.p_stop:
            accepted += 1
        return accepted

    def propose(self, block_tokens: torch.Tensor, produced: int, k: int) -> None:
        """Overwrite drafts 1..k of block_tokens (device) in place: the reference's next `a` tokens, then misses;
        `produced` tokens are already committed, so the reference continues at index produced (the block's known
        token is reference[produced - 1])."""
        a = self.draw(k)
        if a:
            block_tokens[1:a + 1].copy_(self.reference[produced:produced + a], non_blocking=self.non_blocking)
        if a < k:
            block_tokens[a + 1:k + 1].copy_(self.miss[produced + a:produced + k], non_blocking=self.non_blocking)


class Clock:
    """Named points in a cycle: CUDA events (timed on the device, read after the cycle's sync) or, on the CPU,
    clocks. verify .. accept: the target's verify; accept .. draft: the acceptance test; draft .. drafted: the next
    draft (and, when sampling, its draws); commit .. committed: target.accept after the sync."""

    POINTS = ("verify", "accept", "draft", "drafted", "commit", "committed")

    def __init__(self, cuda: bool):
        self.events = {p: torch.cuda.Event(enable_timing=True) for p in self.POINTS} if cuda else None
        self.clock = dict.fromkeys(self.POINTS, 0.0)

    def record(self, point: str) -> None:
        if self.events:
            self.events[point].record()
        else:
            self.clock[point] = time.perf_counter()

    def seconds(self, start: str, end: str) -> float:
        if self.events:
            return self.events[start].elapsed_time(self.events[end]) / 1e3
        return self.clock[end] - self.clock[start]


@dataclass
class InFlight:
    """The verify queued on the device and not committed yet: its k drafts and the confidences the host read for
    them (the adaptive verify length observes them once its acceptance is known)."""

    k: int
    confidence: list[float]


class DeviceCycle:
    """The speculative cycle on the GPU fast path (backend/dflash/fast.py + FastTarget): drafting, verification and
    the acceptance test stay on the device, and the host reads one small result per cycle. The next draft is queued
    before that read (its known token and its context are device tensors), so the read returns the last verify's
    accepted count and committed tokens together with the next draft's confidences (for the adaptive verify length).

    Each step() syncs once, commits the verify in flight and queues the next cycle at once; Engine.generate only then
    records statistics and yields: the GPU verifies while the host does its bookkeeping and the consumer handles the
    tokens. So at a yield one verify may be in flight; it is tentative (FastModel keeps the caches' live state), and
    a consumer that cancels or closes the generator there gets it dropped (abandon): the invariant at every yield is
    the host cycle's, the caches cover exactly target.ids."""

    def __init__(self, target, fd, verify_length, forced, run):
        self.target, self.fd, self.verify_length, self.forced, self.run = target, fd, verify_length, forced, run
        self.greedy = run.params.temperature == 0
        self.in_flight: InFlight | None = None
        self.token = None  # the known token of the block in flight (the last committed one)
        self.q = None  # the queued draft's distributions (sampling only)
        self.draft_seconds = None  # the last draft's time; None until the first draft's is read
        self.committed_before = False  # a commit's points were recorded before this sync: its time can be read

    def begin(self, token: int) -> None:
        """Buffers for the cycle's one read, and the first draft queued after the prompt's token."""
        B, device = self.fd.block_size, self.target.device
        cuda = device.type == "cuda"
        self.cuda = cuda
        self.acceptance = Acceptance(result=torch.zeros(B + 1, dtype=torch.long, device=device), keep=self.fd.keep_dev,
                                     token=self.fd.token_dev)
        self.host = torch.zeros(B + 1, dtype=torch.long, pin_memory=cuda)
        self.host_conf = torch.zeros(B - 1, pin_memory=cuda)
        self.done_event = torch.cuda.Event() if cuda else None
        self.clock = Clock(cuda)
        self.token = token
        self.t = time.perf_counter()
        self.clock.record("draft")
        self.fd.launch(token=token)
        self.q = self.fd.sample(self.run.params.temperature, self.run.params.top_p, self.run.rng) \
            if not self.greedy else None
        self.clock.record("drafted")

    def step(self) -> Block | None:
        """The cycle's one host sync; commit the verify in flight (its Block) and queue the next while run.more()."""
        self.host.copy_(self.acceptance.result, non_blocking=self.cuda)
        self.host_conf.copy_(self.fd.confidence, non_blocking=self.cuda)
        if self.cuda:
            self.done_event.record()
            self.done_event.synchronize()
        if self.draft_seconds is None:  # the first draft: before any cycle, so timed apart from the cycles' drafts
            self.draft_seconds = self.clock.seconds("draft", "drafted")
            self.run.stats.first_draft_seconds += self.draft_seconds
        block = self._commit() if self.in_flight is not None else None
        self.in_flight = None
        if self.run.more():
            self._queue()
        return block

    def _commit(self) -> Block:
        k, confidence = self.in_flight.k, self.in_flight.confidence
        accepted, committed = read_acceptance(self.host)
        block = self.run.commit(k, accepted, committed)
        # read before this commit and the next cycle record their own points. The previous commit's device time (a
        # hybrid target replays its Gated DeltaNet states to the kept prefix) counts with this cycle's acceptance
        # test: both bring the caches to the accepted prefix, neither is host time (where the bench charged the
        # commit until 2026-12-02)
        clock = self.clock
        times = CycleTimes(draft=clock.seconds("draft", "drafted"), verify=clock.seconds("verify", "accept"),
                           rollback=clock.seconds("accept", "draft"))
        if self.committed_before:
            times.rollback += clock.seconds("commit", "committed")
        block.times, self.draft_seconds = times, times.draft
        clock.record("commit")
        # the block was [token, accepted drafts..]: the caches keep exactly its first `keep` positions
        self.target.accept(block.keep, [self.token] + committed[:block.keep - 1])
        self.fd.length += accepted + 1  # what the queued draft absorbed on the device
        if block.keep != accepted + 1:
            self.fd.set_length(len(self.target.ids))
        clock.record("committed")
        self.committed_before = True
        self.verify_length.observe(k, times.verify, confidence, accepted)
        self.token = block.bonus
        return block

    def _queue(self) -> None:
        """Verify [token, drafts[:k]] from the drafter's device buffer, test acceptance on the device (the accepted
        count and the target's own token land in the drafter's inputs, keep_dev and token_dev) and queue the next
        draft behind it: nothing here waits for the device."""
        fd, run, clock = self.fd, self.run, self.clock
        k = run.draft_budget(fd.block_size)
        forced = self.forced
        confidence = self.host_conf[:k].tolist() if forced is None else forced.confidence(k)
        k = self.verify_length.choose(k, confidence, self.draft_seconds)
        if forced is not None and k:
            forced.propose(fd.block_tokens, run.produced, k)
        clock.record("verify")
        logits, feats = self.target.verify_on_device(fd.block_tokens[:k + 1], features=True)
        clock.record("accept")
        accept_block(logits, fd.block_tokens[1:k + 1], k, run.params, self.q, run.rng, self.acceptance)
        clock.record("draft")
        fd.launch(features=feats, rows=k + 1, upper_length=fd.length + k + 1)
        if not self.greedy:
            self.q = fd.sample(run.params.temperature, run.params.top_p, run.rng)
        clock.record("drafted")
        self.in_flight = InFlight(k, confidence[:k])

    def lap(self) -> float:
        """Decode seconds since the last record: the device cycle's wall time, the consumer's included (the GPU
        works through it)."""
        now = time.perf_counter()
        seconds, self.t = now - self.t, now
        return seconds

    def done(self) -> bool:
        return self.in_flight is None

    def abandon(self) -> None:
        """Drop the verify in flight (and the draft behind it): the caches and the drafter's context cover exactly
        target.ids again."""
        if self.in_flight is not None:
            self.target.abandon()
            self.fd.set_length(len(self.target.ids))
            self.in_flight = None

    def end(self) -> None:
        self.fd.set_length(len(self.target.ids))  # a queued draft's context is not needed
