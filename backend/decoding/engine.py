"""The decoding engine: batch-1 generation over a causal LM (target.py: the fast path where backend/models
covers the architecture, transformers otherwise), with prefix reuse across requests and, when a drafter is given,
DFlash speculative decoding (speculative.py on the host, device_cycle.py on the GPU).

Data flow: server -> Engine.generate(prompt_ids, params) -> yields committed token ids -> server.
The target keeps one cache and the token ids it covers, so the next request (an agent resends its whole conversation
every turn) only prefills what is new.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from backend.decoding import speculative as spec
from backend.decoding.device_cycle import DeviceCycle
from backend.decoding.target import FastTarget, HFTarget
from backend.dflash.fast import FastDrafter
from backend.models import load_fast, no_fast_path
from backend.models.captures import COUNTS as CAPTURE_COUNTS
from backend.models.captures import mark_ready as mark_captures_ready
from backend.models.numerics import LLAMA_INVARIANT_PATH, Numerics, resolve_numerics
from backend.sampling import sample_token

log = logging.getLogger("reviewer.backend")


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
    # bringing caches to the accepted prefix (crop + linear-attention replay); the device cycle adds its acceptance
    # test, which the host cycle counts in verify_seconds
    rollback_seconds: float = 0.0
    # the device cycle's first draft, queued after the prefill, before any cycle (so in no cycle's draft_seconds)
    first_draft_seconds: float = 0.0
    # committed tokens the restricted draft vocabulary could never have proposed (0 without a restricted vocabulary)
    out_of_draft_vocab: int = 0
    # verify blocks by size (number of tokens sent to the target, including the known token) -> count
    verify_sizes: dict[int, int] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Mean tokens committed per speculative cycle (accepted drafts + the target's own token)."""
        return (self.accepted_tokens + self.cycles) / self.cycles if self.cycles else 0.0


