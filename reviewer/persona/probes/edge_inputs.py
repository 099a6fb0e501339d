"""Edge inputs: the public functions the tests and docs call, called again with one argument swapped for an empty,
zero, negative or non-ASCII one of the same kind; and the console scripts the docs run on a file, run on an empty
and on a malformed file.

A crash is an exception that says the code did not expect the input (thresholds.CRASHES: IndexError, KeyError,
ZeroDivisionError, ...), or a traceback from a CLI. Not findings: ValueError and TypeError (how Python code rejects
bad input); an exception the function's docstring, the docs or its tests name; an empty input where the docstring
says non-empty, a zero or negative one where it says positive; an IndexError on an empty sequence from a function
whose docstring says it returns an element of it; a ZeroDivisionError for a zero we passed to a function whose
docstring says it divides; a KeyError for the very key we passed; a call that only hangs
(abandoned after a limit); and anything at all when the original call from the tests or docs fails in our hands (then
our copy of it is wrong). Methods of built-in objects the project only holds (a module-level set's `add`) and the
project's internals (neither exported by the package nor in a module's `__all__`, nor named by the docs) are not
called at all.
"""

from __future__ import annotations

import re

from reviewer.persona.probes import doctext
from reviewer.persona.probes.callsites import Arg, CallSite
from reviewer.persona.probes.docs_claims import PATHLIKE, short
from reviewer.persona.probes.runner import Probe, command, data, run, script
from reviewer.persona.probes.thresholds import (CLI_EDGE_TIMEOUT_S, CRASHES, DIVISION_CONTRACT, EDGE_CALL_LIMIT_S,
                                                EDGE_MAX_FUNCTIONS, EDGE_SCRIPT_TIMEOUT, ELEMENT_CONTRACT, FIT_CONTRACT,
                                                NON_ASCII, NON_EMPTY_CONTRACT, POSITIVE_CONTRACT)
from reviewer.persona.project import EVIDENCE_CHARS
from reviewer.text import tail

# Malformed content for a file argument, by its extension: what a user's broken file looks like.
MALFORMED = {".json": '{"unclosed": [1, 2\n', ".jsonl": '{"a": 1}\n{not json\n', ".csv": 'a,b,c\n1,2\n"unterminated\n',
             ".tsv": "a\tb\n1\n", ".toml": "[section\nkey = \n", ".yaml": "key: [unclosed\n  - : :\n",
             ".yml": "key: [unclosed\n  - : :\n"}
MALFORMED_TEXT = "1\nnot a number\n@@@ \u2713 \ufffd\n"


def edges(arg: Arg) -> list[tuple[str, str]]:
    """(kind of edge, Python source) for one argument."""
    if arg.kind == "seq":
        return [("empty", "()" if arg.source.startswith("(") else "[]")]
    if arg.kind == "str":
        return [("empty", "''"), ("non-ASCII", repr(NON_ASCII))]
    if arg.kind == "bytes":
        return [("empty", "b''")]
    if arg.kind in ("range", "listrange"):
        return [("empty", "range(0)" if arg.kind == "range" else "[]")]
    if arg.kind == "iter":
        return [("empty", "iter([])")]
    if arg.kind == "int":
        return [("zero", "0"), ("negative", "-1")]
    if arg.kind == "float":
        return [("zero", "0.0"), ("negative", "-1.0")]
    return []


def variants(site: CallSite) -> list[list[tuple[int, str, str]]]:
    """The edge calls of a site, each a list of (argument index, kind of edge, source) swaps: one argument at a
    time, except that several sequences are emptied together (one empty matrix beside a full one is a misfit the
    caller must avoid, not an edge input)."""
    args = site.all_args()
    seqs = [i for i, (_, a) in enumerate(args) if edges(a) and edges(a)[0][0] == "empty" and a.kind != "str"]
    out = []
    if len(seqs) > 1:
        out.append([(i, "empty", edges(args[i][1])[0][1]) for i in seqs])
    for i, (_, arg) in enumerate(args):
        for kind, value in edges(arg):
            if not (len(seqs) > 1 and i in seqs and kind == "empty"):
                out.append([(i, kind, value)])
    return out


def call_source(site: CallSite, swaps: list[tuple[int, str, str]] = ()) -> tuple[str, str]:
    """(`(args), {kwargs}` source, the call as a reader would write it) with the swapped arguments replaced."""
    replace = {i: value for i, _, value in swaps}
    shown, pos, kws = [], [], []
    for i, (key, arg) in enumerate(site.all_args()):
        src = replace.get(i, arg.source)
        (pos if key is None else kws).append((key, src))
        shown.append(src if key is None else f"{key}={src}")
    args = "(" + "".join(f"{s}, " for _, s in pos) + ")"
    kwargs = "{" + ", ".join(f"{k!r}: {s}" for k, s in kws) + "}"
    return f"{args}, {kwargs}", f"{site.name}({', '.join(shown)})"


def inline(pattern: re.Pattern) -> str:
    """A compiled pattern as text for a probe script, its IGNORECASE kept ("Divide two numbers." must match `divide`;
    passed as `.pattern` alone, the contracts were matched case-sensitively)."""
    return ("(?i)" if pattern.flags & re.IGNORECASE else "") + pattern.pattern


