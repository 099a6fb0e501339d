"""Model-based checks: a class that declares itself a collection is driven with random operation sequences against
the built-in type as its model, and the shortest failing sequence is reported as a runnable repro.

Which classes: the package's public classes (exported at its top, in a module's `__all__`, or named by the docs) that
subclass or register with collections.abc MutableMapping, MutableSet or MutableSequence, or that the docs say work
"like a dict/set/list". The model: a dict, a list, a set; a MutableSet with `index` and `__getitem__` is an ordered
set, kept in insertion order or sorted as the class itself turns out to keep it (a fresh instance given 3, 1, 2), else
compared as a set. Each operation is run on both; a difference in what it returns (a value, an exception or none) or
in the contents afterwards is a failure, shrunk (operations dropped one at a time while it still fails) to the
shortest sequence. Left alone: an operation the class refuses (NotImplementedError, TypeError, AttributeError where
the model works: SortedList has no `append`), a class that cannot be made without arguments, a `__missing__` default
for a key the model lacks (and `get`, `setdefault`, `pop`, which read it), the element a set's `pop()` chooses (any member will do), return values of mutators whose
model returns None (a fluent `add` may return self). Exceptions a method's docstring promises ("Raises:", ":raises
X:", "raises X if ...") are checked when both raise: another type is a finding of its own (low).

The driving runs in sandboxed/models.py; this is the host half: which classes the docs call collections, the scripts,
the findings.
"""

from __future__ import annotations

import re

from reviewer.persona.probes.runner import Probe, command, data, run, script
from reviewer.persona.probes.thresholds import (MODEL_MAX_CLASSES, MODEL_SCRIPT_TIMEOUT, MODEL_SEARCH_S,
                                                MODEL_SEQUENCE_LENGTH, MODEL_TRIALS)
from reviewer.persona.project import EVIDENCE_CHARS
from reviewer.text import tail

# "OrderedSet works like a set", "Box is a dict-like object", "behaves like a regular Python list"
DOC_KIND = re.compile(r"\b(?:like|as)\s+(?:an?\s+)?(?:(?:normal|regular|ordinary|standard|built-?in|python|plain)\s+)*"
                      r"`*(set|list|dict)\b`*(?!\s*(?:of|comprehension))|\b(set|list|dict)-like\b", re.I)


def as_python(var, name, args):
    """One operation as a line of Python a maintainer can paste."""
    shown = ", ".join(repr(a) for a in args)
    return {"pop_at": f"{var}.pop({shown})", "__getitem__": f"{var}[{shown}]", "__len__": f"len({var})",
            "__setitem__": f"{var}[{args[0]!r}] = {args[1]!r}" if len(args) == 2 else "",
            "__delitem__": f"del {var}[{shown}]", "__contains__": f"{args[0]!r} in {var}" if args else ""}.get(
        name, f"{var}.{name}({shown})")


def doc_kinds(sentences: list[tuple[str, int, str]]) -> dict[str, str]:
    """Class names the docs say work like a set, list or dict: a CamelCase name in the sentence that says so."""
    kinds = {}
    for _, _, s in sentences:
        m = DOC_KIND.search(s)
        if not m:
            continue
        for name in re.findall(r"`*\b([A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+|[A-Z][a-z]{2,})\b`*", s[:m.start()]):
            kinds.setdefault(name, (m.group(1) or m.group(2)).lower())
    return kinds


def search() -> dict:
    """How long the search for a failing sequence may go on (thresholds.py)."""
    return {"trials": MODEL_TRIALS, "length": MODEL_SEQUENCE_LENGTH, "seconds": MODEL_SEARCH_S}


def drive_script(target: str, kind: str, ops: list | None = None, modes: tuple[bool, ...] = (False, True)) -> str:
    """The search (both modes: behaviour, promised exceptions), or with `ops` the repro of one failure."""
    return script("models", "check", {"target": repr(target), "kind": repr(kind), "ops": data(ops),
                                      "modes": data(list(modes)), "search": data(search())})


def discover_script(package: str, kinds: dict[str, str]) -> str:
    return script("models", "discover", {"package": repr(package), "doc_kinds": data(kinds)})


def model_name(kind: str) -> str:
    return {"dict": "a dict", "set": "a set", "list": "a list", "orderedset": "a set kept in insertion order (a list "
            "without duplicates)", "orderedset-sorted": "a set kept sorted"}[kind]


def probe_models(probe: Probe) -> None:
    if not probe.package:
        return
    kinds = doc_kinds(probe.sentences())
    got, _, _ = run(probe, "probe: the collection classes of the package", discover_script(probe.package, kinds), 60)
    for target, kind, why in ((got or {}).get("classes") or [])[:MODEL_MAX_CLASSES]:
        driven, _, _ = run(probe, f"probe: {target} against {kind} as its model", drive_script(target, kind),
                           MODEL_SCRIPT_TIMEOUT)
        for found in (driven or {}).get("found") or []:
            model_finding(probe, target, dict(found, why=why), driven.get("where") or [None, None])


def model_finding(probe: Probe, target: str, found: dict, where: list) -> None:
    kind, ops, f = found["kind"], found["ops"], found["failure"]
    name = target.rsplit(".", 1)[-1]
    var = "s" if kind.startswith(("set", "orderedset")) else "d" if kind == "dict" else "xs"
    module = target.rsplit(".", 1)[0]
    lines = [f"from {module} import {name}", f"{var} = {name}()"] + [as_python(var, n, a) for n, a in ops]
    last = as_python(var, *ops[-1])
    model = model_name(kind)
    if f["what"] == "promise":
        method = "pop" if ops[-1][0] == "pop_at" else ops[-1][0]
        title = f"`{name}.{method}` raises {f['got'].split(':')[0]} where its docstring says {f['want']}"
        said = f"raises {f['got']}, where the docstring of `{name}.{method}` promises {f['want']}"
        severity = "low"
    else:
        said = {"value": f"gives {f['got']}; the model, {model}, gives {f['want']}",
                "raises": f"raises {f['got']}; the model, {model}, gives {f['want']}",
                "returns": f"gives {f['got']}; the model, {model}, raises {f['want']}",
                "state": f"leaves it holding {f['got']}; the model, {model}, holds {f['want']}"}[f["what"]]
        title = (f"`{name}` does not behave like {model.split(' (')[0]}: `{last}` {said.split(';')[0]}"
                 + (f" after {len(ops) - 1} operations" if len(ops) > 1 else ""))
        severity = "medium"
    declared = found.get("why") or "declares itself a collection"
    details = (f"`{target}` {declared}; driven with random operations against {model} as the model, the shortest "
               f"sequence that shows the difference is:\n\n" + "\n".join(f"    {ln}" for ln in lines)
               + f"\n\nThe last line {said}.")
    probe.record(title=title, severity=severity, category="correctness", details=details,
                 evidence=tail("\n".join(lines) + f"\n# {said}", EVIDENCE_CHARS),
                 repro_command=command(drive_script(target, kind, ops, (found["promises"],))),
                 file=where[0], line=where[1])

