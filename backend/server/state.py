"""What the routes need and the loading thread fills in: ServerState (settings, metrics, and once loaded the model
and the engine worker), the stop flag a signal handler sets, and the --drafter resolution.

Imported by app.py (which builds it), the routes and guards.py (which read it); it imports none of them.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
import time

from backend import chat
from backend.loading import LoadedModel, ModelLoadError, gguf_file, load_for_gguf_runtime, load_model, resolve_device
from backend.server.limits import ConnectionGate, ServeLimits
from backend.server.metrics import Metrics
from backend.server.worker import EngineWorker

log = logging.getLogger("reviewer.backend")


def release_freed_memory() -> None:
    """Give freed heap back to the system (glibc keeps freed memory mapped: after a rejected 20 MB request the RSS
    stayed gigabytes higher, before the body cap). Costs a few ms; a no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- server state ----------------------------------------------------------------------------------------------------

class StopFlag:
    """A set-once flag that takes no lock, so a signal handler may set it. The stop flag used to be a
    threading.Event, set from uvicorn's SIGTERM handler; Event.set() holds a non-reentrant lock, and a second SIGTERM
    landing while the first handler held it ran the handler again on the same (event-loop) thread, which then waited
    on that lock forever: no final event, no close, no exit (issue 29; a burst of SIGTERMs hit it 1 run in 6).
    Readers poll it (jobs.py); nobody waits on it."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class ServerState:
    """What the routes need: settings, metrics, and (once loading finished) the model and the engine worker."""

    def __init__(self, model, drafter: str, device: str, dtype: str, max_context: int | None, api_key: str | None,
                 queue_timeout: float, max_body_bytes: int | None, body_timeout: float,
                 limits: ServeLimits | None = None, cpu_engine: str = "auto", threads: int | None = None):
        self.model_spec, self.drafter_spec = model, drafter
        self.cpu_engine, self.threads = cpu_engine, threads
        self.device, self.dtype, self.max_context_arg = device, dtype, max_context
        self.api_key, self.queue_timeout = api_key, queue_timeout
        self.max_body_arg, self.body_timeout = max_body_bytes, body_timeout
        # Set on SIGTERM/Ctrl-C (serve) or when the app stops: streams send their final event, waiting and running
        # non-streamed requests are answered 503, so the server drains in seconds.
        self.stopping = StopFlag()
        self.prompt_slot: asyncio.Semaphore | None = None  # one prompt rendered/tokenized at a time (jobs.py)
        self.metrics = Metrics()
        self.limits = limits or ServeLimits()
        self.gate = ConnectionGate(self.limits, self.metrics)  # counts only under serve's protocol (limits.py)
        self.waiting = 0  # requests queued for the engine and not yet started (jobs.start_job; --max-queue)
        self.loaded: LoadedModel | None = None
        self.worker: EngineWorker | None = None
        self.load_error: str | None = None
        self.on_load_failure = None  # serve() sets this to stop uvicorn
        self.ready = threading.Event()
        # Filled in by load(): what the routes need to render prompts and check requests.
        self.tool_style = "injected"
        self.stop_ids: tuple[int, ...] = ()
        self.vocab_size = 0
        self.max_token_chars = 0  # the longest token's text: a prompt longer than window x this cannot fit (jobs.py)
        self.decoding = ""  # plain or speculative, lossless or not (Engine.describe_decoding), once loaded
        self.decoding_note = ""  # why the shipped drafter was left out on this CPU, if it was
        self.on_ready = None  # called with the state once the model is ready (serve prints the ready line)

    # -- loading (background thread) --
    def load(self) -> None:
        try:
            if self._engine_kind() == "llama.cpp":
                loaded, engine = self._load_llamacpp()
            else:
                loaded, engine = self._load_torch()
            self.loaded, self.tool_style = loaded, chat.tool_style(loaded.tokenizer)
            if loaded.model is None:
                self.stop_ids = chat.stop_token_ids(loaded.tokenizer, loaded.generation_config)
                self.vocab_size = loaded.vocab_size
            else:
                self.stop_ids = chat.stop_token_ids(loaded.tokenizer, getattr(loaded.model, "generation_config", None))
                self.vocab_size = loaded.model.get_input_embeddings().weight.shape[0]
            self.max_token_chars = max(map(len, loaded.tokenizer.get_vocab()), default=0)
            self.worker = EngineWorker(engine, self.metrics)
            release_freed_memory()  # what loading freed (conversion, casts): ~10 MB from the embedded model's cache
            if hasattr(engine, "mark_ready"):  # the torch engine (llama.cpp's runtime captures nothing of ours)
                self.metrics.watch_captures(engine.captures)
                engine.mark_ready()  # captures and compilations from now on are counted and logged (debug)
            self.metrics.model_ready.set(1)
            self.ready.set()
            self.decoding = engine.describe_decoding() + self.decoding_note
            log.info("model %s ready on %s (%s, context %d tokens): %s", loaded.name, loaded.device,
                     loaded.dtype, loaded.max_context, self.decoding)
            if self.on_ready:
                self.on_ready(self)
        except Exception as exc:  # noqa: BLE001 - any failure must reach /health and the operator, not kill a thread silently
            self.load_error = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, ModelLoadError):
                log.exception("model loading failed")
            log.error("model loading failed: %s", self.load_error)
            if self.on_load_failure:
                self.on_load_failure()

    def _engine_kind(self) -> str:
        """--cpu-engine: 'torch', 'llama.cpp', or 'auto': llama.cpp's runtime for a GGUF model (the embedded one
        included) on the CPU when it is installed and no drafter folder was named (the drafter is a torch model);
        the torch engine otherwise (a GPU, a Hugging Face folder, an already loaded model)."""
        if self.cpu_engine not in ("auto", "torch", "llama.cpp"):
            raise ModelLoadError(f"--cpu-engine must be auto, torch or llama.cpp, got {self.cpu_engine!r}")
        if self.cpu_engine == "torch" or isinstance(self.model_spec, LoadedModel):
            return "torch"
        from backend.decoding import llamacpp

        if self.cpu_engine == "llama.cpp":
            if not llamacpp.available():
                raise ModelLoadError("--cpu-engine llama.cpp needs the `xllamacpp` wheel: pip install xllamacpp")
            return "llama.cpp"
        if self.drafter_spec not in (None, "", "auto", "none") or not llamacpp.available():
            return "torch"
        return "llama.cpp" if resolve_device(self.device) == "cpu" and gguf_file(self.model_spec) else "torch"

    def _load_llamacpp(self):
        from backend.decoding import llamacpp

        loaded = load_for_gguf_runtime(self.model_spec, self.max_context_arg)
        engine = llamacpp.LlamaCppEngine(loaded.gguf, max_context=loaded.max_context, vocab_size=loaded.vocab_size,
                                         threads=llamacpp.choose_threads(self.threads),
                                         weights=f"{loaded.dtype} weights as the file holds them")
        loaded.dtype = f"{loaded.dtype} (llama.cpp)"
        return loaded, engine

    def _load_torch(self):
        from backend.decoding.engine import Engine  # torch: seconds, after the socket is up

        loaded = self.model_spec if isinstance(self.model_spec, LoadedModel) else load_model(
            self.model_spec, self.device, self.dtype, self.max_context_arg)
        drafter = resolve_drafter(self.drafter_spec, loaded)
        engine = Engine(loaded.model, drafter=drafter, max_context=loaded.max_context)
        if drafter is not None and engine.device.type == "cpu" and self.drafter_spec == "auto":
            plain = Engine(loaded.model, drafter=None, max_context=loaded.max_context)
            pays, why = speculation_pays_on_cpu(engine, plain)
            log.info("speculation on this CPU: %s", why)
            if not pays:
                engine = plain
                self.decoding_note = f"; speculation off: {why}"
            del plain
        if engine.fast and engine.device.type == "cuda":
            # every CUDA graph a request can replay (they do not depend on the context length) and the kernels'
            # compilation, now, while /health says "loading": nothing is captured on the request path
            log.info("warming up the fast path (torch.compile + CUDA graphs; up to a minute)")
            t0 = time.perf_counter()
            graphs = engine.warm_up()
            log.info("warm-up: %d CUDA graphs in %.1f s", graphs, time.perf_counter() - t0)
        return loaded, engine

    @property
    def saturation(self) -> dict:
        """What /health says of the limits: each count beside its cap, and which caps are full."""
        full = [name for name, hit in (("connections", self.gate.saturated),
                                       ("queue", self.waiting >= self.limits.max_queue)) if hit]
        return {"saturated": full,
                "connections": {"served": self.gate.served, "limit": self.limits.max_connections,
                                "overflow": self.gate.overflow},
                "queue": {"waiting": self.waiting, "limit": self.limits.max_queue}}

    @property
    def model_ids(self) -> set[str]:
        """Names a request may use for the loaded model: its id and whatever --model said."""
        ids = {self.loaded.name}
        if isinstance(self.model_spec, str):
            ids.add(self.model_spec)
        return ids


# Tokens a cycle the shipped drafter commits on the CPU (bench/results/spec_embedded_shipped_cpu.json: 2.85 and 2.83;
# issue 43 measured 2.44 on a loaded box). A cycle costs a block verify plus the draft, so speculation cannot pay where
# the verify alone costs this many plain steps.
CPU_DRAFTER_TAU = 2.8


def speculation_pays_on_cpu(engine, plain) -> tuple[bool, str]:
    """The measured rule at load for the torch engine on a CPU with the shipped drafter (--drafter auto): what a
    speculative cycle costs here (draft + verify + rollback, from a short generation's GenerationStats, exact mode)
    against the drafter's tokens per cycle (CPU_DRAFTER_TAU, measured on real prompts; the load-time prompt is too
    short to say) times a step of the plain engine it competes with (`plain`: no drafter, unpadded), both timed on this
    machine now, each after a warm-up. On a CPU whose matmuls cost what their rows cost (fp32 without AMX) speculation loses (issue 43:
    0.32x plain decoding on a loaded 2-core EPYC); with AMX in bf16 a 16-row matmul costs about one row's, and it wins
    (1.86x). An explicitly named drafter is kept: that is the user's choice."""
    from backend.decoding.engine import SamplingParams

    prompt = list(range(1, 33))
    for warm in (True, False):
        list(engine.generate(prompt, SamplingParams(max_tokens=4 if warm else 24)))
        list(plain.generate(prompt, SamplingParams(max_tokens=4 if warm else 9)))  # 8 forwards: the 9th needs none
    spec, base = engine.last_stats, plain.last_stats
    step = base.decode_seconds / max(1, base.generated_tokens - 1)
    if not spec.cycles or step <= 0:
        return True, "nothing measured"
    cycle = (spec.draft_seconds + spec.verify_seconds + spec.rollback_seconds) / spec.cycles
    ratio = cycle / step
    why = (f"a speculative cycle (draft + {engine.drafter.block_size}-token verify) costs {ratio:.1f}x a plain step "
           f"here, the drafter commits ~{CPU_DRAFTER_TAU} tokens a cycle")
    return ratio < CPU_DRAFTER_TAU, why


def resolve_drafter(spec: str | None, loaded: LoadedModel):
    """--drafter auto|none|PATH -> a drafter object or None."""
    if spec in (None, "", "none"):
        return None
    try:
        from backend.dflash import checkpoint as dflash
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("backend.dflash"):
            raise
        if spec == "auto":
            log.info("speculative decoding is not available in this build: plain decoding")
            return None
        raise ModelLoadError(f"--drafter {spec}: this build has no DFlash support (backend/dflash/)") from None
    if spec == "auto":
        spec = dflash.find_shipped_drafter(loaded.name)
        if spec is None:
            log.info("no shipped drafter for %s: plain decoding", loaded.name)
            return None
    try:
        return dflash.load_drafter(spec)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the drafter {spec}: {exc}") from exc
