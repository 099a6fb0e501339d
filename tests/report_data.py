"""A review history written through reviewer/store/db.py and reviewer/store/lifecycle.py, for the report tests.

Four commits of one repository reviewed by `smoke` and `performance`: a test failure that persists, an install
problem that is fixed at the third commit, a README finding that regresses; `import_seconds` measured 5 times per commit
with 3% jitter and a 30% slow-down at the third commit; one repository more with a single run.
"""

from __future__ import annotations

import json
import random

from reviewer.store import db
from reviewer.store.lifecycle import assign_states

REPO = "file:///srv/git/tinystats"
OTHER = "https://example.org/other.git"
COMMITS = ["a1b2c3d4e5f6a7b8", "b2c3d4e5f6a7b8c9", "c3d4e5f6a7b8c9d0", "d4e5f6a7b8c9d0e1"]


def fill(path: str) -> dict[str, list[int]]:
    rng = random.Random(42)
    run_ids: dict[str, list[int]] = {REPO: [], OTHER: []}
    with db.session(path) as s:
        repo = db.get_or_create_repository(s, REPO)
        for i, commit in enumerate(COMMITS):
            run = db.ReviewRun(repository_id=repo.id, commit_sha=commit, ref="main", status="completed",
                               llm="http://127.0.0.1:8000/v1", model="smollm2")
            s.add(run)
            s.flush()
            for persona in ("smoke", "performance"):
                s.add(db.PersonaRun(run_id=run.id, persona=persona, status="completed", steps=3 + i,
                                    prompt_tokens=1000, completion_tokens=200))
            s.flush()
            s.add(db.Finding(run_id=run.id, persona="smoke", title=f"{1 + i % 2} tests failed", severity="high",
                             category="tests", details="FAILED tests/test_core.py::test_percentile_unsorted\n<b>x</b>",
                             repro_command="python -m pytest -q", file="tests/test_core.py", verified=True,
                             verification="exit code 1 after 0.4 s (reproduces)"))
            if i < 2:
                s.add(db.Finding(run_id=run.id, persona="smoke", title="install takes over a minute", severity="low",
                                 category="install", verified=None))
            if i in (0, 3):
                s.add(db.Finding(run_id=run.id, persona="performance", title="README claims moving_average is linear",
                                 severity="medium", category="docs", file="README.md",
                                 repro_command="python -c 'import sys; sys.exit(0)'", verified=False,
                                 verification="exit code 0 after 0.1 s (did not reproduce)"))
            base = 1.30 if i >= 2 else 1.0
            samples = [round(base * rng.uniform(0.97, 1.03), 4) for _ in range(5)]
            s.add(db.Measurement(run_id=run.id, persona="performance", name="import_seconds",
                                 value=sorted(samples)[2], unit="s", repeats=5, samples=json.dumps(samples),
                                 command="python -c 'import tinystats'"))
            install = [round(20 * rng.uniform(0.97, 1.03), 3) for _ in range(3)]
            s.add(db.Measurement(run_id=run.id, persona="smoke", name="install_seconds", value=sorted(install)[1],
                                 unit="s", repeats=3, samples=json.dumps(install)))
            s.flush()
            assign_states(s, run.id)
            run_ids[REPO].append(run.id)
        other = db.get_or_create_repository(s, OTHER)
        run = db.ReviewRun(repository_id=other.id, commit_sha="ffff0000", status="failed", error="clone failed")
        s.add(run)
        s.flush()
        run_ids[OTHER].append(run.id)
        s.commit()
    return run_ids
