"""What the decode step's and verify's kernels make a GPU thread wait for, read from their sm_90 machine code without a
GPU (not a timing: a map of where latency can hide).

Each kernel of tests/sm90.py's CASES is built as a launch at the Qwen3.6-35B-A3B shape builds it (aligned pointers,
integers divisible by 16), then disassembled with the nvdisasm in Triton's wheel. Per kernel: registers, spill bytes,
shared memory, tensor-core kind, whether a loop is pipelined, and the order of the instructions that matter for
latency, one letter each:

    L global load   s shared load   S shuffle   W global store or atomic   B barrier   M MMA   X exit
    < branch back (a loop)   > branch forward        runs of three or more: letter and count (L22)

A thread issues in order and waits at the first instruction that reads a load still in flight. So a global load that
comes after a loop's `<` and feeds the last store is a round trip every program pays at its end. A loop of `L...S`
without pipelining waits for each iteration's loads in turn. On 2026-12-05 this reading found four such tails
(docs/kernels.md: the experts' shared gate and down scales, the recurrence's prefetch, the combine's gate; the
recurrence's fix was reverted after it proved nondeterministic on a GPU).

    python bench/sass_order.py                          # every case
    python bench/sass_order.py experts_gate_up:DIRECT=True:BN=16 --out bench/results/sass_order.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from tests.sm90 import CASES, compile_for_h200, ptxas_report, sass_order  # noqa: E402


def parse_case(text: str) -> tuple[str, dict]:
    """'name:KEY=VALUE:...' -> (name, constexpr overrides); warps= and stages= set the launch."""
    name, *pairs = text.split(":")
    if name not in CASES:
        raise SystemExit(f"sass_order.py: no case {name!r}; the cases: {', '.join(sorted(CASES))}")
    values = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        values[key] = value == "True" if value in ("True", "False") else int(value) if value.lstrip("-").isdigit() \
            else value
    return name, values


def describe(name: str, overrides: dict) -> dict:
    module, kernel, constexprs, pointers, warps, stages = CASES[name]
    warps, stages = overrides.pop("warps", warps), overrides.pop("stages", stages)
    compiled = compile_for_h200(module, kernel, {**constexprs, **overrides}, pointers, warps, stages)
    report = ptxas_report(compiled)
    ptx = compiled.asm["ptx"]
    registers = re.search(r"Used (\d+) registers", report)
    return {"case": name, "kernel": f"{module}.{kernel}", "constexprs": {**constexprs, **overrides}, "warps": warps,
            "stages": stages, "registers": int(registers.group(1)) if registers else None,
            "spill_bytes": sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report)),
            "shared_bytes": compiled.metadata.shared,
            "mma": "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else None,
            "pipelined": "async_copy_global_to_local" in compiled.asm["ttgir"], "order": sass_order(compiled)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="CASE[:NAME=VALUE...] (constexprs, warps=, stages=); default: all")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as a JSON record here")
    args = ap.parse_args()
    rows = [describe(*parse_case(c)) for c in (args.cases or sorted(CASES))]
    for r in rows:
        print(f"{r['case']}: {r['registers']} registers, {r['spill_bytes']} B spilled, {r['shared_bytes']} B shared, "
              f"{r['mma'] or 'no MMA'}{', pipelined' if r['pipelined'] else ''}\n  {r['order']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "benchmark": "sass_order", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "command": "python bench/sass_order.py " + " ".join(sys.argv[1:]), "triton": triton.__version__,
            "machine": "no GPU: sm_90 builds, Triton's own ptxas and nvdisasm", "rows": rows}, indent=1) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
