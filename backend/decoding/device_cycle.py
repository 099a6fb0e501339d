"""The speculative cycle on the GPU fast path (backend/dflash/fast.py + FastTarget): drafting, verification and the
acceptance test stay on the device, and the host reads one small result per cycle. speculative.py holds the
host-side cycle (CPU, transformers path, exact mode) and the pieces both share (sampling, the adaptive verify length).

One cycle, k drafted tokens verified:
  1. (queued by the previous cycle) the drafter absorbed the last verify's features and drafted the next block;
  2. the host's one sync: the last verify's accepted count and committed tokens, and the new draft's confidences;
     it commits (target.accept: Gated DeltaNet state by copy), yields, and picks k (adaptive verify length);
  3. the target verifies [token, drafts[:k]] straight from the drafter's device buffer;
  4. the acceptance test on the device (greedy match; rejection sampling when sampling), and the next draft is
     queued behind it, its known token and context length being device tensors.
"""

from __future__ import annotations

import random
import time

import torch

from backend.decoding.speculative import first_token, record_cycle
from backend.sampling import sampling_probs


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


def _accept_on_device(logits, proposal, k: int, greedy: bool, params, q, rng, result, keep_out, token_out) -> None:
    """The acceptance test without leaving the device, written where its readers look: result [1 + k + 1] gets the
    accepted count, then the committed tokens (accepted drafts + the target's own); keep_out [1] = accepted + 1 and
    token_out [1] = the target's own token (the drafter's inputs for the next draft). logits [k+1, V] from the
    verify, proposal [k] the drafts. Greedy is six small kernels: each kernel between the verify and the next draft
    is GPU time on the cycle's critical path (as intermediates plus copies it was twelve)."""
    device = logits.device
    if greedy:
        choice = result[1:k + 2]  # the target's choices; the accepted drafts equal them
        torch.argmax(logits, dim=-1, out=choice)
        if k:
            torch.sum((proposal == choice[:k]).cumprod(0), 0, keepdim=True, out=result[:1])
        else:
            result[:1].zero_()
        torch.index_select(choice, 0, result[:1], out=token_out)
        torch.add(result[:1], 1, out=keep_out)
        return
    p = sampling_probs(logits, params.temperature, params.top_p)
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
    result[:1].copy_(accepted)
    result[1:k + 2].copy_(committed)
    token_out.copy_(bonus)
    torch.add(result[:1], 1, out=keep_out)


class _Marks:
    """Points in a cycle: CUDA events (timed on the device, read after the cycle's sync) or, on the CPU, clocks."""

    def __init__(self, cuda: bool, count: int = 6):
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(count)] if cuda else None
        self.clock = [0.0] * count

    def record(self, i: int) -> None:
        if self.events:
            self.events[i].record()
        else:
            self.clock[i] = time.perf_counter()

    def seconds(self, i: int, j: int) -> float:
        if self.events:
            return self.events[i].elapsed_time(self.events[j]) / 1e3
        return self.clock[j] - self.clock[i]