def edge_script(site: CallSite, cases: list[tuple[str, str, str]], expected: set[str], doc_text: str,
                doc_named: bool = True) -> str:
    base, _ = call_source(site)
    multi = len([a for _, a in site.all_args() if a.kind in ("seq", "range", "listrange", "iter", "bytes")]) > 1
    rules = {"crashes": list(CRASHES), "expected": sorted(expected), "fit": inline(FIT_CONTRACT) if multi else None,
             "non_empty": inline(NON_EMPTY_CONTRACT), "positive": inline(POSITIVE_CONTRACT),
             "element": inline(ELEMENT_CONTRACT), "division": inline(DIVISION_CONTRACT), "non_ascii": NON_ASCII}
    built = "[\n" + "".join(f"        ({label!r}, {kind!r}, lambda: ({src})),\n" for label, kind, src in cases) + "    ]"
    return script("edges", "check", {"target": repr(site.target), "doc_named": repr(doc_named), "base": f"({base})",
                                     "cases": built, "doc_text": data(doc_text), "limit_s": repr(EDGE_CALL_LIMIT_S),
                                     "rules": data(rules)})


def cli_edge_script(argv: list[str], index: int, ext: str, cases: list[tuple[str, str]]) -> str:
    return script("edges", "check_files", {"argv": data(argv), "index": repr(index), "ext": repr(ext),
                                           "cases": data(cases), "timeout": repr(CLI_EDGE_TIMEOUT_S)})


def probe_edges(probe: Probe, cli: bool = True) -> None:
    if probe.package:
        check_functions(probe)
    if cli:
        check_cli_files(probe)


def check_functions(probe: Probe) -> None:
    sites = probe.sites()
    sentences = probe.sentences()
    targets = sorted(sites.calls, key=lambda t: (not any(s.in_docs for s in sites.calls[t]), t))
    for target in targets[:EDGE_MAX_FUNCTIONS]:
        cases, seen = [], set()
        for site in sorted(sites.calls[target], key=lambda s: not s.in_docs)[:2]:
            for swaps in variants(site):
                src, shown = call_source(site, swaps)
                if shown not in seen:
                    seen.add(shown)
                    cases.append((shown, swaps[0][1], src, site))
        if not cases:
            continue
        site = cases[0][3]
        name = site.name
        doc_text = "\n".join(s for _, _, s in sentences if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", s))
        expected = sites.expected.get(target, set())
        named = doctext.names(probe.doc_text(), target)
        # Each case carries its own site's arguments; the baseline call is the first site's.
        code = edge_script(site, [(c[0], c[1], c[2]) for c in cases], expected, doc_text, named)
        got, res, _ = run(probe, f"probe: edge inputs of {target}", code, EDGE_SCRIPT_TIMEOUT)
        crashes = (got or {}).get("crashes") or []
        if not crashes:
            continue
        file, line = (got.get("where") or [None, None])
        first = crashes[0]
        others = f" (and {len(crashes) - 1} more edge inputs)" if len(crashes) > 1 else ""
        listing = "\n".join(f"- `{c['case']}` ({c['kind']} input): {c['error']}" for c in crashes)
        only = [c for c in cases if c[0] in {x["case"] for x in crashes}]
        repro = command(edge_script(site, [(c[0], c[1], c[2]) for c in only], expected, doc_text, named))
        title = f"`{short(first['case'], 80)}` raises {first['error'].split(':')[0]}{others}"
        probe.record(title=title, severity="medium", category="crash",
                     details=f"`{target}`, called as the tests or docs call it ({site.where}: `{site.text}`) but with "
                             f"an edge input, crashes with an exception neither its docstring, the docs nor its tests "
                             f"mention:\n{listing}",
                     evidence=tail(first["traceback"], EVIDENCE_CHARS), repro_command=repro, file=file, line=line)


def check_cli_files(probe: Probe) -> None:
    done = set()
    for cmd in doctext.commands(probe.blocks(), set(probe.scripts), probe.package):
        index = next((i for i, t in enumerate(cmd.argv) if i and not t.startswith("-") and PATHLIKE.search(t)
                      and "://" not in t), None)
        if index is None or cmd.argv[0] in done:
            continue
        done.add(cmd.argv[0])  # one documented file-reading command per script is enough to judge its error handling
        ext = "." + cmd.argv[index].rsplit(".", 1)[-1].lower() if "." in cmd.argv[index] else ""
        cases = [("an empty file", ""), ("a malformed file", MALFORMED.get(ext, MALFORMED_TEXT))]
        got, res, _ = run(probe, f"probe: `{cmd.text[:50]}` on an empty and a malformed file",
                          cli_edge_script(cmd.argv, index, ext, cases), CLI_EDGE_TIMEOUT_S * 2 + 20)
        crashes = (got or {}).get("crashes") or []
        if not crashes:
            continue
        which = " and ".join(c["case"] for c in crashes)
        only = [c for c in cases if c[0] in {x["case"] for x in crashes}]
        probe.record(title=f"`{cmd.text[:60]}` dies with a traceback on {which} ({crashes[0]['error'][:80]})",
                     severity="medium", category="crash",
                     details=f"{cmd.file}:{cmd.line} documents `{cmd.text}`. Given {which} in place of "
                             f"`{cmd.argv[index]}`, the command prints a Python traceback instead of an error message:\n"
                             + "\n".join(f"- {c['case']}: {c['error']}" for c in crashes),
                     evidence=tail(crashes[0]["output"], EVIDENCE_CHARS),
                     repro_command=command(cli_edge_script(cmd.argv, index, ext, only)), file=cmd.file, line=cmd.line)
