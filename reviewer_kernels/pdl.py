"""Programmatic dependent launch (PDL; Hopper and later) for the kernels of a decode step or verify.

    @triton.jit
    def _kernel(..., PDL: tl.constexpr):
        pdl_entry(PDL)                        # first statement: no load or store before it
        ...
    _kernel[grid](..., **pdl_kwargs(x))      # PDL=True and launch_pdl=True where use_pdl(x)

Why: a decode step of the 35B-A3B shape is ~400-560 kernels in a CUDA graph, most of them a few microseconds long
(bench/results/step_budget_*.json), and each boundary between two of them costs the next kernel's launch and ramp
while the GPU drains the previous one. A kernel launched with PDL may be scheduled as soon as every program of the
kernel before it has signalled (`gdc_launch_dependents`, here at their entry), so its launch overlaps the previous
kernel's run; it then waits (`gdc_wait`) until that kernel has finished and its writes are visible before it touches
memory. Because the wait comes before every load and store, nothing a kernel computes changes: only when it starts.
A kernel launched without the attribute (cuBLAS, torch's) keeps the ordinary stream order, and a kernel after it
launched with the attribute simply starts when it ends.

Off (PDL = False) until timed on a GPU: written on 2026-12-04 in a session without one; bench/step_budget.py --pdl
on / off in one call decides it. Triton's CPU interpreter cannot run the wait, so use_pdl is False there.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one without grid dependency control
    gdc_wait = gdc_launch_dependents = None

PDL = False
pdl_entry = None  # a Triton function where Triton is installed

if triton is not None:
    if gdc_wait is not None:
        @triton.jit
        def pdl_entry(PDL: tl.constexpr):
            """Wait for the kernel before this one (it finished, its writes visible), then let the next one launch."""
            if PDL:
                gdc_wait()
                gdc_launch_dependents()
    else:
        @triton.jit
        def pdl_entry(PDL: tl.constexpr):
            """No grid dependency control in this Triton: use_pdl is always False."""
            pass


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with PDL: the switch, a CUDA device of compute capability 9.0 or later,
    and a Triton with grid dependency control."""
    if not (PDL and gdc_wait is not None and x.is_cuda):
        return False
    return _hopper(x.device.index if x.device.index is not None else torch.cuda.current_device())


def pdl_kwargs(x: torch.Tensor) -> dict:
    """The launch arguments of a kernel that starts with pdl_entry(PDL), for tensors on x's device."""
    on = use_pdl(x)
    return {"PDL": on, "launch_pdl": on}
