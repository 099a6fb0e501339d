"""When a reply ends, one StopPolicy per request, applied in one place: EngineWorker, on the engine thread, as the
engine yields (worker.py).

Stop ids (the model's end-of-turn tokens) travel to the engine in SamplingParams.stop_token_ids: a speculative block
is cut at one there, so the caches never keep a token past it. Stop strings (the request's `stop` /
`stop_sequences`) are matched against the detokenized text by StopText as each block arrives; on a match the worker
closes the engine's generator at that yield (which leaves the engine consistent, as any early close does) and the
reply finishes with "stop". The text the client sees is cut right before the earliest stop string, and while the
text ends in what may be the start of one, that tail is held back, so a streamed reply equals the unstreamed one.
"""
from __future__ import annotations

from dataclasses import dataclass

from backend import chat


@dataclass(frozen=True)
class StopPolicy:
    """What ends one reply: token ids (never emitted) and strings (never emitted; empty ones are ignored)."""

    ids: tuple[int, ...] = ()
    strings: tuple[str, ...] = ()

    @classmethod
    def of(cls, ids, strings: str | list[str] | None) -> StopPolicy:
        """From the server's stop ids and a request's `stop` field (a string, a list of them, or None)."""
        if isinstance(strings, str):
            strings = [strings]
        return cls(tuple(int(t) for t in ids), tuple(s for s in strings or () if s))


class StopText:
    """One reply's text under a StopPolicy: token ids in, text deltas out (incrementally detokenized), cut before the
    earliest stop string, holding back a tail that may still become one. `matched`: the stop string that ended it."""

    def __init__(self, policy: StopPolicy, tokenizer):
        self.detokenizer = chat.IncrementalDetokenizer(tokenizer)
        self.strings = chat.StopStrings(list(policy.strings))

    @property
    def matched(self) -> str | None:
        return self.strings.matched

    def push(self, token_ids: list[int]) -> str:
        return self.strings.push(self.detokenizer.push(token_ids))

    def flush(self) -> str:
        """The held-back text once the reply ends (nothing after a match)."""
        return self.strings.push(self.detokenizer.flush()) + self.strings.flush()
