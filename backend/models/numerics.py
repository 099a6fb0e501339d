"""Which kernels a fast model's decode steps and verifies run, and why: one frozen record, `Numerics`, resolved once
from an engine's arguments and its device (`resolve_numerics`, called by backend/decoding/engine.py) and handed to the
fast model when it is built (`load_fast(..., numerics=...)` -> `FastModel` -> the model's `setup_caches`), which reads
it. Nothing changes it afterwards; a benchmark that wants other kernels builds its own record.

Kinds:
  invariant     batch-invariant rows on the GPU: a position's logits are bitwise the same from a decode step and from
                inside a verify block of any size (Qwen3.5/3.6-MoE: `_padded_rows`; Llama: `_rows` with every
                projection on tensor cores, or the compiled glue over cuBLAS on 16 padded rows). The default of every
                CUDA engine on the fast path, plain or speculative, so `--drafter none` and a drafter give the same text
  exact         padded blocks (backend/decoding/target.py): every forward has 16 rows and attends over multiples of
                512 columns; the default of a CPU engine with a drafter
  one_token     the model's own one-token path (Triton's one-token kernels where Triton runs, eager PyTorch elsewhere):
                a plain CPU engine, and on the GPU only where asked (invariant_verify=False: benchmarks)
  transformers  no fast path

Imports nothing of the project: backend/decoding and the model files read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("invariant", "exact", "one_token", "transformers")
# every projection Llama._rows can put on reviewer_kernels/rows_linear.py
MMA_PROJECTIONS = frozenset({"qkv", "o", "gate_up", "down", "lm_head"})
# Qwen35Moe._padded_rows' dense projections reviewer_kernels/wide_linear.py can take
WIDE_PROJECTIONS = frozenset({"in", "out"})
EXACT_SPAN = 512  # exact mode: attention spans are multiples of this (the CPU flash kernel's kv block)
LLAMA_INVARIANT_PATHS = ("mma", "glue")
# How a Llama's steps and verifies run in the invariant numerics:
#   "mma":  _rows with every projection through reviewer_kernels/rows_linear.py (tensor cores, the same instructions for
#           1 and 16 rows), so plain steps and verifies cost about the same
#   "glue": the compiled glue + cuBLAS on 16 padded rows (_padded_glue) where cuBLAS is row-invariant, else _rows
# "mma" by default: on the H200 the embedded model's speculative engine decoded 2240 tok/s on it against 2142 on
# "glue" (verify 1.00 against 1.08 ms), and its plain decoding in those numerics 1085 against 1022 tok/s
# (bench/results/spec_e2e_embedded_h200_20261202_drafter_kernel_{glue,mma}.json, 16/16 identical on both).
LLAMA_INVARIANT_PATH = "mma"
# Qwen3.5/3.6-MoE's padded steps: their glue in our Triton kernels instead of the compiled glue (QwenNumerics.
# glue_kernels: one launch for an attention layer's q/k norms, RoPE and cache write, the output gate inside the
# attention's combine kernel, the Gated DeltaNet's gated norm in norms.py's kernel, each layer's pre-norm and the final
# norm inside the MoE's slot sum: ~150 launches fewer a decode step at the 35B-A3B shape). Off until timed on a GPU
# (written 2026-12-04 in a session without one, checked under Triton's interpreter only): bench/step_budget.py
# --glue-kernels and the replay with this set to True decide it (docs/kernels.md "The padded steps' glue in kernels").
QWEN_GLUE_KERNELS = False
# Qwen3.5/3.6-MoE's padded steps' experts (QwenNumerics.experts), each batch-invariant: the choice is cost. What each
# asks of reviewer_kernels/fused_moe.py (None: fused_moe.invariant_config, the device's tuned grouped tiles):
#   "tuned":       the grouped GEMM tiles; a decode step's experts take 1.32x the one-token kernels' (30.9 against
#                  23.4 us a layer with the H100's entry, 2026-12-07)
#   "gemv":        the one-token programs for every token count, a token axis on their grids (gemv_tokens): the step's
#                  experts at one-token cost, a verify's at 16 one-token calls', every expert a token shares re-read
#   "gemv_blocks": the same programs' arithmetic with each expert's rows read once a call (moe_decode.blocks_moe:
#                  slots sorted by expert from 2 tokens, direct blocks below)
# "tuned" until a GPU times the others (bench/step_budget.py --experts, the replay).
QWEN_EXPERTS = {"tuned": None, "gemv": {"gemv_tokens": 16}, "gemv_blocks": {"gemv_tokens": 16, "gemv_sorted_from": 2}}


@dataclass(frozen=True)
class LlamaNumerics:
    """How backend/models/llama.py runs decode steps and verify blocks (T <= 16) where Triton runs.

    step_path "rows": _rows' kernels, batch-invariant by construction; "glue": forward()'s compiled glue with cuBLAS
    projections on 16 padded rows (_padded_glue), batch-invariant where cuBLAS computes a row independently of its
    neighbours, which the model checks on its device at setup (backend/models/cublas_rows.py; where it fails, steps
    take "rows"). mma_projections: which of _rows' projections take reviewer_kernels/rows_linear.py (tensor cores: 16
    rows cost what one does) instead of reviewer_kernels/norm_gemv.py / reviewer_kernels/gemv.py (CUDA cores: cheapest
    for one row). Any set keeps batch invariance. None outside the invariant numerics: on the H200 (SmolLM2 shape,
    2026-12-01, bench/target_step.py --mma) every set costs plain decoding more than 1.15x (none 0.59 ms, qkv+o+lm_head
    0.74, all 0.93 with T_t(16) 1.15 ms flat). Where mma_projections are asked for and _rows cannot run the model
    (biases, partial RoPE; no Triton), the model takes "glue": the batch-invariant path left."""

    step_path: str = "rows"
    mma_projections: frozenset = frozenset()

    def __post_init__(self):
        if self.step_path not in ("rows", "glue"):
            raise ValueError(f"step_path must be 'rows' or 'glue', got {self.step_path!r}")
        object.__setattr__(self, "mma_projections", frozenset(self.mma_projections))
        if self.mma_projections - MMA_PROJECTIONS:
            raise ValueError(f"mma_projections must be drawn from {sorted(MMA_PROJECTIONS)}, got "
                             f"{sorted(self.mma_projections)}")


def llama_invariant(path: str) -> LlamaNumerics:
    """The Llama record of the invariant numerics for `path` ("mma" or "glue": see LLAMA_INVARIANT_PATH)."""
    if path not in LLAMA_INVARIANT_PATHS:
        raise ValueError(f"llama_invariant must be 'glue' or 'mma', got {path!r}")
    return LlamaNumerics("rows", MMA_PROJECTIONS) if path == "mma" else LlamaNumerics("glue")


@dataclass(frozen=True)
class QwenNumerics:
    """How backend/models/qwen3_5_moe.py runs decode steps and verify blocks. padded_rows: through _padded_rows
    (every glue call on 16 padded rows, the experts on one tile set: batch-invariant; a plain step costs ~1.2x the
    one-token kernels, bench/target_step.py --invariant). wide_projections: which of _padded_rows' dense projections
    ("in": the mixers' input projections, "out": their output projections) run reviewer_kernels/wide_linear.py instead
    of cuBLAS (bench/target_step.py --wide measures a set). "in" is no faster than cuBLAS at the 35B-A3B shape (15.2 vs
    15.5 us, 12.2 vs 11.8: reviewer_kernels/README.md). glue_kernels: _padded_rows' glue in our kernels instead of
    the compiled glue (QWEN_GLUE_KERNELS says which); batch-invariant either way. experts: _padded_rows' experts on
    the device's tuned grouped tiles ("tuned", fused_moe.invariant_config), or every token through the one-token
    kernels' arithmetic ("gemv", "gemv_blocks": QWEN_EXPERTS; invariant too, each token runs the same programs
    whatever the token count; untimed, so not the default)."""

    padded_rows: bool = False
    wide_projections: frozenset = frozenset({"out"})
    glue_kernels: bool = QWEN_GLUE_KERNELS
    experts: str = "tuned"

    def __post_init__(self):
        object.__setattr__(self, "wide_projections", frozenset(self.wide_projections))
        if self.wide_projections - WIDE_PROJECTIONS:
            raise ValueError(f"wide_projections must be drawn from {sorted(WIDE_PROJECTIONS)}, got "
                             f"{sorted(self.wide_projections)}")
        if self.experts not in QWEN_EXPERTS:
            raise ValueError(f"experts must be one of {', '.join(QWEN_EXPERTS)}, got {self.experts!r}")


@dataclass(frozen=True)
class Numerics:
    """Which kernels run and why (see the module docstring for the kinds). invariant_steps: the model records ask
    for the batch-invariant steps (kind "invariant"; also kind "exact" where invariant_verify=True asked for both).
    compile: the fast path's per-layer glue through torch.compile for decode steps and verifies (False, True, "glue"
    or "full": FastModel's compile). device_cycle: the speculative cycle runs on the device (backend/decoding/
    device_cycle.py: only with a drafter). The default record is a bare fast model's: its one-token path."""

    kind: str = "one_token"
    why: str = "the fast model's defaults (no engine chose): its one-token path"
    llama: LlamaNumerics = field(default_factory=LlamaNumerics)
    qwen: QwenNumerics = field(default_factory=QwenNumerics)
    invariant_steps: bool = False
    compile: bool | str = False
    device_cycle: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def fast(self) -> bool:
        return self.kind != "transformers"

    @property
    def exact(self) -> bool:
        return self.kind == "exact"

    @property
    def lossless_because(self) -> str:
        """What the ready line names as the reason a lossless speculative engine is lossless (Engine.lossless says
        whether it is: off exact mode, whether the model's kernels turned out batch-invariant on this device)."""
        return "exact mode" if self.exact else "batch-invariant kernels"

    def describe(self) -> str:
        """One line for the log: the kind and why."""
        return f"{self.kind} numerics: {self.why}"


