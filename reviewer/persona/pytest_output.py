"""Reading pytest's output (pure text work): the summary line's counts, the `-rfE` short summary's failing ids, the
FAILURES/ERRORS sections, where the first failure happened, and which failures say the machine lacks something
rather than the project. smoke.py runs pytest and turns these into findings."""

from __future__ import annotations

import re

# What a test needs from the machine rather than from the project: failures that say this are the review machine's
# (natsort's tests set en_US.UTF-8 and de_DE.UTF-8, which a minimal machine does not have), not failing tests.
MACHINE_LACKS = {"locale": re.compile(r"locale\.Error: unsupported locale setting")}

PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def pytest_counts(output: str) -> dict[str, int]:
    """Counts from pytest's last summary line ('1 failed, 7 passed in 0.05s'); {} if there is none."""
    for line in reversed(output.splitlines()):
        if re.search(r"\bin [\d.]+s\b", line) and (PYTEST_COUNT.search(line) or "no tests ran" in line):
            counts = {}
            for n, what in PYTEST_COUNT.findall(line):
                counts["errors" if what.startswith("error") else what] = int(n)
            return counts
    return {}


def pytest_problems(output: str) -> list[tuple[str, str, str]]:
    """(FAILED|ERROR, test id, message) from pytest's `-rfE` short summary."""
    found = []
    for line in output.splitlines():
        m = re.match(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$", line.strip())
        if m:
            found.append((m.group(1), m.group(2), m.group(3) or ""))
    return found


def failure_location(output: str, test_file: str) -> tuple[str | None, int | None]:
    """Where the first failure happened: the first 'path.py:LINE: Error' traceback line, preferring the test's file."""
    hits = re.findall(r"^([\w./\\-]+\.py):(\d+): \w", output, flags=re.MULTILINE)
    for path, line in hits:
        if path == test_file:
            return path, int(line)
    return (hits[0][0], int(hits[0][1])) if hits else (test_file or None, None)


def failure_sections(output: str) -> dict[str, str]:
    """Each FAILURES/ERRORS section of pytest's output by the name in its heading ('test_x[1]', 'TestA.test_b',
    'ERROR collecting tests/test_c.py')."""
    summary = re.search(r"^=+ short test summary info =+$", output, flags=re.MULTILINE)
    parts = re.split(r"^_+ (?:(?:ERROR|FAILURE) at (?:setup|teardown|call) of )?(.+?) _+$",
                     output[:summary.start()] if summary else output, flags=re.MULTILINE)
    found: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        found.setdefault(name.strip(), body)
    return found


def machine_lacks(sections: dict[str, str], problems: list[tuple[str, str, str]]) -> dict[str, list[str]]:
    """What the machine lacks (MACHINE_LACKS) -> the ids of the failing tests that say so (sections: the output's
    failure_sections)."""
    found: dict[str, list[str]] = {}
    for _, tid, message in problems:
        name = ".".join(tid.split("::")[1:]) if "::" in tid else f"ERROR collecting {tid}"
        text = sections.get(name, "") + "\n" + message
        what = next((w for w, pattern in MACHINE_LACKS.items() if pattern.search(text)), None)
        if what:
            found.setdefault(what, []).append(tid)
    return found


def failures_excerpt(output: str) -> str:
    """The FAILURES/ERRORS section pytest prints, which says what was expected and what came back."""
    start = re.search(r"^=+ (FAILURES|ERRORS) =+$", output, flags=re.MULTILINE)
    end = re.search(r"^=+ short test summary info =+$", output, flags=re.MULTILINE)
    if not start:
        return ""
    return output[start.start(): end.start() if end and end.start() > start.start() else None].strip()
