"""Writes docs/figures.md, the one table of measured figures, from the JSON records in bench/results/.

    python bench/figures.py            # (re)write docs/figures.md
    python bench/figures.py --check    # exit 1 if docs/figures.md is not what the records give

One table per benchmark kind (the record's `"benchmark"` field): file, date, machine (GPU, else CPU), the headline
numbers, and the conditions that were forced or simulated (forced acceptance, a synthetic routing trace, random
weights), so a reader never takes a forced figure for a measured one. The served replay comes first: it is the
product's figure. A kind without a table of its own is listed by file, date and machine; a record of no known shape
(no `"benchmark"` field) is listed by file name; a record that does not parse or lacks a field its table needs is
listed by file name with the reason. The output depends only on the records (sorted, no clock), so `--check` can
tell a stale page.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "figures.md"


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)


@dataclass
class Page:
    tables: dict[str, Table] = field(default_factory=dict)
    listed: dict[str, list[list[str]]] = field(default_factory=dict)  # kind -> [file, date, machine]
    unknown: list[str] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)


def fmt(x: object) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)


def machine(record: dict) -> str:
    """The GPU the record ran on, else its CPU, else whatever device it names."""
    m = record.get("machine")
    if isinstance(m, dict):
        gpu = m.get("gpu")
        if isinstance(gpu, list) and gpu:
            return ", ".join(str(g) for g in gpu)
        if gpu:
            return str(gpu)
        if m.get("cpu"):
            return str(m["cpu"])
    if isinstance(m, str) and m:
        return m
    device = record.get("device")
    return str(device) if isinstance(device, str) and device else "?"


def date(record: dict) -> str:
    return str(record.get("date", "?"))[:10]


def conditions(record: dict, run: dict | None = None) -> str:
    """What in this record was forced or simulated rather than measured as a user would see it."""
    said = []
    command = str(record.get("command", ""))
    tau = (run or {}).get("forced_tau", record.get("forced_tau"))
    if tau is not None and not isinstance(tau, dict):
        said.append(f"forced tau {tau}")
    elif run is None and "--forced-tau" in command:
        said.append("forced tau (a run)")
    trace = record.get("routing_trace")
    if isinstance(trace, dict) and "hot_experts" in trace:
        said.append(f"routing trace {trace['hot_experts']} hot")
    elif "--routing-trace" in command:
        said.append("routing trace")
    model = record.get("model")
    name = model.get("name", "") if isinstance(model, dict) else str(model or "")
    if "random" in name.lower() or name.endswith("-shape"):  # "qwen3.6-35b-a3b-shape": random weights
        said.append("random weights")
    return ", ".join(said) or "measured"


def model_name(record: dict) -> str:
    model = record.get("model")
    return str(model.get("name", model.get("spec", "?"))) if isinstance(model, dict) else str(model or "?")


def serve_replay(record: dict) -> list[list[str]]:
    ready, caps, comps = record["ready_s"], record["captures_after_ready"], record["compilations_after_ready"]
    return [[model_name(record), fmt(record["speedup"]), fmt(record["first_session_speedup"]),
             f"{record['identical']}/{record['replies']}", f"{fmt(ready.get('none'))} / {fmt(ready.get('auto'))}",
             f"{fmt(caps.get('auto'))} / {fmt(comps.get('auto'))}", conditions(record)]]


def spec_e2e(record: dict) -> list[list[str]]:
    rows = []
    for name, s in sorted(record["summary"].items()):
        rows.append([model_name(record), name, fmt(s["tau"]), fmt(s["eta_measured"]), fmt(s["plain_decode_tok_s"]),
                     fmt(s["speculative_decode_tok_s"]), f"{s['identical']}/{s['prompts']}", conditions(record, s)])
    return rows


def cpu_peer(record: dict) -> list[list[str]]:
    return [[str(record["ratio_of"]), str(record["peer"]), fmt(record["ratio_idle"]), fmt(record["ratio_loaded"]),
             fmt(record.get("busy_processes")), conditions(record)]]


def serve_limits(record: dict) -> list[list[str]]:
    flood, log, mem = record.get("flood") or {}, record.get("log") or {}, record.get("memory") or {}
    plain, spec = record.get("abort_plain") or {}, record.get("abort_speculative") or {}
    during = flood.get("during") or {}
    return [[str(record.get("code_root", "?")), fmt(during.get("median_ms")), fmt(during.get("max_ms")),
             fmt(log.get("log_lines_added")), fmt(mem.get("rss_growth_mb")), fmt(plain.get("median_queue_ms")),
             fmt(spec.get("median_queue_ms")), conditions(record)]]


def demo_wall(record: dict) -> list[list[str]]:
    return [[str(r["label"]), fmt(r["wall_seconds"]), fmt(r.get("findings")), fmt(r.get("verified"))]
            for r in record["runs"]]


def target_step(record: dict) -> list[list[str]]:
    return [[model_name(record), fmt(record["L_target_ms"]), fmt(record.get("L_target_floor_ms")),
             fmt(record.get("T_verify16_ms")), fmt(record.get("T_verify16_floor_ms")),
             fmt(record.get("compile", "–")), conditions(record)]]


def cpu_prefill(record: dict) -> list[list[str]]:
    return [[str(r["server"]), fmt(r.get("round")), fmt(r["prompt_n"]), fmt(r["ms_per_token"])]
            for r in record["requests"]]


def drafter_step(record: dict) -> list[list[str]]:
    return [[str(record.get("shape", "?")), fmt(record.get("context")), fmt(record["draft_ms_median"]),
             fmt(record.get("draft_ms_min"))]]


def drafter_window(record: dict) -> list[list[str]]:
    inputs = str(record.get("inputs") or "?").split(":")[0]
    rows = []
    for label, w in record["windows"].items():
        bands = w.get("tau_by_context") or {}
        last = bands[max(bands, key=lambda b: int(b.split("-")[0]))] if bands else None
        same = f"{w['identical']}/{w['replies']}" if "identical" in w else "–"
        rows.append([model_name(record), label, fmt(w["tau"]), fmt(last), same, inputs])
    return rows


def batch_invariance(record: dict) -> list[list[str]]:
    return [[model_name(record), fmt(record["all_bitwise_equal"])]]


@dataclass(frozen=True)
class Kind:
    title: str
    columns: list[str]
    rows: Callable[[dict], list[list[str]]]


# In the page's order: the served replay (the product's figure) first.
KINDS: dict[str, Kind] = {
    "serve_replay": Kind("Served replay (`python -m backend.bench.replay`): the product's figure",
                         ["model", "speedup", "first session", "identical", "ready s (none / auto)",
                          "captures / compilations after ready", "conditions"], serve_replay),
    "spec_e2e": Kind("Plain vs speculative decoding (`reviewer bench`)",
                     ["model", "run", "tau", "eta", "plain tok/s", "spec tok/s", "identical", "conditions"],
                     spec_e2e),
    "cpu_peer": Kind("`reviewer serve` vs llama.cpp's server on the CPU (`bench/cpu_peer.py`; ratio ours/theirs)",
                     ["ratio of", "peer", "ratio idle", "ratio loaded", "busy processes", "conditions"], cpu_peer),
    "serve_limits": Kind("`reviewer serve` against a starving client (`bench/serve_limits.py`)",
                         ["code root", "/health median ms (flood)", "/health max ms", "log lines added",
                          "RSS growth MB", "queue ms after abort (plain)", "(speculative)", "conditions"],
                         serve_limits),
    "demo_wall": Kind("`make demo` wall time", ["run", "wall s", "findings", "verified"], demo_wall),
    "target_step": Kind("Target decode step (`bench/target_step.py`)",
                        ["model", "L_target ms", "floor ms", "T_verify16 ms", "floor ms", "compile", "conditions"],
                        target_step),
    "cpu_prefill": Kind("Long-prompt prefill through `reviewer serve` on the CPU (`bench/cpu_prefill.py`)",
                        ["server", "round", "prompt tokens", "ms/token"], cpu_prefill),
    "drafter_step": Kind("One GPU draft (`bench/drafter_step.py`)",
                         ["shape", "context", "draft ms (median)", "draft ms (min)"], drafter_step),
    "drafter_window": Kind("The drafter's context window on replayed agent sessions (`bench/drafter_window.py`)",
                           ["model", "window", "tau", "tau, longest contexts", "identical to none", "inputs"],
                           drafter_window),
    "batch_invariance": Kind("Verify rows bitwise equal to decode steps (`bench/batch_invariance.py`)",
                             ["model", "all bitwise equal"], batch_invariance),
}


def read(path: Path) -> dict | str:
    """The record, or one line saying why it cannot be read."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"not JSON: {str(e).splitlines()[0]}"
    return record if isinstance(record, dict) else f"not a JSON object (a {type(record).__name__})"


