"""Turning logits into a token: greedy, or temperature + nucleus (top-p) sampling. Imports nothing else of ours, so
the decoding loops, the drafter and its fast path share it without depending on each other."""

from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution a token is sampled from (float32, last dim), after temperature and nucleus (top-p)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, rng: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax(dim=-1))
    return int(torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=rng))