def invariant_numerics(why: str, llama_path: str = LLAMA_INVARIANT_PATH, *, compile: bool | str = False,
                       device_cycle: bool = False) -> Numerics:
    """The invariant record outside an engine (benchmarks, tests): Qwen's padded rows, Llama's `llama_path`."""
    return Numerics("invariant", why, llama_invariant(llama_path), QwenNumerics(padded_rows=True), True, compile,
                    device_cycle)


def resolve_numerics(device: str, *, drafter: bool, fast_path: bool, fast: bool | None = None,
                     exact: bool | None = None, compile: bool | str | None = None, device_cycle: bool | None = None,
                     invariant_verify: bool | None = None, llama_invariant_path: str = LLAMA_INVARIANT_PATH) -> Numerics:
    """The engine's numerics from its arguments (Engine's docstring says what each means; None: the default for this
    device), `device` (a torch device type), whether it has a drafter and whether the fast path covers the model
    (fast_path: its architecture is covered and, when this is called again after a failed load, it loaded).
    Raises ValueError for fast=True without a fast path and for a device cycle outside the fast path's non-exact
    numerics."""
    llama = llama_invariant(llama_invariant_path)  # checked whatever the kind: a bad value is a mistake
    if fast and not fast_path:
        raise ValueError("no fast path for this architecture (fast=True)")
    on_fast = fast is not False and fast_path
    cuda = device == "cuda"
    exact_on = on_fast and bool(device == "cpu" and drafter if exact is None else exact)
    gpu_default = cuda and on_fast and not exact_on
    invariant = on_fast and bool(gpu_default if invariant_verify is None else invariant_verify)
    cycle = gpu_default if device_cycle is None else bool(device_cycle)
    if cycle and not (on_fast and not exact_on):
        raise ValueError("the device cycle needs the fast path outside exact mode")
    if not on_fast:
        why = "fast=False" if fast is False else "no fast path for this architecture"
        return Numerics("transformers", f"{why}: transformers' forwards, unpadded")
    kind = "exact" if exact_on else "invariant" if invariant else "one_token"
    return Numerics(kind, _why(kind, device, drafter, exact, invariant_verify, llama_invariant_path),
                    llama if invariant else LlamaNumerics(), QwenNumerics(padded_rows=invariant), invariant,
                    cuda if compile is None else compile, cycle and drafter)


def _why(kind: str, device: str, drafter: bool, exact: bool | None, invariant_verify: bool | None,
         llama_path: str) -> str:
    """Numerics.why: which argument (or which default) chose the kind, and what it means."""
    if kind == "exact":
        who = "exact=True" if exact else f"a {device.upper()} engine with a drafter"
        also = " (and invariant_verify=True: the invariant model records too)" if invariant_verify else ""
        return (f"{who}: exact mode, every forward padded to 16 rows, so greedy speculative output equals plain "
                f"decoding in exact mode{also}")
    if kind == "invariant":
        who = "invariant_verify=True" if invariant_verify else "a CUDA engine on the fast path"
        return (f"{who}: batch-invariant decode steps and verifies (Qwen3.5/3.6-MoE's padded rows, Llama's "
                f"{'tensor-core rows' if llama_path == 'mma' else 'compiled glue over cuBLAS'}), with a drafter or "
                "without")
    if invariant_verify is False and device == "cuda":
        return "invariant_verify=False: the one-token kernels of earlier versions (benchmarks)"
    who = "exact=False" if exact is False and drafter else f"a {'plain ' if not drafter else ''}{device.upper()} engine"
    return f"{who}: the model's one-token path for decode steps, unpadded verifies"
