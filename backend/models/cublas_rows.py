"""Does cuBLAS compute a row of x @ W^T the same, bit for bit, whatever the number of rows beside it (1..16)?

cuBLAS picks its kernel by shape, and a kernel with another split of the reduction rounds differently, so nothing
promises that a decode step (1 row) and a verify block (16 rows) get the same bits from F.linear. On the H200 with
torch 2.11 / CUDA 13 they do at every projection shape we serve (bench/cublas_padded_rows.py,
bench/results/cublas_padded_rows_h200_20261201.json), and a 16-row call costs what a one-row call does, which makes a
verify through cuBLAS nearly as cheap as a step. That is a property of one build on one GPU, so a model that relies on
it asks this check on its own weights at load, on its device, eagerly and inside a CUDA graph (as the engine replays
it), and keeps its own batch-invariant kernels where the answer is no.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_rows_invariant(weights: list[torch.Tensor], rows: int = 16, seed: int = 0) -> bool:
    """True when for every weight F.linear gives each row of x the same bits for every row count 1..rows and
    whatever its neighbours (rolled, or replaced by other values, as padded rows are), eagerly and replayed from a
    CUDA graph (on CUDA). Padded 16-row steps need only the latter; the former is checked too, so that a build
    whose algorithm depends on the row count is noticed."""
    for w in weights:
        gen = torch.Generator(device=w.device).manual_seed(seed)
        x = torch.randn(rows, w.shape[1], generator=gen, device=w.device).to(w.dtype)
        other = torch.randn(rows, w.shape[1], generator=gen, device=w.device).to(w.dtype)
        full = F.linear(x, w)
        if any(not torch.equal(F.linear(x[:m], w), full[:m]) for m in range(1, rows)):
            return False
        if not torch.equal(F.linear(x.roll(rows // 2 + 1, 0), w), full.roll(rows // 2 + 1, 0)):
            return False
        mixed = torch.cat([x[:1], other[1:]])  # row 0 among other neighbours
        if not torch.equal(F.linear(mixed, w)[:1], full[:1]):
            return False
        if w.is_cuda and not _same_in_a_graph(x, w, full):
            return False
    return True


def _same_in_a_graph(x: torch.Tensor, w: torch.Tensor, full: torch.Tensor) -> bool:
    """One-row and all-row calls captured in a CUDA graph (where cuBLAS may get another workspace) equal the eager
    all-row result."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture, as FastModel._capture does
        F.linear(x[:1], w), F.linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one, many = F.linear(x[:1], w), F.linear(x, w)
    graph.replay()
    torch.cuda.synchronize(x.device)
    return bool(torch.equal(one, full[:1]) and torch.equal(many, full))
