"""The docs' Python that does not parse, found inside the sandbox: compiled as the project's own Python compiles it
(the host half: check_syntax in reviewer/persona/probes/docs_claims.py)."""

from __future__ import annotations

import ast
import re
import textwrap

from .doctests import doctest_examples
from .prelude import emit

# (IPython's magics: `%load_ext dotenv`, `%%time`, python-dotenv's README)
FRAGMENT = re.compile(r"\.\.\.|…|\{\{|\{%|^\s*(\$ |%{1,2}\w|% |!|In \[\d*\]:|pip install)", re.M)
PARTIAL = re.compile(r"outside (async )?function|outside loop|not properly in loop|'await' outside")


def compiles(text):
    try:
        compile(textwrap.dedent(text), "<docs>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
        return True
    except (SyntaxError, ValueError, OverflowError):
        return False


def prompt_slip(pieces, i):
    """The failing example i is right once joined to its neighbours, or to the lines doctest took for output."""
    want = pieces[i][2].splitlines(keepends=True)
    if any(compiles(pieces[i][1] + "".join(want[:m])) for m in range(1, min(len(want), 20) + 1)):
        return True
    return any(compiles("".join(p[1] for p in pieces[j:k + 1]))
               for j in range(max(0, i - 10), i + 1) for k in range(i, min(len(pieces), i + 10)))


def syntax_errors(blocks):
    """The docs' Python that does not parse: each block (each `>>>` example of a doctest block) compiled as the
    project's Python compiles it. Deliberate fragments are left alone: `...` or `…` in it, a `<placeholder>` on the
    failing line, a signature shown without its body (`def f(x)`, `class A(B)`), `return`/`yield`/`break` outside
    their function or loop (a piece of a body), a trailing `def f():` whose body the docs leave out, shell lines and
    IPython magics in a python block, tracebacks (pytb), templates (`{{`, `{%`). Nor a slip of the prompts in code
    that is right as the reader copies it: continuation lines written with `>>>` (addict's `>>>     def
    __missing__`) or without `...` (simpleeval's second line of a call, doctest's "output"), two spaces after `>>>`."""
    found = []
    for block in blocks:
        lang = block.get("lang", "")
        if lang in ("pytb", "ipython"):
            continue
        if block["doctest"]:
            pieces = [(block["line"] + ex.lineno, ex.source, ex.want) for ex in doctest_examples(block["text"])]
        elif lang in ("pycon", "doctest", "pyrepl"):
            continue  # a console block without prompts is output
        else:
            pieces = [(block["line"], block["text"], "")]
        for i, (first, source, _) in enumerate(pieces):
            if FRAGMENT.search(source):
                continue
            try:
                compile(source, block["file"], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
                continue
            except SyntaxError as e:
                error = e
            except (ValueError, OverflowError):  # a NUL byte, a literal too large: not what a reader sees
                continue
            lines = source.splitlines()
            n = max(1, min(error.lineno or 1, len(lines) or 1))
            bad = lines[n - 1] if lines else ""
            signature = re.match(r"^\s*(async\s+def|def|class)\s", bad) and not bad.rstrip().endswith(":")
            body_left_out = "expected an indented block" in str(error.msg) and n >= len(lines)
            if PARTIAL.search(str(error.msg)) or signature or body_left_out or re.search(r"<\w[^<>]*>", bad) \
                    or (block["doctest"] and prompt_slip(pieces, i)):
                continue
            found.append({"file": block["file"], "line": first + n - 1, "msg": str(error.msg), "text": bad,
                          "offset": error.offset, "source": source})
    return found


def check_syntax(blocks):
    """The check script's entry: the blocks' syntax errors, exit 1 when there is one."""
    errors = syntax_errors(blocks)
    emit({"errors": errors[:50]})
    return 1 if errors else 0