def device_speculative_decode(target, fd, verify_length, forced, logits, params, budget: int, rng, cancelled, stats):
    """speculative_decode on the GPU fast path (backend/dflash/fast.py + FastTarget): drafting, verification and
    the acceptance test stay on the device, and the host reads one small result per cycle. The next draft is queued
    before that read (its known token and its context are device tensors), so the read returns the last verify's
    accepted count and committed tokens together with the next draft's confidences (for the adaptive verify length).

    After the read the host commits and queues the next cycle at once, and only then records statistics and yields:
    the GPU verifies while the host does its bookkeeping and the consumer handles the tokens, where it used to sit
    idle through both. So at a yield one verify may be queued; it is tentative (FastModel keeps the caches' live
    state), and a consumer that cancels or closes the generator there gets it dropped (_abandon): the invariant at
    every yield is speculative_decode's, the caches cover exactly target.ids."""
    device = target.device
    B = fd.block_size
    stats.accepted_per_position = [0] * (B - 1)
    stop = set(params.stop_token_ids)
    greedy = params.temperature == 0
    vocab_mask = fd.drafter.target_vocab_mask  # restricted draft vocabulary (host), or None

    token = first_token(logits, params, rng, stop, stats, vocab_mask)
    if token is None:
        return
    yield [token]
    produced = 1
    if produced >= budget:
        return

    cuda = device.type == "cuda"
    result = torch.zeros(B + 1, dtype=torch.long, device=device)
    host = torch.zeros(B + 1, dtype=torch.long, pin_memory=cuda)
    host_conf = torch.zeros(B - 1, pin_memory=cuda)
    done = torch.cuda.Event() if cuda else None
    marks = _Marks(cuda)  # 0 verify 1 acceptance test 2 draft 3; 4 commit 5
    t = time.perf_counter()
    marks.record(2)
    fd.launch(token=token)
    q = fd.sample(params.temperature, params.top_p, rng) if not greedy else None
    marks.record(3)
    queued = None  # (k, the confidences of the draft it verifies) of the verify on the device, not committed yet
    draft_seconds = None  # the last draft's time; None until the first draft's is read
    committed_before = False  # a commit's marks (4, 5) were recorded before this sync: its time can be read
    while True:
        # the cycle's one host sync
        host.copy_(result, non_blocking=cuda)
        host_conf.copy_(fd.confidence, non_blocking=cuda)
        if cuda:
            done.record()
            done.synchronize()
        if draft_seconds is None:  # the first draft: before any cycle, so timed apart from the cycles' drafts
            draft_seconds = marks.seconds(2, 3)
            stats.first_draft_seconds += draft_seconds
        finished, emit, stop_at = None, [], None
        if queued is not None:
            k, conf = queued
            accepted = int(host[0])
            committed = host[1:accepted + 2].tolist()
            stop_at = next((i for i, x in enumerate(committed) if x in stop), None)
            emit = committed if stop_at is None else committed[:stop_at]
            keep = (accepted if stop_at is None else min(stop_at, accepted)) + 1
            # read before this commit and the next cycle record their own marks. The previous commit's device time
            # (a hybrid target replays its Gated DeltaNet states to the kept prefix) counts with this cycle's
            # acceptance test: both bring the caches to the accepted prefix, neither is host time (where the bench
            # charged the commit until 2026-12-02)
            verify_s, draft_seconds, accept_s = marks.seconds(0, 1), marks.seconds(2, 3), marks.seconds(1, 2)
            if committed_before:
                accept_s += marks.seconds(4, 5)
            marks.record(4)
            # the block was [token, accepted drafts..]: the caches keep exactly its first `keep` positions
            target.accept(keep, [token] + committed[:keep - 1])
            fd.length += accepted + 1  # what the queued draft absorbed on the device
            if keep != accepted + 1:
                fd.set_length(len(target.ids))
            marks.record(5)
            committed_before = True
            verify_length.observe(k, verify_s, conf, accepted)
            finished = (k, accepted, verify_s, accept_s)
            produced += len(emit)
            token = committed[accepted]  # the target's own token: the next block's first
        queued = None
        if stop_at is None and produced < budget and not cancelled():
            k = min(B - 1, budget - produced - 1)  # the target's own token must fit in the budget too
            conf = host_conf[:k].tolist() if forced is None else forced.confidence(k)
            k = verify_length.choose(k, conf, draft_seconds)
            if forced is not None and k:
                forced.propose(fd.block_tokens, produced, k)
            marks.record(0)
            logits, feats = target.verify_on_device(fd.block_tokens[:k + 1], features=True)
            marks.record(1)
            # the accepted count and the target's own token land in the drafter's inputs (keep_dev, token_dev)
            _accept_on_device(logits, fd.block_tokens[1:k + 1], k, greedy, params, q, rng, result, fd.keep_dev,
                              fd.token_dev)
            marks.record(2)
            fd.launch(features=feats, rows=k + 1, upper_length=fd.length + k + 1)
            if not greedy:
                q = fd.sample(params.temperature, params.top_p, rng)
            marks.record(3)
            queued = (k, conf[:k])
        if finished is not None:
            k_done, accepted, verify_s, accept_s = finished
            # the acceptance test on the device stands where the host cycle's rollback does
            record_cycle(stats, k_done, accepted, emit, vocab_mask, draft_seconds, verify_s, accept_s)
            now = time.perf_counter()
            stats.decode_seconds += now - t
            t = now
            if emit:
                try:
                    yield emit
                except BaseException:  # closed (or thrown into) at this yield: the queued verify never happened
                    if queued is not None:
                        _abandon(target, fd)
                    raise
        if queued is not None and cancelled():  # cancelled while the consumer held the tokens
            _abandon(target, fd)
            queued = None
        if queued is None:
            if stop_at is not None:
                stats.finish_reason = "stop"
            elif produced < budget:
                stats.finish_reason = "cancelled"
            fd.set_length(len(target.ids))  # a queued draft's context is not needed
            return


def _abandon(target, fd) -> None:
    """Drop the verify queued on the device (and the draft behind it): the caches and the drafter's context cover
    exactly target.ids again."""
    target.abandon()
    fd.set_length(len(target.ids))
