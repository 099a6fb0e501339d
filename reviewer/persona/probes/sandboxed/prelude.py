"""Helpers every sandboxed check shares: the result line, import by name, time limit, consuming results, growing
literals, log-log slope. Standard library only; Python 3.8+; nothing here imports reviewer (see __init__.py).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import json
import math
import os
import signal
import sys

RESULT_MARK = "@@reviewer-probe@@"  # starts the one line a check prints for the host (runner.result_line reads it)


def emit(obj):
    """The result line the probe reads (the project's own output may come before it)."""
    sys.__stdout__.write(RESULT_MARK + " " + json.dumps(obj, default=repr) + "\n")
    sys.__stdout__.flush()


def resolve(target):
    """'pkg.sub.name' -> the object, as `from pkg.sub import name` finds it: an attribute first, else a submodule."""
    parts = target.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i]))
    return obj


def held_builtin(func):
    """A method of a built-in object the project only holds, as `UNCOUNTABLES.add` of a module-level set (seen on
    inflection): the interpreter's code, not the project's, and calling it changes the project's state for the calls
    after it."""
    owner = getattr(func, "__self__", None)
    return (type(func).__name__ in ("builtin_function_or_method", "method-wrapper") and owner is not None
            and not isinstance(owner, type(sys)) and type(owner).__module__ == "builtins")


def internal(func, target, doc_named):
    """A function of the project's internals: neither exported by the package at its top level (itself, or the class
    of a method) nor listed in its module's `__all__`, and not named by the docs (`doc_named`, decided on the host).
    Its tests call it with what its callers inside the project pass (natsort's `compat.fake_fastnumbers.fast_float`,
    a stand-in for an optional dependency, "natsort is controlling what is passed to this function"): an edge input
    or a size of our own is outside its contract."""
    name = getattr(func, "__name__", None)
    qualname = getattr(func, "__qualname__", None) or name
    if doc_named or not isinstance(name, str) or not isinstance(qualname, str):
        return False
    owner = qualname.split(".")[0]  # the function itself, or the class of a method
    top = importlib.import_module(target.split(".")[0])
    exported = getattr(top, owner, None)
    if exported is not None and (exported is func or "." in qualname):
        return False
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    return owner not in (getattr(module, "__all__", None) or ())


def target_of(target, doc_named):
    """A probe's function by name, and why the probe leaves it alone (None: it probes it) and where it is defined:
    (func, skipped, [file relative to the working directory, line] or [None, None])."""
    func = resolve(target)
    if held_builtin(func):
        return func, "a method of a built-in object, not the project's code", [None, None]
    if internal(func, target, doc_named):
        return func, "the project's internals: not exported, not in the docs", [None, None]
    try:
        where = [os.path.relpath(inspect.getsourcefile(func)), inspect.getsourcelines(func)[1]]
    except Exception:  # noqa: BLE001 - a builtin or a generated function has no source to point at
        where = [None, None]
    return func, None, where


class Overtime(BaseException):
    """A call ran past its limit (a BaseException, so the project's `except Exception` does not swallow it)."""


@contextlib.contextmanager
def limit(seconds):
    """SIGALRM after `seconds`: interrupts Python code at once and C code when it returns (the sandbox's timeout on
    the whole script backs this up)."""
    def on_alarm(signum, frame):
        raise Overtime()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def quiet():
    """The project's own prints go nowhere while it is called (they would bury the result line)."""
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


def consume(result, cap):
    """Materialize what a call returned, the way a caller would use it, and say how big it is: (elements, capped).
    Iterators are drained (at most `cap` items; an infinite one comes back capped), one level of nesting counted, so
    that all windows of a sequence weigh n^2 while a list of n numbers weighs n."""
    sized = (str, bytes, bytearray, list, tuple, dict, set, frozenset, range)
    if isinstance(result, (str, bytes, bytearray)):
        return len(result), False
    if not (isinstance(result, sized) or hasattr(result, "__next__")):
        return (len(result) if hasattr(result, "__len__") else 1), False
    size, count = 0, 0
    for item in itertools.islice(result, cap + 1):
        count += 1
        if count > cap:
            return size, True
        if hasattr(item, "__next__"):  # groupby's groups, ichunked's chunks
            item = list(itertools.islice(item, cap))
        size += max(1, len(item)) if isinstance(item, sized) else 1
    return size, False


def grow(lit, f):
    """The literal a test or the docs used, about f times as long, cycling its elements (so the values stay the kind
    the function expects)."""
    n = max(1, round(len(lit) * f))
    if isinstance(lit, (str, bytes)):
        return (lit * (n // len(lit) + 1))[:n]
    items = [lit[i % len(lit)] for i in range(n)]
    return tuple(items) if isinstance(lit, tuple) else items


def scale(value, f):
    """An integer argument f times as large (at least 1)."""
    return max(1, round(value * f))


def slope(xs, ys):
    """Least-squares slope of log(y) against log(x): the exponent b in y ~ x^b."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-12)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else 0.0


def exception_line(e):
    """`Type: first line of the message`, as a finding shows an exception."""
    text = str(e).strip().splitlines()
    return type(e).__name__ + (": " + text[0][:300] if text else "")
