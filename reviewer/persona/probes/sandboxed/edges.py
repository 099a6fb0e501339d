"""Edge inputs, tried inside the sandbox: a function called with its arguments swapped for empty, zero, negative or
non-ASCII ones, and a console script run on an empty and a malformed file (what is a crash and what is not, and the
host half: reviewer/persona/probes/edge_inputs.py)."""

from __future__ import annotations

import builtins
import inspect
import os
import re
import tempfile
import traceback

from .commands import run_cli
from .prelude import consume, emit, exception_line, limit, quiet, target_of


def check(target, doc_named, base, cases, doc_text, limit_s, rules):
    """The check script's entry for one function: `base` is (args, kwargs) of the documented call, `cases` are
    (label, kind, build() -> (args, kwargs)), `rules` the contracts that excuse an exception (patterns and names);
    exit 1 when one case crashes."""
    func, skipped, where = target_of(target, doc_named)
    if skipped:
        emit({"crashes": [], "skipped": skipped})
        return 0
    doc = (inspect.getdoc(func) or "") + "\n" + doc_text
    try:
        with quiet(), limit(limit_s):
            consume(func(*base[0], **base[1]), 10000)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        emit({"baseline": exception_line(e)})  # our copy of the documented call fails: judge nothing
        return 0
    crashes = []
    for label, kind, build in cases:
        try:
            a, k = build()
            with quiet(), limit(limit_s):
                consume(func(*a, **k), 10000)
        except BaseException as e:  # noqa: BLE001 - what it raises is judged by the rules
            if isinstance(e, KeyboardInterrupt):
                raise
            if crashed(e, kind, doc, rules):
                lines = traceback.format_exception(type(e), e, e.__traceback__)
                crashes.append({"case": label, "kind": kind, "error": exception_line(e),
                                "traceback": "".join(lines[-6:])[-2000:]})
    emit({"crashes": crashes, "where": where})
    return 1 if crashes else 0


def crashed(e, kind, doc, rules):
    """Is the exception a crash: one that says the code did not expect the input, and that no contract excuses?"""
    name = type(e).__name__
    crash_types = tuple(getattr(builtins, n) for n in rules["crashes"])
    if type(e) not in crash_types or name in rules["expected"] or re.search(r"\b%s\b" % name, doc):
        return False
    if (kind == "empty" and (re.search(rules["non_empty"], doc) or (rules["fit"] and re.search(rules["fit"], doc)))) \
            or (kind in ("zero", "negative") and re.search(rules["positive"], doc)):
        return False
    if kind == "empty" and isinstance(e, IndexError) and re.search(rules["element"], doc):
        return False  # it returns an element, and an empty sequence has none
    if kind == "zero" and isinstance(e, ZeroDivisionError) and re.search(rules["division"], doc):
        return False  # it divides, by the zero we passed: Python's contract for `/`
    if isinstance(e, KeyError) and e.args and e.args[0] in ("", rules["non_ascii"]):
        return False  # it looked up the key we passed (`key=''`), which is not there: a lookup, not a crash
    return True


def check_files(argv, index, ext, cases, timeout):
    """The check script's entry for one documented command: argument `index` replaced by a file of each case's
    content; exit 1 when one of them ends in a traceback."""
    tmp = tempfile.mkdtemp()
    crashes = []
    for label, content in cases:
        path = os.path.join(tmp, "input" + ext)
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
        code, out, err = run_cli([path if i == index else a for i, a in enumerate(argv)], timeout)
        if "Traceback (most recent call last)" in out + err:
            last = [ln for ln in (out + err).strip().splitlines() if ln.strip()][-1]
            crashes.append({"case": label, "error": last[:300], "output": (out + err)[-1500:]})
    emit({"crashes": crashes})
    return 1 if crashes else 0