def collect(results: Path) -> Page:
    page = Page()
    for path in sorted(results.glob("*.json")):
        record = read(path)
        if isinstance(record, str):
            page.unreadable.append((path.name, record))
            continue
        kind_name = record.get("benchmark")
        if not isinstance(kind_name, str):
            page.unknown.append(path.name)
            continue
        kind = KINDS.get(kind_name)
        if kind is None:
            page.listed.setdefault(kind_name, []).append([path.name, date(record), machine(record)])
            continue
        try:
            rows = kind.rows(record)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            page.unreadable.append((path.name, f"{kind_name} record without the expected {type(e).__name__}: {e}"))
            continue
        table = page.tables.setdefault(kind_name, Table(kind.title, ["file", "date", "machine", *kind.columns]))
        table.rows.extend([f"[{path.name}](../bench/results/{path.name})", date(record), machine(record), *row]
                          for row in rows)
    return page


def cell(text: str) -> str:
    """A table cell: a pipe or a newline inside a record's string would break the row."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    # Newest first, then by file: the row order depends on the records alone.
    ordered = sorted(rows, key=lambda r: (r[0], r[3:]))
    ordered = sorted(ordered, key=lambda r: r[1], reverse=True)
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in ordered]
    return lines


def render(page: Page) -> str:
    lines = ["# Measured figures", "",
             "Generated by `python bench/figures.py` from the JSON records in [bench/results/](../bench/results/); "
             "do not edit by hand (`python bench/figures.py --check` fails when this page is stale). Each record "
             "holds its command, date, machine and how its inputs were chosen; what the scripts measure: "
             "[bench/README.md](../bench/README.md). \"conditions\" says what was forced or simulated rather than "
             "measured as a user would see it: a forced tau fixes the acceptance (random weights accept nothing), a "
             "routing trace replaces a random router's uniform routing, random weights stand in for a released "
             "model's shape.", ""]
    for name in [k for k in KINDS if k in page.tables]:
        table = page.tables[name]
        lines += [f"## {table.title}", "", *markdown_table(table.columns, table.rows), ""]
    if page.listed:
        lines += ["## Other records", "", "Kinds without a table here; their fields are described in "
                  "[bench/README.md](../bench/README.md).", ""]
        rows = [[f"[{f}](../bench/results/{f})", d, m, kind] for kind, rs in page.listed.items() for f, d, m in rs]
        lines += [*markdown_table(["file", "date", "machine", "benchmark"], rows), ""]
    if page.unknown:
        lines += ["## Records of no known shape", "", "No `\"benchmark\"` field: listed by file name.", ""]
        lines += [f"- [{f}](../bench/results/{f})" for f in page.unknown] + [""]
    if page.unreadable:
        lines += ["## Records that could not be read", ""]
        lines += [f"- `{f}`: {why}" for f, why in page.unreadable] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/figures.md from the JSON records in bench/results/.")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of JSON records (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help="the page to write (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out is stale")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        print(f"error: {args.results} is not a folder", file=sys.stderr)
        return 2
    page = collect(args.results)
    text = render(page)
    for name, why in page.unreadable:
        print(f"warning: {name}: {why}", file=sys.stderr)
    if args.check:
        current = args.out.read_text() if args.out.is_file() else None
        if current != text:
            print(f"{args.out} is stale: run python bench/figures.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out} from {sum(len(t.rows) for t in page.tables.values())} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
