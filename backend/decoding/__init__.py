"""Decoding: the engine (plain and speculative generation with prefix reuse), the targets it drives and their caches,
the speculative cycles (see README.md in this folder)."""
