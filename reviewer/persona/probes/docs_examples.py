"""The scripts that run the docs' Python examples in the sandbox (docs_claims.py turns the outcomes into findings).

Each doc file's Python blocks run in order in one namespace, twice (two hash seeds), by sandboxed/examples.py, which
the script carries (runner.script); what counts as a claim, and what is left to the reader, is docs/probes.md,
section 1.
"""

from __future__ import annotations

from reviewer.persona.probes.runner import data, script


def examples_script(blocks: list[dict], package: str, only: int | None = None) -> str:
    """The check of one doc file's blocks (block_data's dicts); `only`, a line: the repro of that example alone."""
    return script("examples", "check_examples", {"blocks": data(blocks), "package": repr(package), "only": repr(only)})


def syntax_script(blocks: list[dict]) -> str:
    """The check that the blocks parse."""
    return script("syntax", "check_syntax", {"blocks": data(blocks)})
