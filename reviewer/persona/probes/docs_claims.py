"""The README and docs as executable claims.

- Python examples: each doc file's Python blocks run in order in one namespace, as a reader would type them. A `>>>`
  example whose output differs from the one shown (doctest's own comparison, whitespace and `...` forgiven) and an
  `expr  # value` line whose value differs from the literal in its comment are findings; so is an example that
  raises from the project's own code or imports a name the project does not have. What the docs leave to the reader
  is not: undefined names, missing files, the network, modules the project does not install. Each file runs twice
  with different hash seeds; only failures that agree are kept (set order, ids, randomness). The running itself is
  sandboxed/examples.py, its script docs_examples.py.
- Console scripts: `--help` must work. A documented command line of a console script is checked for a subcommand
  the CLI rejects and for a flag its help does not list and its parser rejects; when it needs nothing the reader must
  supply (no placeholders, its files exist) it is run, and a traceback, a failure or output other than the docs show
  is a finding. They run in sandboxed/commands.py.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from pathlib import Path

from reviewer.persona.probes import doc_sessions, doctext
from reviewer.persona.probes.docs_examples import examples_script, syntax_script
from reviewer.persona.probes.runner import Probe, command, data, run, script
from reviewer.persona.probes.thresholds import DOC_COMMAND_TIMEOUT_S, DOCS_SCRIPT_TIMEOUT
from reviewer.persona.project import EVIDENCE_CHARS
from reviewer.text import tail

PATHLIKE = re.compile(r"/|\.(txt|csv|tsv|json|jsonl|ya?ml|toml|ini|cfg|xml|html?|md|rst|py|dat|log|png|jpe?g)$", re.I)
# a file name by its look, any extension (sqlparse's README runs `sqlformat ... query.sql`, a file the reader brings):
# wider than PATHLIKE, which picks the argument the edge-input probe swaps for an empty file
FILE_NAME = re.compile(r"^[\w.~-]+\.[A-Za-z][A-Za-z0-9]{0,7}$")


def block_data(b: doctext.Block) -> dict:
    """A Python block as run_examples takes it (plain data, copied into the check script)."""
    return {"file": b.file, "line": b.line, "doctest": b.is_doctest and not b.setup, "text": b.text, "setup": b.setup,
            "lang": b.lang}


def check_examples(probe: Probe, blocks: list[doctext.Block]) -> None:
    by_file: dict[str, list[dict]] = {}
    for b in blocks:
        if b.is_python:
            by_file.setdefault(b.file, []).append(block_data(b))
    for file, file_blocks in by_file.items():
        code = examples_script(file_blocks, probe.package)
        first, res, _ = run(probe, f"probe: the Python examples of {file}", code, DOCS_SCRIPT_TIMEOUT,
                            env="PYTHONHASHSEED=0")
        if not first or res.exit_code == 0:
            if first is None:
                probe.notes.append(f"docs probe: no result from {file}'s examples ({tail(res.output, 200)})")
            continue
        second, _, _ = run(probe, f"probe: the Python examples of {file} (again, another hash seed)", code,
                           DOCS_SCRIPT_TIMEOUT, env="PYTHONHASHSEED=1")
        again = {(o["line"], o["kind"], o.get("got"), o.get("error")) for o in (second or {}).get("outcomes", [])}
        stable = [o for o in first["outcomes"] if o["kind"] in ("mismatch", "error")
                  and (o["line"], o["kind"], o.get("got"), o.get("error")) in again]
        groups: dict[str, list[dict]] = {}  # one finding per distinct error: a renamed function breaks many examples
        for o in stable:
            groups.setdefault(o["error"] if o["kind"] == "error" else f"line {o['line']}", []).append(o)
        for same in groups.values():
            example_finding(probe, file_blocks, same[0], also=[o["line"] for o in same[1:]])


DIFF_CONTEXT = 2  # lines of context around each difference
DIFF_LINES = 40  # at most, in a finding


def visible(text: str) -> str:
    """The text with what a reader cannot see escaped: a variation selector (U+FE0F after an emoji), zero-width and
    other format or control characters, combining marks, unusual spaces, tabs, a carriage return (CRLF) and trailing
    spaces. Three findings of a real round differed only in an invisible U+FE0F: expected and got looked the same."""
    def one(ch: str) -> str:
        if ch == "\t":
            return "\\t"
        if ch == "\r":
            return "\\r"
        if ch != " " and (unicodedata.category(ch)[0] in "CMZ" or 0xFE00 <= ord(ch) <= 0xFE0F):
            return f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}"
        return ch

    lines = []
    for line in text.split("\n"):
        cr = "\\r" if line.endswith("\r") else ""
        line = line.removesuffix("\r")
        body = line.rstrip(" ")
        lines.append("".join(one(ch) for ch in body) + "\\x20" * (len(line) - len(body)) + cr)
    return "\n".join(lines)


def difference(want: str, got: str) -> str:
    """A short unified diff of what the docs show (-) and what came (+), invisible characters escaped; a long output
    shows only the lines that differ, with a little context."""
    want, got = want.rstrip("\n"), got.rstrip("\n")  # a command's last newline is not a line of its output
    diff = list(difflib.unified_diff(visible(want).split("\n"), visible(got).split("\n"), "docs", "got",
                                     n=DIFF_CONTEXT, lineterm=""))
    if len(diff) > DIFF_LINES:
        diff = diff[:DIFF_LINES] + [f"... ({len(diff) - DIFF_LINES} more lines of difference)"]
    return "\n".join(diff)


def short(text: str, limit: int) -> str:
    """One line of at most `limit` characters, for a title."""
    lines = text.strip().splitlines() or [""]
    first = lines[0] if len(lines[0]) <= limit else lines[0][:limit - 4].rstrip() + " ..."
    return first + (" ..." if len(lines) > 1 and not first.endswith("...") else "")


def example_finding(probe: Probe, file_blocks: list[dict], o: dict, also: list[int] = ()) -> None:
    code = short(o["code"], 80)
    if o["kind"] == "mismatch":
        o = dict(o, got=o["got"] or "nothing")  # an example that prints nothing where the docs show output
        title = (f"{o['file']} example `{code}` gives {short(visible(o['got']), 60)}, the docs say "
                 f"{short(visible(o['want']), 60)}")
        details = (f"{o['file']}:{o['line']} shows\n    {o['code']}\nwith the result {o['want']}; run after the "
                   f"examples before it in that file, it gives {o['got']}.\nDifference:\n"
                   + difference(o["want"], o["got"]))
        severity = "medium"
    else:
        more = f" (and {len(also)} more examples)" if also else ""
        title = f"{o['file']} example `{code}` fails: {short(o['error'], 100)}{more}"
        details = (f"{o['file']}:{o['line']}:\n    {o['code']}\nraises {o['error']} (run after the examples before it)."
                   + (f"\nThe examples at lines {', '.join(map(str, also))} fail the same way." if also else ""))
        severity = "high" if "Import" in o["error"] else "medium"
    for name, (line, loop) in (o.get("loop_bound") or {}).items():
        details += (f"\nNote: `{name}` there is what the loop `{short(loop, 80)}` at {o['file']}:{line} left in it, "
                    f"not what the docs bound to `{name}` before that loop.")
    before = [b for b in file_blocks if b["line"] <= o["line"]]  # the repro needs only what comes before the example
    repro = command(examples_script(before, probe.package, only=o["line"]), env="PYTHONHASHSEED=0")
    shown = (f"doc line: {o['code']}\nexpected: {o.get('want', '-')}\ngot: {o.get('got') or o.get('error')}"
             + (f"\n\n{difference(o['want'], o['got'])}" if o["kind"] == "mismatch" else ""))
    probe.record(title=title, severity=severity, category="docs", details=details,
                 evidence=tail(shown, EVIDENCE_CHARS) if len(shown) > EVIDENCE_CHARS else shown,
                 repro_command=repro, file=o["file"], line=o["line"])


def command_script(cmd: dict, checks: list[str]) -> str:
    return script("commands", "check", {"cmd": data(cmd), "checks": data(checks),
                                        "timeout": repr(DOC_COMMAND_TIMEOUT_S)})


def help_script(scripts: list[str]) -> str:
    return script("commands", "check_help", {"scripts": data(scripts), "timeout": repr(DOC_COMMAND_TIMEOUT_S)})


def check_help(probe: Probe) -> None:
    """`--help` of every console script must answer."""
    names = sorted(probe.scripts)
    if not names:
        return
    got, res, _ = run(probe, "probe: --help of the console scripts", help_script(names), 60 + 30 * len(names))
    for p in (got or {}).get("problems", []):
        what = "does not return" if p["code"] is None else ("crashes" if "Traceback" in p["output"]
                                                              else f"fails (exit code {p['code']})")
        probe.record(title=f"`{p['script']} --help` {what}", severity="high", category="docs",
                     details=f"The console script `{p['script']}` (entry point {probe.scripts[p['script']]}) "
                             f"{what} when asked for its help, right after a successful install.",
                     evidence=tail(p["output"], EVIDENCE_CHARS), repro_command=command(help_script([p["script"]])))


def runnable(cmd: doctext.Command, root: Path) -> bool:
    """Can the documented line run as written: nothing for the reader to fill in, every file it names exists?"""
    for stage in cmd.text.split("|"):
        tokens = [t.strip("'\"") for t in stage.split()]
        for before, token in zip([""] + tokens, tokens):
            if doctext.is_placeholder(token) or "://" in token:
                return False
            named = PATHLIKE.search(token) or (FILE_NAME.match(token) and before != "-m")  # not `python -m pkg.mod`
            if named and not token.startswith("-") and not (root / token).exists():
                return False
    return True


def check_commands(probe: Probe, blocks: list[doctext.Block]) -> None:
    seen = set()
    for cmd in doctext.commands(blocks, set(probe.scripts), probe.package)[:20]:
        if cmd.text in seen:
            continue
        seen.add(cmd.text)
        prefix = 3 if cmd.argv[0].startswith("python") else 1
        # a `$ ` line runs as a step of its session (check_sessions), not alone
        checks = ["subcommand", "flags"] + (["run"] if not cmd.prompted and runnable(cmd, probe.root) else [])
        spec = {"text": cmd.text, "argv": cmd.argv, "prefix": prefix, "expected": cmd.expected}
        got, res, _ = run(probe, f"probe: documented command `{cmd.text[:60]}`", command_script(spec, checks),
                          DOC_COMMAND_TIMEOUT_S * 4 + 20)
        for p in (got or {}).get("problems", []):
            command_finding(probe, cmd, spec, p)


def command_finding(probe: Probe, cmd: doctext.Command, spec: dict, p: dict) -> None:
    where = f"{cmd.file}:{cmd.line}"
    if p["check"] == "subcommand":
        title, severity = f"{cmd.file} uses `{' '.join(cmd.argv[:spec['prefix'] + 1])}`: no such subcommand", "medium"
        details = f"{where} documents `{cmd.text}`, but the CLI rejects the subcommand `{p['word']}`."
    elif p["check"] == "flags":
        title, severity = f"{cmd.file} uses `{p['flag']}`, which `{cmd.argv[0]}` does not accept", "medium"
        details = (f"{where} documents `{cmd.text}`; `{p['flag']}` is not in the command's --help and the parser "
                   "rejects it.")
    elif p["what"] == "output":
        title, severity = f"{cmd.file}: `{cmd.text[:60]}` prints something else than the docs show", "medium"
        details = (f"{where} documents `{cmd.text}` printing:\n{cmd.expected}\nIt prints:\n{p['output']}"
                   f"\nDifference:\n{difference(cmd.expected or '', p['output'])}")
    else:
        title = f"{cmd.file}: documented command `{cmd.text[:60]}` " + ("crashes" if p["what"] == "traceback"
                                                                         else f"fails ({p['what']})")
        severity = "high"
        happened = "crashes with a traceback" if p["what"] == "traceback" else f"fails with {p['what']}"
        details = f"{where} documents `{cmd.text}`; run as written after the install, it {happened}."
    probe.record(title=title, severity=severity, category="docs", details=details,
                 evidence=tail(p["output"], EVIDENCE_CHARS),
                 repro_command=command(command_script(spec, [p["check"]])), file=cmd.file, line=cmd.line)


def file_name(token: str) -> bool:
    return bool(PATHLIKE.search(token) or FILE_NAME.match(token))


def check_sessions(probe: Probe, blocks: list[doctext.Block]) -> None:
    """Each documented `$ ` session, in order, in one shell (doc_sessions.py)."""
    for session in doctext.sessions(blocks, set(probe.scripts), probe.package)[:10]:
        steps = doc_sessions.session_steps(session, probe.root, file_name)
        got, _, _ = run(probe, f"probe: the shell session at {session.file}:{session.line}",
                        doc_sessions.session_script(steps), DOC_COMMAND_TIMEOUT_S * (2 * len(steps) + 4))
        problems = (got or {}).get("problems", [])
        unshown = [p for p in problems if p["what"] == "unshown output"]
        for p in [p for p in problems if p["what"] != "unshown output"] + unshown[:1]:  # silence: one per session
            session_finding(probe, session, steps, p, also=[steps[q["step"]]["line"] for q in unshown[1:]]
                            if p in unshown else [])


def session_finding(probe: Probe, session: doctext.Session, steps: list[dict], p: dict, also: list[int]) -> None:
    step = steps[p["step"]]
    where, text = f"{session.file}:{step['line']}", step["text"]
    before = [s["text"] for s in steps[:p["step"]] if s["kind"] != "setup"]
    after = (" after " + ", ".join(f"`{t}`" for t in before) if before else "") + " (one shell, in order)"
    if p["what"] in ("output", "unshown output"):
        title = f"{session.file}: `{text[:60]}` prints something else than the docs show"
        severity = "medium" if p["what"] == "output" else "low"
        shown = step["expected"] or "(nothing)"
        details = (f"{where} documents `{text}` printing:\n{shown}\nRun{after}, it prints:\n{p['output']}"
                   f"\nDifference:\n{difference(step['expected'] or '', p['output'])}") + (
            f"\nThe lines at {', '.join(map(str, also))} also print what the docs do not show." if also else "")
    else:
        what = "crashes" if p["what"] == "traceback" else f"fails ({p['what']})"
        title, severity = f"{session.file}: documented command `{text[:60]}` {what}", "high"
        details = f"{where} documents `{text}`; run as the docs show it{after}, it {what}."
    probe.record(title=title, severity=severity, category="docs", details=details,
                 evidence=tail(p["output"], EVIDENCE_CHARS),
                 repro_command=command(doc_sessions.session_script(
                     steps[:p["step"] + 1], only=p["step"],
                     strict=any(s["expected"] for s in steps if s["kind"] == "project"))),
                 file=session.file, line=step["line"])


def check_syntax(probe: Probe, blocks: list[doctext.Block]) -> None:
    """Every Python block of the docs must parse (sandboxed/syntax.py says what is a deliberate fragment)."""
    data_ = [block_data(b) for b in blocks if b.is_python]
    if not data_:
        return
    got, _, _ = run(probe, "probe: do the docs' Python examples parse?", syntax_script(data_), 60)
    seen = set()
    for e in (got or {}).get("errors", []):
        if (e["file"], e["line"]) in seen:
            continue
        seen.add((e["file"], e["line"]))
        caret = " " * max(0, (e["offset"] or 1) - 1) + "^"
        only = {"file": e["file"], "line": e["line"], "doctest": False, "text": e["source"], "setup": False,
                "lang": "python"}
        probe.record(title=f"{e['file']}:{e['line']}: a Python example does not parse ({e['msg']})",
                     severity="medium", category="docs",
                     details=f"{e['file']}:{e['line']} is a Python example a reader copies, and Python cannot run "
                             f"it: SyntaxError: {e['msg']}\n    {e['text']}\n    {caret}",
                     evidence=tail(e["source"], EVIDENCE_CHARS), repro_command=command(syntax_script([only])),
                     file=e["file"], line=e["line"])


def probe_docs(probe: Probe) -> None:
    blocks = probe.blocks()
    check_syntax(probe, blocks)
    if probe.package:
        check_examples(probe, blocks)
    check_help(probe)
    check_commands(probe, blocks)
    check_sessions(probe, blocks)
