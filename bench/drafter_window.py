"""The drafter's context window, swept on replayed agent sessions: how many tokens a speculative cycle commits as
an agent's context grows, with the drafter seeing all of it or only its last W positions.

Why: on the replay's sessions the shipped SmolLM2 drafter's acceptance fell as the context grew (5.3 tokens a cycle
at 2.9k tokens, 1.6 at 8k, on a development session; it trained on prompts of at most 4,096 tokens, most far
shorter). A window is a property of the drafter only: the target verifies every draft, so no reply changes (this
bench checks it against --drafter none).

For each window W a copy of the drafter's folder is made whose config.json says `sliding_window: W` (the z-lab /
Hugging Face field: the sliding_attention layers see the last W positions, the full_attention layer everything; 0:
no window), its weights linked, not copied. All of them, and --drafter none, replay the same sessions through
backend.bench.replay_engine in one process (one loaded target). The record holds, per window: tau (tokens a cycle)
over all turns, per session and per band of context length, replies identical to --drafter none's, session walls
(side by side in one run; on a CPU only their ratios mean anything), and every turn's row.

    python bench/drafter_window.py --windows 0,1024,2048 --repo DIR --sessions 2 --device cpu \\
        --inputs "held-out: ..." --out bench/results/
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.replay import machine, mark_identical, session_tau, write_record  # noqa: E402
from backend.bench.replay_engine import engine_replay  # noqa: E402
from backend.bench.sessions import ReplayError, SessionError, build_sessions, repo_files, stdlib_tests  # noqa: E402

BAND = 2048  # tokens of context per band of the tau-by-length table


def window_variant(drafter: Path, window: int, root: Path) -> Path:
    """A folder with the drafter's weights (linked) and its config.json with sliding_window set (0: none)."""
    raw = json.loads((drafter / "config.json").read_text())
    raw["sliding_window"] = window or None
    raw["use_sliding_window"] = bool(window)
    folder = root / f"window_{window}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for weights in drafter.glob("*.safetensors"):
        (folder / weights.name).symlink_to(weights.resolve())
    return folder


