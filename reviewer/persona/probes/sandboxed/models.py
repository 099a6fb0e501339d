"""Model-based checks inside the sandbox: a collection class driven with random operation sequences against the
built-in type as its model, the shortest failing sequence kept (which classes, what is left alone, and the host half:
reviewer/persona/probes/models.py)."""

from __future__ import annotations

import collections.abc as abc
import copy
import importlib
import inspect
import os
import random
import re
import sys
import time

from .prelude import Overtime, emit, exception_line, limit, resolve


class OrderedSetModel:
    """An ordered set as a list without duplicates: insertion order, or sorted."""

    def __init__(self, keep_sorted=False):
        self.items, self.keep_sorted = [], keep_sorted

    def add(self, x):
        if x not in self.items:
            self.items.append(x)
            if self.keep_sorted:
                self.items.sort()

    def discard(self, x):
        if x in self.items:
            self.items.remove(x)

    def remove(self, x):
        if x not in self.items:
            raise KeyError(x)
        self.items.remove(x)

    def pop(self, *index):
        if not self.items:
            raise KeyError("pop from an empty set")
        return self.items.pop(*index)

    def index(self, x):
        return self.items.index(x)

    def clear(self):
        self.items.clear()

    def __getitem__(self, i):
        return self.items[i]

    def __contains__(self, x):
        return x in self.items

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


OPS = {  # operation -> the methods the class must have for it
    "dict": ["__setitem__", "__getitem__", "__delitem__", "get", "pop", "setdefault", "update", "popitem",
             "__contains__", "__len__", "clear"],
    "set": ["add", "discard", "remove", "pop", "__contains__", "__len__", "clear"],
    "orderedset": ["add", "discard", "remove", "pop", "pop_at", "index", "__getitem__", "__contains__", "__len__",
                   "clear"],
    "list": ["append", "insert", "pop", "pop_at", "__getitem__", "__setitem__", "__delitem__", "index", "count",
             "remove", "extend", "reverse", "__contains__", "__len__", "clear"],
}
MUTATORS = {"add", "discard", "remove", "append", "insert", "extend", "update", "clear", "reverse", "__setitem__",
            "__delitem__"}
MEMBER_RESULT = {"set": {"pop"}, "orderedset": {"pop"}, "dict": {"popitem"}, "list": set()}


def collection_kind(cls, doc_kinds):
    """'dict' | 'set' | 'orderedset' | 'list' | None: what the class declares itself (the ABCs, else the docs)."""
    try:
        if issubclass(cls, abc.MutableMapping):
            return "dict"
        if issubclass(cls, abc.MutableSet):
            return "orderedset" if hasattr(cls, "index") and hasattr(cls, "__getitem__") else "set"
        if issubclass(cls, abc.MutableSequence):
            return "list"
    except TypeError:
        return None
    kind = doc_kinds.get(cls.__name__)
    if kind == "set" and hasattr(cls, "index") and hasattr(cls, "__getitem__"):
        return "orderedset"
    needs = {"dict": ("__setitem__", "__getitem__"), "set": ("add", "__contains__"), "list": ("append", "__getitem__")}
    return kind if kind and all(hasattr(cls, m) for m in needs[kind]) else None


