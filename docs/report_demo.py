"""Make the report shown in docs/report.md from real reviews: `reviewer loop --once` (smoke persona, no LLM) over the
example project at five commits, then the HTML report and a headless-Chromium screenshot of it.

    .venv/bin/python docs/report_demo.py build/report-demo      # ~2 minutes on 2 cores

Commits: 1 the project as shipped (one failing test); 2 a README edit; 3 the percentile bug fixed, but the package now
sleeps 20 ms on import; 4 the bug back; 5 the import fixed. Expected: the test failure new, persisting, fixed,
regressed; import time flagged at commits 3 and 5 and nowhere else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from reviewer.config import load_settings
from reviewer.examples import git, make_example_repo
from reviewer.run.loop import loop_command
from reviewer.report.report import ReportFilter, report_command

BUG = "    rank = round(q / 100 * (len(values) - 1))\n    return values[rank]\n"
FIX = "    rank = round(q / 100 * (len(values) - 1))\n    return sorted(values)[rank]\n"


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("REVIEWER_LOCK_FILE", str(out / "review.lock"))
    repo = make_example_repo(out / "tinystats")
    db_path = out / "reviews.db"
    db_path.unlink(missing_ok=True)
    settings = load_settings(db=str(db_path), personas=["smoke"], workdir=out / "work")
    console = Console(width=120)
    core, init = repo / "tinystats" / "core.py", repo / "tinystats" / "__init__.py"
    steps = [
        None,
        lambda: (repo / "README.md").write_text((repo / "README.md").read_text() + "\nSee CHANGES for news.\n"),
        lambda: (edit(core, BUG, FIX), init.write_text("import time\ntime.sleep(0.02)\n" + init.read_text())),
        lambda: edit(core, FIX, BUG),
        lambda: init.write_text(init.read_text().replace("import time\ntime.sleep(0.02)\n", "")),
    ]
    for number, change in enumerate(steps, start=1):
        if change:
            change()
            git(repo, "commit", "-q", "-am", f"change {number}")
        code = loop_command(settings, repos=[str(repo)], repos_file=None, interval=60, once=True, max_reviews=None,
                            console=console)
        print(f"pass {number}: exit code {code}")
    html = out / "report.html"
    report_command(str(db_path), ReportFilter(), "html", html, console)
    report_command(str(db_path), ReportFilter(), "markdown", out / "report.md", console)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium:
        png = out / "report.png"
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                        f"--user-data-dir={out / 'chromium-profile'}", f"--screenshot={png}",
                        "--window-size=1280,1240", html.resolve().as_uri()], check=True, capture_output=True)
        print(f"screenshot: {png}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "build/report-demo"))