def warm_prefill_lengths(chunk: int, max_context: int) -> list[int]:
    """Prompt lengths Engine.warm_up prefills: every block size (1..16), then sizes on both sides of each power of
    two up to a prefill chunk (divisible by 16 and not), so each compiled variant a prompt can need exists; then
    three prompts longer than a chunk (a later chunk after a whole chunk's past; the drafter absorbing more features
    than one chunk's). Those were added for the 35B-A3B replay's 3 compilations after ready, which turned out to be
    the MoE workspace's pointer alignment (reviewer_kernels/fused_moe.py align_workspace); the replay that measured 0
    after the fix warmed them too, so they stay until a replay without them shows 0 as well (they cost three prefills at
    start-up)."""
    lengths = list(range(1, 17))
    size = 32
    while size <= chunk:
        lengths += [size - 8, size, size + size // 2 - 3]
        size *= 2
    short = {n for n in lengths if 0 < n <= min(chunk, max_context - 8)}
    longer = {chunk + n for n in (5, 45, 48) if chunk + n <= max_context - 8}
    return sorted(short | longer)


class Engine:
    """Batch-1 generation with prefix reuse. Not thread-safe: the server drives it from one worker thread.

    fast: run the target on backend/models' fast path (static caches, rollback by copy, CUDA graphs) when it covers
    the architecture (None: whenever it does and loads; False: always transformers; True: required). exact:
    batch-invariant forwards on the fast path, so greedy speculative output is token-identical to plain decoding in
    bf16 too (None: on for a CPU engine with a drafter; a plain engine that serves as its reference needs
    exact=True; see backend/decoding/target.py for what it costs). compile: torch.compile the fast path's per-layer glue
    for decode steps and verifies (None: on CUDA, where it fuses the norms, RoPE and gates that otherwise cost a
    launch each; the first step of each shape compiles, ~tens of seconds). device_cycle: the speculative cycle on the
    device (backend/decoding/device_cycle.py, backend/dflash/fast.py: drafter in CUDA graphs over static caches,
    acceptance on the device, one host sync per cycle; None: on CUDA whenever the fast path runs outside exact
    mode; True elsewhere too, for tests). invariant_verify: the fast model's decode steps and verifies in numerics
    where a verify is cheap and a position's logits do not depend on how it was reached (Qwen3.5/3.6-MoE's padded
    rows, Llama's tensor-core row kernels), so greedy speculative output is token-identical to plain decoding (None:
    on for every CUDA engine on the fast path outside exact mode, with a drafter or without: one numerics on the GPU,
    so `--drafter none` and `--drafter auto` give the same text; False: the one-token kernels of earlier versions, for
    benchmarks that compare with them). llama_invariant_path: how a Llama runs those numerics, "mma" (tensor-core
    rows) or "glue" (compiled glue over cuBLAS; backend/models/numerics.py says why "mma" is the default).

    The arguments are resolved once, here, into `self.numerics` (backend/models/numerics.py: resolve_numerics, a
    frozen Numerics record of which kernels run and why), which the fast model is built with and reads; an invalid
    combination is a ValueError."""

    def __init__(self, model, *, drafter=None, max_context: int | None = None, prefill_chunk: int = 2048,
                 adaptive_verify: bool = False, fast: bool | None = None, exact: bool | None = None,
                 compile: bool | None = None, device_cycle: bool | None = None,
                 invariant_verify: bool | None = None, llama_invariant_path: str = LLAMA_INVARIANT_PATH):
        self.model = model
        self.drafter = drafter
        self.device = next(model.parameters()).device
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.max_context = max_context or getattr(config, "max_position_embeddings", None) or 1 << 30
        self.last_stats = GenerationStats()
        if drafter is not None:
            drafter.check_target(model)
        features = tuple(drafter.target_layer_ids) if drafter is not None else ()
        # the numerics, resolved once here (backend/models/numerics.py); again only if the fast path fails to load
        resolve = functools.partial(resolve_numerics, self.device.type, drafter=drafter is not None, fast=fast,
                                    exact=exact, compile=compile, device_cycle=device_cycle,
                                    invariant_verify=invariant_verify, llama_invariant_path=llama_invariant_path)
        self.target, self.numerics = self._make_target(model, features, prefill_chunk, fast, resolve)
        log.info("decoding: %s", self.numerics.describe())
        self.verify_length = spec.VerifyLength(adaptive_verify)  # measured T_t(n) and acceptance; adaptive or not
        self.draft_context = None  # drafter KV over context features, covering the same positions as the target
        # on the GPU fast path the drafter runs from CUDA graphs over static caches and the cycle stays on the
        # device (backend/dflash/fast.py, backend/decoding/device_cycle.py); elsewhere the eager drafter
        self.fast_drafter = FastDrafter(drafter, self.max_context) if self.numerics.device_cycle else None
        self.forced_acceptance = None  # benchmarks only: device_cycle.ForcedAcceptance

    def _make_target(self, model, features, prefill_chunk, fast, resolve) -> tuple[object, Numerics]:
        """The target and the numerics it runs: the fast path's FastTarget built with the record, or HFTarget (no
        fast path, fast=False, or a fast path that failed to load with fast=None: then the numerics again, without
        it)."""
        reason = no_fast_path(model.config)
        numerics = resolve(fast_path=reason is None)
        if fast is not False:
            self.max_context = min(self.max_context, 1 << 20)  # the fast path preallocates its caches
            if reason is not None:
                log.info("no fast path for this model (%s): using transformers", reason)
        if not numerics.fast:
            return HFTarget(model, features, prefill_chunk), numerics
        # exact mode pads plain steps and verifies alike to this many tokens, with or without a drafter: the same
        # shapes on both sides are what makes their logits equal (drafters with blocks > 16 get their size)
        block = max(16, getattr(self.drafter, "block_size", 0))
        try:  # room for a padded block past the last position the engine will ever fill
            fast_model = load_fast(model, max_context=self.max_context + block, max_block=block,
                                   compile=numerics.compile, numerics=numerics)
        except Exception as exc:  # an unusual layout (weights split over devices, offloaded): keep transformers
            if fast:
                raise
            log.warning("fast path unavailable (%s: %s); using transformers", type(exc).__name__, exc)
            return HFTarget(model, features, prefill_chunk), resolve(fast_path=False)
        return FastTarget(fast_model, features, prefill_chunk), numerics

    @property
    def fast(self) -> bool:
        return isinstance(self.target, FastTarget)

    @property
    def invariant_verify(self) -> bool:
        """Whether the fast model's decode steps and verifies take the batch-invariant numerics (the record's
        invariant_steps: Engine(invariant_verify=...) resolved)."""
        return self.numerics.invariant_steps

    @property
    def lossless(self) -> bool:
        """Whether greedy output is token-identical to plain decoding of this engine: always without a drafter;
        with one, when a position's logits do not depend on how it was reached (a one-token step or any verify
        block): exact mode, or a fast-path target whose kernels are batch-invariant on this device (on CUDA: the
        Llama rows or glue path, Qwen3.5/3.6-MoE's padded rows under invariant_verify). The transformers path is
        not: at near-ties its speculative output can differ from plain decoding."""
        if self.drafter is None:
            return True
        if not self.fast:
            return False
        return self.target.exact or bool(getattr(self.target.fast.model, "batch_invariant", False))

    def describe_decoding(self) -> str:
        """One line for the operator: plain or speculative, and whether greedy output equals plain decoding."""
        if self.drafter is None:
            return "plain decoding (no drafter)"
        how = "on the device, CUDA graphs" if self.fast_drafter is not None else "eager"
        if self.lossless:
            why = self.numerics.lossless_because
            return (f"speculative decoding (DFlash, block {self.drafter.block_size}, {how}), lossless: greedy output "
                    f"is token-identical to --drafter none ({why})")
        return (f"speculative decoding (DFlash, block {self.drafter.block_size}, {how}), NOT lossless on this path: "
                "greedy output can differ from plain decoding at near-ties (use --drafter none for plain decoding)")

    @property
    def captures(self):
        """CUDA graphs captured and kernels compiled so far, and after mark_ready() (backend/models/captures.py)."""
        return CAPTURE_COUNTS

    def mark_ready(self) -> None:
        """The server said ready: later captures and compilations are on the request path (counted, logged)."""
        mark_captures_ready()

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Do now what the first requests would otherwise pay for: compile the fast path's glue and capture every
        CUDA graph a request can replay (the target's decode step, its verifies of 1..block tokens and Gated DeltaNet
        accepts, the drafter's cycles: all independent of the context length, backend/models/fast.py), and run a
        short generation and prompts of a few lengths so the kernels of each shape are compiled. Returns the number of
        graphs held. The caches are empty afterwards. A no-op on the CPU."""
        if not (self.fast and self.device.type == "cuda"):
            return 0
        self._reset()
        fast = self.target.fast
        features = self.target.feature_layers if self.drafter is not None else ()
        graphs = fast.capture_graphs(features, verify=self.drafter is not None)
        if self.fast_drafter is not None:
            graphs += self.fast_drafter.capture_graphs()
        # prefill kernels specialise on lengths: Triton on divisibility by 16, the block-attention launch on its row
        # chunks (1..16 tokens), the MoE kernels' tile configs on token-count buckets. A prompt of each kind now,
        # not on a user's request (the 35B-A3B shape compiled 11-13 kernels on a session's first turns without it),
        # then a generation that takes every path once (plain steps, or draft + verify + accept + rollback)
        for n in warm_prefill_lengths(getattr(self.target, "prefill_chunk", 2048), self.max_context):
            list(self.generate([0] * n, SamplingParams(max_tokens=2)))
            self._reset()
        list(self.generate([0] * 24, SamplingParams(max_tokens=24)))
        list(self.generate([0] * 24 + [1] * 5, SamplingParams(max_tokens=8)))  # prefix reuse: a prompt that extends
        self._reset()
        _sync(self.device)
        return graphs

    @torch.inference_mode()
    def measure_verify_costs(self, reps: int = 3) -> dict[int, float]:
        """The adaptive verify length's cost curve, measured on this device now: T_t(n) in seconds for a verify of
        n = 1..block tokens through the path the cycle takes (from a device buffer on the GPU, timed with CUDA events
        as the cycle times it), the median of `reps` after one untimed verify that compiles and captures the size.
        The curve seeds the running means the cycles then update. Each verify is abandoned: the caches and
        cache_ids are as before. Needs a context (run it after a warm-up generation); {} without a drafter, on the
        transformers path or with an empty cache."""
        target = self.target
        if self.drafter is None or not self.fast or not target.ids:
            return {}
        cuda = self.device.type == "cuda"
        on_device = self.fast_drafter is not None
        tokens = torch.full((self.drafter.block_size,), target.ids[-1], dtype=torch.long,
                            device=self.device if on_device else "cpu")
        costs = {}
        for n in range(1, self.drafter.block_size + 1):
            times = []
            for rep in range(reps + 1):
                _sync(self.device)
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                if on_device:
                    target.verify_on_device(tokens[:n], features=True)
                else:
                    target.verify(tokens[:n].tolist(), features=True)
                if cuda:
                    end.record()
                    end.synchronize()
                    seconds = start.elapsed_time(end) / 1e3
                else:
                    seconds = time.perf_counter() - t0
                target.abandon()
                if rep:
                    times.append(seconds)
            costs[n] = statistics.median(times)
        self.verify_length.cost.seed(costs)
        return costs

    @property
    def cache_ids(self) -> list[int]:
        """Token ids whose states the target cache holds, in order."""
        return self.target.ids

    @property
    def cache(self):
        """The transformers cache (HF path only; tests compare its states)."""
        return getattr(self.target, "cache", None)

    def _reset(self) -> None:
        self.target.reset()
        self.draft_context = None

    def _new_draft_context(self):
        if self.fast_drafter is not None:
            self.fast_drafter.reset()
            return self.fast_drafter
        return self.drafter.new_context()

    # ---- generation ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[list[int]]:
        """Yield lists of newly committed token ids; afterwards self.last_stats holds the GenerationStats. The loop is
        here (as gpt-fast's generate): plain steps, or one speculative cycle per step of a HostCycle or DeviceCycle.

        Closing the generator early (generator.close()) leaves the engine consistent: the cache always matches
        self.cache_ids at every yield.
        """
        prompt = [int(t) for t in prompt_ids]
        check_request(prompt, params, self.max_context, self.model.get_input_embeddings().weight.shape[0])
        stats = self.last_stats = GenerationStats(prompt_tokens=len(prompt))
        run = spec.DecodeRun(params, min(params.max_tokens, self.max_context - len(prompt)),
                             _generator(params.seed, self.device), cancelled, stats,
                             vocab_mask=getattr(self.drafter, "target_vocab_mask", None))
        try:
            logits = self._prefill(prompt, run)
            if logits is None:
                return
            if self.drafter is None or run.budget <= 1:
                yield from self._plain_decode(logits, run)
            else:
                yield from self._speculate(self._cycle(run), logits, run)
        except GeneratorExit:
            raise  # closed at a yield, where the cache always matches self.cache_ids: nothing to undo
        except BaseException:
            self._reset()  # an exception mid-forward may have left the cache half-updated
            raise

    def _prefill(self, prompt: list[int], run: spec.DecodeRun):
        """Reuse the cached prefix and prefill the rest: the logits after the prompt, or None when cancelled between
        chunks. The drafter's context follows the target's cache."""
        target, stats = self.target, run.stats
        t0 = time.perf_counter()
        reused, logits = target.reuse(prompt)
        stats.cached_tokens = reused
        if self.draft_context is not None:
            self.draft_context.crop(len(target.ids))
        features = None
        if logits is None:
            want = self.drafter is not None
            if want and self.draft_context is None:
                self.draft_context = self._new_draft_context()
            logits, features = target.prefill(prompt[reused:], want, run.cancelled)
            if logits is None:  # cancelled between chunks: the drafter keeps covering what the target holds
                if features is not None:
                    self.draft_context.add_pending(features)
                stats.finish_reason = "cancelled"
                return None
            target.remember_prompt(prompt, logits)
        _sync(self.device)
        stats.prefill_seconds = time.perf_counter() - t0
        if features is not None:
            self.draft_context.add_pending(features)  # the drafter's context always covers self.cache_ids
        return logits

    def _cycle(self, run: spec.DecodeRun):
        """The speculative cycle this engine runs: on the device (fast drafter) or on the host."""
        if self.fast_drafter is not None:
            return DeviceCycle(self.target, self.draft_context, self.verify_length, self.forced_acceptance, run)
        return spec.HostCycle(self.target, self.drafter, self.draft_context, self.verify_length, run)

    def _speculate(self, cycle, logits, run: spec.DecodeRun) -> Iterator[list[int]]:
        """The speculative loop, one cycle a step. Invariant at every yield: the target's cache and the drafter's
        context cover exactly target.ids, but for the device cycle's verify in flight, which a consumer that stops
        at the yield (closes, throws or cancels) gets dropped."""
        run.stats.accepted_per_position = [0] * (self.drafter.block_size - 1)
        token = run.first_token(logits)
        if token is None:
            return
        yield [token]
        if run.produced >= run.budget:
            return
        cycle.begin(token)
        while True:
            block = cycle.step()
            if block is not None:
                run.record(block, cycle.lap())
                if block.emit:
                    try:
                        yield block.emit
                    except BaseException:  # closed (or thrown into) at this yield: the queued verify never happened
                        cycle.abandon()
                        raise
            if cycle.in_flight and run.cancelled():  # cancelled while the consumer held the tokens
                cycle.abandon()
            if cycle.done():
                break
        run.finish()
        cycle.end()

    def _plain_decode(self, logits, run: spec.DecodeRun) -> Iterator[list[int]]:
        params, stats = run.params, run.stats
        t = time.perf_counter()
        for i in range(run.budget):
            if run.cancelled():
                stats.finish_reason = "cancelled"
                break
            token = sample_token(logits, params.temperature, params.top_p, run.rng)
            if token in run.stop:
                stats.finish_reason = "stop"
                break
            stats.generated_tokens += 1
            stats.decode_seconds += time.perf_counter() - t
            yield [token]
            t = time.perf_counter()
            if i + 1 < run.budget:  # the last token needs no forward: nobody reads its logits
                logits = self.target.step(token)
        else:
            stats.finish_reason = "length"
        _sync(self.device)
        stats.decode_seconds += time.perf_counter() - t


# ---- helpers ------------------------------------------------------------------------------------------------------


def check_request(prompt: list[int], params: SamplingParams, max_context: int, vocab: int) -> None:
    """A request's prompt and sampling parameters, as every engine takes them (this one and llamacpp.py's)."""
    if not prompt:
        raise ValueError("the prompt is empty")
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
