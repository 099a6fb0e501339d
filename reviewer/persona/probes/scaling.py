"""Scaling: how the time of the public functions the tests and docs call grows with their input.

A call site's sized arguments (a list, tuple, string, bytes, range) are grown one at a time from ~256 elements,
doubling, until a call takes SCALING_ENOUGH_S or the sizes run out (each call cut off after SCALING_CALL_LIMIT_S, each
function after SCALING_SCRIPT_BUDGET_S). For each of the first two: the sequence alone, and the sequence with the
integer arguments no larger than it (a window, a chunk size), grown in proportion, as the call site has them. A lone
integer is never grown: what it counts (a number's value, a factorial's) may rightly cost more than linear. At each
size: the median and minimum of SCALING_REPEATS runs, with garbage collection off (as timeit does), each run consuming
what the call returns, and the minimum CPU time. The exponent b of time ~ n^b is fitted over the largest SCALING_POINTS
sizes, for the medians, the minima and the CPU times (immune to other jobs on the machine), and so is the growth of
the output itself: a function whose output grows as n^2 has to take n^2. A finding when all three fits exceed max(1, output exponent) by EXCESS_CLAIMED where the docs call the function linear or fast,
by EXCESS_UNCLAIMED otherwise.
"""

from __future__ import annotations

from reviewer.persona.probes import doctext
from reviewer.persona.probes.callsites import CallSite
from reviewer.persona.probes.runner import Probe, command, run, script
from reviewer.persona.probes.thresholds import (EXCESS_CLAIMED, EXCESS_UNCLAIMED, LINEAR_CLAIM, OUTPUT_CAP,
                                                SCALING_BATCH_S, SCALING_CALL_LIMIT_S, SCALING_ENOUGH_S, SCALING_MAX,
                                                SCALING_MAX_FUNCTIONS, SCALING_POINTS, SCALING_REPEATS,
                                                SCALING_SCRIPT_BUDGET_S, SCALING_SCRIPT_TIMEOUT, SCALING_START)
from reviewer.persona.project import EVIDENCE_CHARS
from reviewer.text import tail

SIZED = ("seq", "str", "bytes", "range", "listrange", "iter")


def growable(site: CallSite) -> list[int]:
    """Indexes (in site.all_args()) of the arguments that can grow: non-empty sequences, strings, bytes, ranges
    (a string given by keyword is an option, incomplete='strict', not data)."""
    return [i for i, (key, a) in enumerate(site.all_args()) if a.kind in SIZED and a.length > 0
            and not (a.kind == "str" and key is not None)]


def grown(site: CallSite, which: int, with_ints: bool) -> tuple[str, int, str] | None:
    """(`(args), {kwargs}` source as a function of f, the reference length, what grows) with argument `which` grown
    and, `with_ints`, the integers no larger than it; None when that variant does not exist. One sequence at a time:
    growing a signal and its kernel together makes any convolution quadratic."""
    args = site.all_args()
    ref = args[which][1].length
    if with_ints and not any(a.kind == "int" and 0 < int(a.source) <= ref for _, a in args):
        return None
    pos, kws, what = [], [], []
    for i, (key, a) in enumerate(args):
        src = a.source
        if i == which and a.kind in ("seq", "str", "bytes"):
            src = f"grow({a.source}, f)"
        elif i == which and a.kind in ("range", "listrange"):
            src = f"range(scale({a.inner}, f))" if a.kind == "range" else f"list(range(scale({a.inner}, f)))"
        elif i == which and a.kind == "iter":
            src = f"iter(grow({a.inner}, f))"
        elif with_ints and a.kind == "int" and 0 < int(a.source) <= ref:
            src = f"scale({a.source}, f)"
        if src != a.source:
            what.append(f"`{key or a.source}`")
        (pos if key is None else kws).append((key, src))
    source = "(" + "".join(f"{s}, " for _, s in pos) + "), {" + ", ".join(f"{k!r}: {s}" for k, s in kws) + "}"
    return source, ref, " and ".join(what)


