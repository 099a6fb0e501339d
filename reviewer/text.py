"""Text helpers shared by every part of the reviewer: an error as one line for the user, the end of long output.

Standard library only; imports nothing from the reviewer, so anything may import it.
"""

from __future__ import annotations


def first_line(e: BaseException, *, with_type: bool = False) -> str:
    """The first line of an error's message: the whole of what a one-line report has room for. Without a message, the
    exception's type; `with_type` puts the type in front always ("OSError: disk full")."""
    lines = str(e).strip().splitlines()
    if with_type:
        return f"{type(e).__name__}: {lines[0] if lines else ''}".strip(": ")
    return lines[0] if lines else type(e).__name__


def squeeze(text: str, limit: int = 300) -> str:
    """All of `text` on one line (runs of whitespace and newlines become one space), cut to `limit` characters: a
    server's error message, which may span lines, as one line of a report."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def tail(text: str, limit: int) -> str:
    """The last `limit` characters of `text`, saying how many were left out before them."""
    return text if len(text) <= limit else f"[... {len(text) - limit} characters left out ...]\n" + text[-limit:]
