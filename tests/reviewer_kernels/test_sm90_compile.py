"""The decode step's and verify's kernels compile for the H200 (sm_90) without a GPU: Triton's compiler and the ptxas
its wheel carries build each kernel ahead of time at the 35B-A3B shape's constants, with the switches that are off
by default on (the glue kernels' epilogues), specialised as a launch specialises them (tests/sm90.py). The interpreter
tests check what a kernel computes; this checks that the GPU's compiler accepts it (layouts, shared memory) and that
no thread spills registers to local memory, so that a device session is not the first to find out.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")
from tests.sm90 import CASES, compile_for_h200, ptxas_report, sass_order  # noqa: E402


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_compiles_for_sm90(case):
    """Each kernel builds for sm_90, fits the H200's shared memory (the pipelined loops' stages included) and spills
    nothing; a loop that feeds tensor cores is pipelined (asynchronous copies into shared memory)."""
    module, kernel, constexprs, pointers, warps, stages = CASES[case]
    compiled = compile_for_h200(module, kernel, constexprs, pointers, warps, stages)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx
    assert compiled.metadata.shared <= 227 * 1024
    report = ptxas_report(compiled)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and not any(spills), report
    ttgir = compiled.asm["ttgir"]
    # STAGES 0: a K loop unrolled on purpose (rows_linear); a kernel without a loop has nothing to pipeline
    if "mma" in ptx and constexprs.get("STAGES") != 0 and "scf.for" in ttgir:
        assert "async_copy_global_to_local" in ttgir, f"{case}: its loop is not pipelined"


def loop_tail(order: str) -> tuple[int, str]:
    """(loops, what follows the last one) of a sass_order string, the idle branch-to-self after the exit dropped."""
    body = order[:-1] if order.endswith("<") else order
    return body.count("<"), body[body.rfind("<") + 1:] if "<" in body else body


def test_no_program_of_the_experts_waits_on_a_load_after_its_weight_tiles():
    """Latency a launch pays at its end, found in the SASS (docs/kernels.md): the down kernel loads each row's scale
    before its tiles, so no global load follows its loop; gate_up computes the shared expert's gate without a loop of
    its own after the tiles (eight dependent round trips at the 35B-A3B shape), so the tiles' loop is its only one."""
    order = {name: sass_order(compile_for_h200(*CASES[name]))
             for name in ("experts_down", "experts_gate_up")}
    loops, tail = loop_tail(order["experts_down"])
    assert loops == 1 and "L" not in tail, order["experts_down"]
    loops, tail = loop_tail(order["experts_gate_up"])
    assert loops == 1 and tail.count("L") > 8, order["experts_gate_up"]  # the gate's chunks, loaded after the tiles


def expanded(order: str) -> str:
    """A sass_order string with its runs written out ("L3" -> "LLL")."""
    return re.sub(r"(\D)(\d+)", lambda m: m.group(1) * int(m.group(2)), order)


def test_the_embedded_projections_load_their_epilogue_inputs_before_the_sums():
    """rows_linear's epilogue inputs (the residual; each row's position, then its cos / sin rows) are read before the
    K loop: the o-projection (one split) has no global load after the last barrier of its K steps (Triton may unroll
    its 3 steps, so there need be no loop), and the q/k/v projection's last split reads only the partial sums (2
    accumulators and the norm's sum of squares a split) after its atomic; both used to end in dependent round trips
    (found by bench/sass_order.py)."""
    o = sass_order(compile_for_h200(*CASES["rows_linear_o_residual"]))
    assert "M" in o and "L" not in o[o.rfind("B"):], o
    qkv = expanded(sass_order(compile_for_h200(*CASES["rows_linear_qkv_rope"])))
    finisher = qkv[qkv.find("X") + 1:]  # the programs that are not the last of their tile exit first
    assert finisher.count("L") == 3 * CASES["rows_linear_qkv_rope"][2]["SPLITS"], qkv