def scaling_script(site: CallSite, variants: list[tuple[str, int, str]], excess: float, budget: float,
                   doc_named: bool = True) -> str:
    cfg = dict(start=SCALING_START, max=SCALING_MAX, enough=SCALING_ENOUGH_S, call_limit=SCALING_CALL_LIMIT_S,
               points=SCALING_POINTS, repeats=SCALING_REPEATS, batch=SCALING_BATCH_S, cap=OUTPUT_CAP,
               budget=budget, excess=excess)
    built = "".join(f"        ({label!r}, {ref}, lambda f: ({src})),\n" for label, ref, src in variants)
    built = "[\n" + built + "    ]"
    return script("scaling", "check", {"target": repr(site.target), "doc_named": repr(doc_named), "cfg": repr(cfg),
                                       "variants": built}, names=("grow", "scale"))


def choose(probe: Probe) -> list[tuple[CallSite, list[str]]]:
    """One call site per function (from the docs if they call it, else the one with the most sized arguments), the
    functions the docs claim something for first, then those the docs call, then the tests'."""
    sites = probe.sites()
    chosen = []
    for target, calls in sites.calls.items():
        usable = [s for s in calls if growable(s)]
        if not usable:
            continue
        site = max(usable, key=lambda s: (s.in_docs, any(a.kind == "int" for _, a in s.all_args()),
                                          sum(a.length for _, a in s.all_args())))
        claims = doctext.claims(probe.sentences(), LINEAR_CLAIM, name=site.name)
        chosen.append((site, claims))
    chosen.sort(key=lambda x: (not x[1], not x[0].in_docs, x[0].target))
    return chosen[:SCALING_MAX_FUNCTIONS]


def probe_scaling(probe: Probe) -> None:
    if not probe.package:
        return
    for site, claims in choose(probe):
        variants = []
        for which in growable(site)[:2]:
            for with_ints in (False, True):
                g = grown(site, which, with_ints)
                if g:
                    src, ref, what = g
                    variants.append((f"growing {what}", ref, src))
        excess = EXCESS_CLAIMED if claims else EXCESS_UNCLAIMED
        budget = SCALING_SCRIPT_BUDGET_S / len(variants)
        named = doctext.names(probe.doc_text(), site.target)
        got, res, _ = run(probe, f"probe: scaling of {site.target}",
                          scaling_script(site, variants, excess, budget, named), SCALING_SCRIPT_TIMEOUT)
        for r, v in zip((got or {}).get("variants") or [], variants):
            if r.get("flagged"):
                record(probe, site, claims, r, v, (got.get("where") or [None, None]), excess, budget, named)
                break  # one finding per function: the first variant that shows it


def record(probe: Probe, site: CallSite, claims: list[str], r: dict, variant, where, excess: float,
           budget: float, named: bool = True) -> None:
    b = r["exponent"]
    table = "\n".join(f"  n={p['n']:>8}  median {p['median'] * 1000:10.3f} ms  (min {p['min'] * 1000:.3f}, "
                      f"max {p['max'] * 1000:.3f}, CPU {p['cpu'] * 1000:.3f})  output {p['out']}" for p in r["points"])
    said = claims[0].split(": ", 1)[1] if claims else ""
    said = said if len(said) <= 80 else said[:77].rsplit(" ", 1)[0] + " ..."
    title = (f"`{site.name}` takes time ~n^{b:.1f}, though the docs say: \"{said}\"" if claims
             else f"`{site.name}` takes time ~n^{b:.1f} in the input size")
    severity = ("high" if b >= 1.8 else "medium") if claims else "low"
    details = (f"`{site.target}` called as at {site.where} (`{site.text}`), {r['variant']} from "
               f"{r['points'][0]['n']} to {r['points'][-1]['n']} elements: time grows as n^{b:.2f} (fit of the medians; "
               f"n^{r['exponent_min']:.2f} for the minima, n^{r['exponent_cpu']:.2f} for the CPU time) while its output grows as n^{r['output_exponent']:.2f}. "
               f"Threshold: {excess} above max(1, output exponent)"
               + (". The docs say:\n" + "\n".join(claims[:3]) if claims else ".") + f"\nTimings:\n{table}")
    probe.record(title=title, severity=severity, category="performance", details=details,
                 evidence=tail(table, EVIDENCE_CHARS),
                 repro_command=command(scaling_script(site, [variant], excess, budget, named)),
                 file=where[0], line=where[1])
