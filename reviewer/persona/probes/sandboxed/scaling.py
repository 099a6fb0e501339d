"""Scaling, measured inside the sandbox: one function timed at doubling sizes of its input, the exponent of its time
and of its output's growth fitted (what is grown, and the thresholds: reviewer/persona/probes/scaling.py)."""

from __future__ import annotations

import gc
import time
from statistics import median

from .prelude import Overtime, consume, emit, exception_line, limit, quiet, slope, target_of


def measure(func, build, ref, cfg):
    """Time func at doubling sizes; the points and the fitted exponents."""
    points, note, started = [], None, time.perf_counter()
    f = cfg["start"] / ref
    while True:
        n = round(ref * f)
        try:
            a, k = build(f)
            with quiet(), limit(cfg["call_limit"]):
                t = time.perf_counter()
                out, capped = consume(func(*a, **k), cfg["cap"])
                first = time.perf_counter() - t
            if capped:
                note = f"at n={n} the output passed {cfg['cap']} items"
                break
            number = 1  # calls per timed run: enough to outlast the timer's noise, few enough to build their inputs
            while first * number < cfg["batch"] and number < 1000 and (number * 2) * n <= 2**20:
                number *= 2
            times, cpu = [], []
            for _ in range(cfg["repeats"]):
                sets = [build(f) for _ in range(number)]
                gc.collect()
                gc.disable()
                try:
                    with quiet(), limit(cfg["call_limit"] * number + 1):
                        t, c = time.perf_counter(), time.process_time()
                        for a, k in sets:
                            consume(func(*a, **k), cfg["cap"])
                        cpu.append((time.process_time() - c) / number)
                        times.append((time.perf_counter() - t) / number)
                finally:
                    gc.enable()
        except Overtime:
            note = f"a call at n={n} took over {cfg['call_limit']} s"
            break
        except Exception as e:  # noqa: BLE001 - a size the function refuses ends the growth
            note = f"at n={n}: {exception_line(e)}"
            break
        points.append({"n": n, "median": median(times), "min": min(times), "max": max(times), "cpu": min(cpu),
                       "out": out})
        if points[-1]["median"] >= cfg["enough"] or n * 2 > cfg["max"] or time.perf_counter() - started > cfg["budget"]:
            break
        if n >= 2**14 and points[-1]["median"] < 2e-5:
            break  # under 20 us for 16k elements: it does not even read its input, nothing grows here
        f *= 2
    result = {"points": points, "note": note, "flagged": False}
    fit = points[-cfg["points"]:]
    if len(fit) == cfg["points"]:
        xs = [p["n"] for p in fit]
        b, bmin = slope(xs, [p["median"] for p in fit]), slope(xs, [p["min"] for p in fit])
        # The process's CPU time as well as the wall clock: on a machine shared with other jobs a long timed run is
        # preempted more often than a short one (one that fits in a scheduler slice can run untouched), which bends
        # the wall-clock curve upwards by itself; measured on a busy 2-core box, a linear function read as n^1.6.
        # The CPU time counts only what the function computed (all its threads), so a finding needs both to agree.
        bcpu = slope(xs, [max(p["cpu"], 1e-9) for p in fit])
        bout = slope(xs, [max(p["out"], 1) for p in fit])
        excess = min(b, bmin, bcpu) - max(1.0, bout)
        result.update(exponent=b, exponent_min=bmin, exponent_cpu=bcpu, output_exponent=bout, excess=excess,
                      flagged=excess >= cfg["excess"])
    return result


def check(target, doc_named, cfg, variants):
    """The check script's entry: `variants` are (label, reference length, build(f) -> (args, kwargs)); exit 1 when
    one of them grows too fast."""
    func, skipped, where = target_of(target, doc_named)
    if skipped:
        emit({"variants": [], "skipped": skipped})
        return 0
    results = [dict(measure(func, build, ref, cfg), variant=label) for label, ref, build in variants]
    emit({"variants": results, "where": where})
    return 1 if any(r["flagged"] for r in results) else 0
