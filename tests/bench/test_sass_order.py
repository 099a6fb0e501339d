"""bench/sass_order.py: a kernel built for sm_90 without a GPU, read back from its machine code (a real subprocess of
the script, Triton's own ptxas and nvdisasm)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_kernels_resources_and_instruction_order_are_written(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "sass.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "sass_order.py"), "experts_down:BN=32", "--out",
                          str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(out.read_text())
    row, = record["rows"]
    assert record["benchmark"] == "sass_order" and "no GPU" in record["machine"]
    assert row["constexprs"]["BN"] == 32 and row["spill_bytes"] == 0 and row["mma"] == "mma.sync"
    assert row["pipelined"] and "<" in row["order"] and "M" in row["order"] and "experts_down" in run.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "sass_order.py"), "no_such_kernel"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "no case 'no_such_kernel'" in bad.stderr and "Traceback" not in bad.stderr