def collection_classes(package, doc_kinds):
    """[module.qualname, kind, why] of the package's public collection classes."""
    top = importlib.import_module(package)
    found = {}
    for name, module in sorted(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        listed = getattr(module, "__all__", None) or ()
        for attr, obj in list(vars(module).items()):
            if not isinstance(obj, type) or attr.startswith("_") or inspect.isabstract(obj):
                continue
            if not (getattr(obj, "__module__", "") or "").split(".")[0] == package:
                continue
            if not (getattr(top, attr, None) is obj or attr in listed or attr in doc_kinds):
                continue
            kind = collection_kind(obj, doc_kinds)
            if kind:
                abcs = [c for c in ("MutableMapping", "MutableSet", "MutableSequence") if issubclass(obj, getattr(abc, c))]
                why = f"is a collections.abc.{abcs[0]}" if abcs else f"is said by the docs to work like a {doc_kinds[attr]}"
                found.setdefault(f"{obj.__module__}.{obj.__qualname__}", (kind, why))
    return sorted([target, kind, why] for target, (kind, why) in found.items())


def pop_takes_index(cls):
    try:
        params = list(inspect.signature(cls.pop).parameters.values())[1:]
    except (TypeError, ValueError, AttributeError):
        return False
    return bool(params) and params[0].name in ("index", "i", "idx", "pos", "position")


def new_model(kind):
    if kind == "orderedset-sorted":
        return OrderedSetModel(keep_sorted=True)
    return {"dict": dict, "set": set, "list": list, "orderedset": OrderedSetModel}[kind]()


def apply(target, name, args):
    """One operation on the class's instance or the model."""
    if name == "pop_at":
        return target.pop(*args)
    if name == "__getitem__":
        return target[args[0]]
    if name == "__setitem__":
        target[args[0]] = args[1]
        return None
    if name == "__delitem__":
        del target[args[0]]
        return None
    if name == "__contains__":
        return args[0] in target
    if name == "__len__":
        return len(target)
    if name in ("extend", "update"):
        return getattr(target, name)(type(args[0])(args[0]))
    return getattr(target, name)(*args)


def call(target, name, args):
    """(result, exception or None), bounded to a second."""
    try:
        with limit(1):
            return apply(target, name, args), None
    except Overtime as e:
        return None, e
    except Exception as e:  # noqa: BLE001 - what it raises is compared with what the model raises
        return None, e


def contents(target, kind):
    if kind == "dict":
        return {k: target[k] for k in list(target)}, len(target)
    if kind == "set":
        return set(target), len(target)
    return list(target), len(target)


def promised(doc):
    """The exception names a docstring promises: a Raises section (Google, NumPy), `:raises X:`, "raises X", "raising
    an X if ..." (ordered-set's `index`)."""
    names = set(re.findall(r":raises?\s+([\w.]+)\s*:", doc or ""))
    names |= set(re.findall(r"\b(?:[Rr]aises?|[Rr]aising)\s+(?:an?\s+)?`*([A-Z]\w*(?:Error|Exception))\b", doc or ""))
    section = re.search(r"^\s*Raises\s*:?\s*\n(?:\s*-{3,}\s*\n)?((?:[ \t]*\S.*\n?)+)", doc or "", re.M)
    for line in (section.group(1).splitlines() if section else []):
        m = re.match(r"^\s*`*([A-Z]\w*(?:Error|Exception))\b", line)
        if m:
            names.add(m.group(1))
    return {n.rsplit(".", 1)[-1] for n in names}


def run_sequence(cls, kind, ops, promises=False):
    """Run the operations on a fresh instance and a fresh model: the first disagreement (a dict), or None. With
    `promises`, where both raise, the exception must be one the method's docstring promises (if it names any)."""
    obj, model = cls(), new_model(kind)
    base = kind.split("-")[0]
    for k, (name, args) in enumerate(ops):
        before = (list(model.items()) if base == "dict" else list(model)) if name in MEMBER_RESULT[base] else None
        want, want_error = call(model, name, args)
        got, got_error = call(obj, name, args)
        if isinstance(got_error, Overtime):
            return {"unsupported": name}
        refused = (NotImplementedError, TypeError, AttributeError)
        if got_error is not None and want_error is None and isinstance(got_error, refused):
            return {"unsupported": name}
        fail = {"step": k}
        if want_error is None and got_error is not None:
            return dict(fail, what="raises", got=exception_line(got_error), want=repr(want))
        if want_error is not None and got_error is None:
            if not (name == "__getitem__" and base == "dict" and hasattr(cls, "__missing__")):
                return dict(fail, what="returns", got=repr(got), want=exception_line(want_error))
            if args[0] in obj:  # a default for a missing key the class keeps (defaultdict): its design
                model[args[0]] = got
        elif want_error is not None:
            method = getattr(cls, "pop" if name == "pop_at" else name, None)
            names = promised(getattr(method, "__doc__", None) or "") if promises else set()
            if names and not any(c.__name__ in names for c in type(got_error).__mro__):
                return dict(fail, what="promise", got=exception_line(got_error), want=" or ".join(sorted(names)))
            continue
        elif name in MEMBER_RESULT[base]:  # any member will do: the model is what it was, less the one chosen
            member = tuple(got) in before if base == "dict" and isinstance(got, (tuple, list)) else got in before
            if not member:
                return dict(fail, what="value", got=repr(got), want=f"a member of {before!r}")
            if base == "dict":
                model = dict(p for p in before if p[0] != got[0])
            elif base == "set":
                model = set(before) - {got}
            else:
                model.items = [x for x in before if x != got]
        elif not (name in MUTATORS and want is None) and got != want:
            return dict(fail, what="value", got=repr(got), want=repr(want))
        try:
            with limit(1):
                got_state, want_state = contents(obj, base), contents(model, base)
        except (Exception, Overtime) as e:  # noqa: BLE001 - iterating it failed: a disagreement of its own
            return dict(fail, what="state", got=exception_line(e), want=repr(contents(model, base)[0]))
        if got_state != want_state:
            return dict(fail, what="state", got=repr(got_state[0]), want=repr(want_state[0]))
    return None


def random_ops(kind, names, domain, rng, length):
    """A random sequence of operations, its indices and keys drawn from the model's state as it goes."""
    model, ops, base = new_model(kind), [], kind.split("-")[0]
    grow = {"dict": "__setitem__", "list": "append"}.get(base, "add")
    for _ in range(length):
        # one in three adds: with removals as likely as additions the collection seldom holds two elements, and a
        # stale index needs an element removed before another one that is then used
        name = grow if grow in names and rng.random() < 0.35 else rng.choice(names)
        x, n = rng.choice(domain), len(model)
        index = rng.randint(-n - 1, n) if n else rng.randint(-1, 1)
        if name in ("add", "discard", "remove", "index", "count", "append", "__contains__", "get", "pop") and (
                base != "list" or name != "pop"):
            args = [] if name == "pop" and base in ("set", "orderedset") else [x]
        elif name in ("__getitem__", "__delitem__", "pop_at"):
            args = [x if base == "dict" else index]
        elif name == "__setitem__":
            args = [x, rng.randint(0, 9)] if base == "dict" else [index, x]
        elif name == "setdefault":
            args = [x, rng.randint(0, 9)]
        elif name == "insert":
            args = [index, x]
        elif name == "extend":
            args = [rng.sample(domain, rng.randint(0, 2))]
        elif name == "update":
            args = [{k: rng.randint(0, 9) for k in rng.sample(domain, rng.randint(0, 2))}]
        else:
            args = []
        ops.append([name, copy.deepcopy(args)])
        call(model, name, args)
    return ops


def shrink(cls, kind, ops, what, promises):
    """The shortest sequence that still fails the same way, dropping one operation at a time."""
    ops = ops[:run_sequence(cls, kind, ops, promises)["step"] + 1]
    changed = True
    while changed:
        changed = False
        for i in range(len(ops)):
            fewer = ops[:i] + ops[i + 1:]
            f = run_sequence(cls, kind, fewer, promises) if fewer else None
            if f and not f.get("unsupported") and f["what"] == what:
                ops, changed = fewer[:f["step"] + 1], True
                break
    return ops


def ordering(cls, domain):
    """How a fresh ordered set keeps its elements: 'orderedset' (insertion), 'orderedset-sorted', or 'set'."""
    obj = cls()
    for x in (domain[3], domain[1], domain[2]):
        obj.add(x)
    order = list(obj)
    if order == [domain[3], domain[1], domain[2]]:
        return "orderedset"
    return "orderedset-sorted" if order == sorted(order) else "set"


def drive(cls, kind, promises, search, seed=0):
    """(kind as driven, the shrunk failing operations, the failure) or None: a behaviour the model does not share,
    or (`promises`) an exception the docstring does not promise. `search`: trials, length (operations per trial),
    seconds (for all trials)."""
    base = kind
    for domain in ([0, 1, 2, 3, 4, 5], ["a", "b", "c", "d", "e", "f"]):
        try:
            with limit(2):
                probe_obj = cls()
                first = {"dict": "__setitem__", "list": "append"}.get(base, "add")
                apply(probe_obj, first, [domain[0], 1] if base == "dict" else [domain[0]])
                kind = ordering(cls, domain) if base == "orderedset" else base
            break
        except (Exception, Overtime):  # noqa: BLE001 - this kind of element is not for it: try the next
            continue
    else:
        return None
    names = [n for n in OPS[kind.split("-")[0]] if n.startswith("__") or (n == "pop_at" and pop_takes_index(cls))
             or (n != "pop_at" and hasattr(cls, n))]
    if kind == "set":
        names = [n for n in names if n in OPS["set"]]
    if hasattr(cls, "__missing__"):  # Mapping's get, setdefault and pop read a missing key through the default
        names = [n for n in names if n not in ("get", "setdefault", "pop")]
    rng, start = random.Random(seed), time.monotonic()
    for _ in range(search["trials"]):
        if time.monotonic() - start > search["seconds"] or not names:
            return None
        ops = random_ops(kind, names, domain, rng, search["length"])
        try:
            failure = run_sequence(cls, kind, ops, promises)
        except (Exception, Overtime):  # noqa: BLE001 - the class could not even be made: nothing to judge
            return None
        if failure and failure.get("unsupported"):
            names.remove(failure["unsupported"])
            continue
        if failure and (failure["what"] == "promise") == promises:
            ops = shrink(cls, kind, ops, failure["what"], promises)
            return kind, ops, run_sequence(cls, kind, ops, promises)
    return None


def discover(package, doc_kinds):
    """The check script's entry that lists the package's collection classes."""
    emit({"classes": collection_classes(package, doc_kinds)})
    return 0


def check(target, kind, ops, modes, search):
    """The check script's entry for one class: the search in each mode (behaviour; promised exceptions), or with
    `ops` the repro of one failure; exit 1 when one is found."""
    cls = resolve(target)
    try:
        where = [os.path.relpath(inspect.getsourcefile(cls)), inspect.getsourcelines(cls)[1]]
    except (TypeError, OSError):
        where = [None, None]
    found = []
    for promises in modes:
        got = drive(cls, kind, promises, search) if ops is None else (kind, ops, run_sequence(cls, kind, ops, promises))
        if got is not None and got[2] is not None and not got[2].get("unsupported"):
            found.append({"kind": got[0], "ops": got[1], "failure": got[2], "promises": promises})
    emit({"found": found, "where": where})
    return 1 if found else 0
