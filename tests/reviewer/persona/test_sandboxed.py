"""The probes' check scripts stand alone: each carries the sandboxed modules it calls (reviewer/persona/probes/
sandboxed/), writes them outside the project's checkout, and needs nothing of the reviewer to run. Real subprocesses
of the interpreter, with its site-packages (where the reviewer is installed) turned off."""

import re
import subprocess
import sys
from pathlib import Path

from reviewer.persona.probes import runner
from reviewer.persona.probes.docs_examples import examples_script, syntax_script

BARE = [sys.executable, "-I", "-S", "-"]  # no site-packages, no PYTHONPATH, no current folder on sys.path


def run_bare(code: str, cwd: Path, tmp: Path) -> tuple[int, dict | None, str]:
    done = subprocess.run(BARE, input=code, capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp)})
    return done.returncode, runner.result_line(done.stdout), done.stderr


def test_a_check_script_runs_without_the_reviewer_and_leaves_nothing_behind(tmp_path):
    clone, tmp = tmp_path / "repo", tmp_path / "tmp"
    clone.mkdir()
    tmp.mkdir()
    # what the check must do without: the reviewer cannot be imported the way the scripts run here
    assert run_bare("import reviewer\n", clone, tmp)[0] != 0
    block = {"file": "README.md", "line": 3, "doctest": False, "lang": "python", "text": "print(half(4)))\n"}
    code, got, err = run_bare(syntax_script([block]), clone, tmp)
    assert code == 1, err
    assert [(e["line"], e["text"]) for e in got["errors"]] == [(3, "print(half(4)))")]
    assert list(clone.iterdir()) == [] and list(tmp.iterdir()) == []  # the checkout untouched, the modules removed


def test_the_sandboxed_modules_shadow_nothing_of_the_project(tmp_path):
    """A project whose own modules have the names of the sandboxed ones (`examples`, `prelude`): the docs' examples
    import the project's, and the check still finds what is wrong in them."""
    (tmp_path / "examples.py").write_text("def half(x):\n    return x / 2\n")
    (tmp_path / "prelude.py").write_text("WHO = 'the project'\n")
    blocks = [{"file": "README.md", "line": 1, "doctest": True, "lang": "pycon", "setup": False,
               "text": ">>> from examples import half\n>>> half(4)\n3.0\n>>> import prelude\n>>> prelude.WHO\n"
                       "'the project'\n"}]
    done = subprocess.run([sys.executable, "-S", "-"], input=examples_script(blocks, "examples"), capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env={"PATH": "/usr/bin:/bin"})
    got = runner.result_line(done.stdout)
    assert done.returncode == 1, done.stderr
    assert got["checked"] == 4  # the two imports ran (they show no output), the value of prelude.WHO is right
    assert [(o["line"], o["kind"], o["want"], o["got"]) for o in got["outcomes"]] == [(2, "mismatch", "3.0", "2.0")]


def test_a_script_carries_the_modules_its_check_imports_and_no_others():
    assert runner.sandboxed_modules("scaling") == ["prelude", "scaling"]
    assert runner.sandboxed_modules("sessions") == ["commands", "prelude", "sessions"]
    code = syntax_script([])
    carried = [m for m in ("doctests", "examples", "models", "prelude", "syntax")
               if f"'{runner.SANDBOXED_NAME}/{m}.py'" in code]
    assert carried == ["doctests", "prelude", "syntax"]
    assert not re.search(r"^\s*(from|import) reviewer[.\s]", code, re.M)  # the carried modules import none of ours


def _scaling_cfg(**over) -> dict:
    from reviewer.persona.probes import thresholds as t
    cfg = dict(start=t.SCALING_START, max=t.SCALING_MAX, enough=t.SCALING_ENOUGH_S, call_limit=t.SCALING_CALL_LIMIT_S,
               points=t.SCALING_POINTS, repeats=t.SCALING_REPEATS, batch=t.SCALING_BATCH_S, cap=t.OUTPUT_CAP,
               budget=30.0, excess=t.EXCESS_CLAIMED)
    return {**cfg, **over}


def test_scaling_needs_the_cpu_time_to_grow_too_not_only_the_wall_clock():
    """Wall-clock time that grows faster than the work (here a wait of ~n^2 beside linear work; on a shared machine,
    preemption that hits long runs more than short ones) is not a finding: the CPU time's fit must agree."""
    import time

    from reviewer.persona.probes.sandboxed.scaling import measure

    def linear_work_quadratic_wait(xs):
        total = 0
        for x in xs:
            total += x
        time.sleep(len(xs) ** 2 * 1e-11)
        return total

    got = measure(linear_work_quadratic_wait, lambda f: ((list(range(round(256 * f))),), {}), 256, _scaling_cfg())
    assert got["exponent"] > 1.6 and got["exponent_min"] > 1.6, got  # the wall clock alone would flag it
    assert got["exponent_cpu"] < 1.3 and not got["flagged"], got


def test_scaling_still_flags_quadratic_work():
    from reviewer.persona.probes.sandboxed.scaling import measure

    def pairs(xs):
        return sum(1 for a in xs for b in xs if a < b)

    got = measure(pairs, lambda f: ((list(range(round(64 * f))),), {}), 64, _scaling_cfg(start=64))
    assert got["exponent_cpu"] > 1.7 and got["flagged"], got
