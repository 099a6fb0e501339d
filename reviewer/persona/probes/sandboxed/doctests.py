"""doctest's examples of a docs block, never its ValueError (shared by examples.py, which runs them, and syntax.py,
which compiles them)."""

from __future__ import annotations

import doctest
import re


def parse_examples(lines):
    try:
        return doctest.DocTestParser().get_examples("\n".join(lines) + "\n")
    except ValueError:
        return None


def mend_prompts(lines):
    """`>>>x` -> `>>> x`, `...x` after a prompt -> `... x`, every line at one indentation."""
    out, prompt = [], False
    for ln in (ln.strip() for ln in lines):
        m = re.match(r"^(>>>|\.\.\.)(?=\S)", ln)
        if m and (m.group(1) == ">>>" or prompt):
            ln = ln[:3] + " " + ln[3:]
        prompt = bool(re.match(r"^(>>>|\.\.\.)( |$)", ln))
        out.append(ln)
    return out


def doctest_examples(text):
    """doctest's examples of a block, never its ValueError: a block doctest cannot parse (`>>>x` without the blank,
    prompts indented unevenly: a real `.rst` crashed the whole file's script, and only a note was left) is parsed
    paragraph by paragraph, a paragraph that still fails with its prompts mended, one that fails even then left out."""
    whole = parse_examples([text])
    if whole is not None:
        return whole
    lines, chunks, current, first = text.split("\n"), [], [], 0
    for k, line in enumerate(lines):
        if line.strip():
            first = k if not current else first
            current.append(line)
        elif current:
            chunks.append((first, current))
            current = []
    chunks += [(first, current)] if current else []
    found = []
    for first, chunk in chunks:
        if any(">>>" in ln for ln in chunk):
            for ex in parse_examples(chunk) or parse_examples(mend_prompts(chunk)) or []:
                ex.lineno += first
                found.append(ex)
    return found