def by_band(rows: list[dict]) -> dict[str, float | None]:
    """tau per band of context length ("0-2047", "2048-4095", ...), over the turns that started in it."""
    bands: dict[int, list[dict]] = {}
    for r in rows:
        bands.setdefault(r["context_tokens"] // BAND, []).append(r)
    return {f"{b * BAND}-{(b + 1) * BAND - 1}": session_tau(got) for b, got in sorted(bands.items())}


def summarize(label: str, rows: list[dict], run: dict) -> dict:
    mine = [r for r in rows if r["config"] == label]
    compared = [r for r in mine if r["identical_to_none"] is not None]
    return {"tau": session_tau(mine),
            "tau_by_session": {s: session_tau([r for r in mine if r["session"] == s]) for s in run["sessions_wall_s"]},
            "tau_by_context": by_band(mine), "replies": len(compared),
            "identical": sum(r["identical_to_none"] for r in compared), "turns": len(mine),
            "wall_s": round(sum(run["sessions_wall_s"].values()), 3), "sessions_wall_s": run["sessions_wall_s"]}


def drafter_folder(model: str, given: str | None) -> Path:
    """--drafter, or the drafter shipped for --model (what `reviewer serve --drafter auto` would load)."""
    from backend.dflash.checkpoint import find_shipped_drafter
    from backend.loading import EMBEDDED_NAME

    folder = Path(given) if given else find_shipped_drafter(EMBEDDED_NAME if model == "embedded" else model)
    if folder is None or not (folder / "config.json").is_file():
        raise ReplayError(f"no drafter folder for {model}: give --drafter DIR (a folder with config.json)")
    return folder


def sweep(a: argparse.Namespace, windows: list[int], command: str) -> dict:
    drafter = drafter_folder(a.model, a.drafter)
    source = repo_files(Path(a.repo)) if a.repo else stdlib_tests()
    sessions = build_sessions(a.sessions, source, chunk_chars=a.chunk_chars)
    with tempfile.TemporaryDirectory(prefix="drafter_window_") as tmp:
        folders = {str(window_variant(drafter, w, Path(tmp))): w for w in windows}
        configs = (("none",) if a.plain else ()) + tuple(folders)
        runs, rows, name, settings, _ = engine_replay(a.model, sessions, drafters=configs, device=a.device,
                                                      max_context=a.max_context, max_tokens=a.max_tokens,
                                                      max_turns=a.max_turns, forced_tau=None)
        mark_identical(rows)
        turns = [asdict(r) for r in rows]
        for r in turns:  # the temporary folder's path means nothing after the run: name the window instead
            r["config"] = "none" if r["config"] == "none" else f"window {folders[r['config']]}"
    summary = {f"window {w}": summarize(f"window {w}", turns, runs[path]) for path, w in folders.items()}
    return {"benchmark": "drafter_window", "machine": machine(), "model": name, "drafter": str(drafter),
            "command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "inputs": a.inputs, "held_out": source.held_out, "sessions": len(sessions),
            "window_means": "config.json's sliding_window: the drafter's sliding_attention layers see the last W "
                            "positions, its full_attention layer all of them; 0: no window",
            "settings": {**settings, "max_tokens": a.max_tokens, "chunk_chars": a.chunk_chars, "temperature": 0},
            "plain_wall_s": round(sum(runs["none"]["sessions_wall_s"].values()), 3) if a.plain else None,
            "windows": summary,
            "session_details": [{"name": s.name, "persona": s.persona, "files": s.files,
                                 "chunks_dropped_seen_in_training": s.dropped_seen} for s in sessions],
            "turns": turns}


def format_table(record: dict) -> str:
    bands = sorted({b for w in record["windows"].values() for b in w["tau_by_context"]}, key=lambda b: int(b.split("-")[0]))
    head = f"{'drafter':<14}{'tau':>6}{'wall_s':>9}{'identical':>11}  " + "".join(f"{b:>12}" for b in bands)
    lines = [f"drafter_window: {record['model']}, {record['sessions']} session(s); tau by context tokens", head]
    for label, w in record["windows"].items():
        lines.append(f"{label:<14}{w['tau'] or 0:>6.2f}{w['wall_s']:>9.1f}{w['identical']:>6}/{w['replies']:<4}  "
                     + "".join(f"{w['tau_by_context'].get(b) or 0:>12.2f}" for b in bands))
    if record["plain_wall_s"] is not None:
        lines.append(f"{'none':<14}{'-':>6}{record['plain_wall_s']:>9.1f}")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", help="the target (`reviewer serve --model` values)")
    ap.add_argument("--drafter", help="the drafter folder to vary (default: the one shipped for --model)")
    ap.add_argument("--windows", default="0,1024,2048", help="comma-separated windows in positions (0: none)")
    ap.add_argument("--repo", help="take the sessions' tool results from this folder's files (default: the "
                                   "interpreter's own test suite)")
    ap.add_argument("--sessions", type=int, default=2, help="sessions (personas correctness, performance, docs)")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every reply")
    ap.add_argument("--chunk-chars", type=int, default=400, help="characters of file per tool result")
    ap.add_argument("--max-turns", type=int, help="stop each session after this many turns")
    ap.add_argument("--max-context", type=int, default=8192, help="the window the sessions grow to")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--no-plain", dest="plain", action="store_false",
                    help="skip the --drafter none run (and the identical-replies check against it)")
    ap.add_argument("--inputs", default="", help="how the sessions' source was chosen (development or held out), "
                                                 "written into the record")
    ap.add_argument("--out", default="bench/results/", help="folder (or .json file) for the record")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    command = "python bench/drafter_window.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    try:
        bad = [w for w in a.windows.split(",") if w.strip() and not w.strip().lstrip("-").isdigit()]
        if bad:
            raise ReplayError(f"--windows: {bad[0]!r} is not a number of positions")
        windows = [int(w) for w in a.windows.split(",") if w.strip()]
        if not windows or min(windows) < 0 or len(set(windows)) != len(windows):
            raise ReplayError("--windows takes distinct window sizes >= 0, comma-separated")
        record = sweep(a, windows, command)
    except (ReplayError, SessionError) as exc:
        print(f"drafter_window: {exc}", file=sys.stderr)
        return 2
    print(format_table(record))
    out = Path(a.out)
    if out.suffix != ".json":
        out = out / f"drafter_window_{datetime.now(timezone.utc):%Y%m%d_%H%M%S}.json"
    print(f"wrote {write_record(record, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
