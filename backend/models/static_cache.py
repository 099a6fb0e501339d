"""Preallocated caches for the fast models (backend/models/): fixed shapes and addresses, so a decode step or a block
verify can be captured once in a CUDA graph and replayed.

KVCache           attention keys/values [layers, kv_heads, capacity, head_dim]. Rolling back is free: positions
                  past the accepted length are masked out and overwritten by the next forward. On CUDA the capacity
                  is the whole window from the start (CUDA graphs bake in the addresses); elsewhere it grows with use
                  (reserve), so an idle server does not hold a window it has not used (the embedded model's 8192
                  tokens were 361 MB in fp32).
LinearStateCache  Gated DeltaNet layers: the causal-conv window (the last K-1 conv inputs) and the recurrent state
                  (fp32). A *recorded* forward (a speculative verify) leaves both untouched and writes instead the
                  conv window of the whole block and the block's recurrence inputs
                  (reviewer_kernels/gdn_state.gdn_verify); `accept(n)` then runs the first n of them through the
                  recurrence for all layers in one launch (gdn_replay) and copies the conv window's tail into place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.models.captures import note_capture
from reviewer_kernels.block_attention import MAX_BLOCK, supports
from reviewer_kernels.fused_moe import triton
from reviewer_kernels.gdn_state import GdnRecord, gdn_replay


class KVCache:
    INITIAL_COLUMNS = 256  # a growable cache's first capacity: a short chat turn fits without growing

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_context: int, device, dtype,
                 growable: bool | None = None):
        self.max_context = max_context
        self.growable = torch.device(device).type != "cuda" if growable is None else growable
        capacity = min(max_context, self.INITIAL_COLUMNS) if self.growable else max_context
        self.k = torch.zeros(layers, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        # reviewer_kernels/block_attention (cache write + attention in one or two launches) for blocks of up to 16
        # tokens on CUDA; FastModel turns it off in exact mode, whose numerics must not depend on how a position
        # was computed
        self.block_kernel_available = triton is not None and self.k.is_cuda and supports(head_dim)
        self.use_block_kernel = self.block_kernel_available

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, columns: int) -> None:
        """Make room for `columns` positions (a forward about to attend over them): a growable cache doubles (at
        least) up to max_context, copying what it holds. New columns are zeros, as a preallocated cache's unwritten
        ones are: masked columns then add exact zeros, so results do not depend on the capacity. Each layer's keys
        keep the same layout ([kv_heads, positions, head_dim], head_dim contiguous); only the distance between
        heads changes, which attention reads per head."""
        if columns <= self.capacity:
            return
        if not self.growable or columns > self.max_context:
            raise ValueError(f"{columns} cache positions requested; this cache holds {self.capacity}")
        capacity = min(max(columns, 2 * self.capacity), self.max_context)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, :old.shape[2]] = old
            setattr(self, name, new)

    def block_kernel(self, tokens: int) -> bool:
        """Whether `tokens` new tokens attend through reviewer_kernels/block_attention (else write + SDPA)."""
        return self.use_block_kernel and tokens <= MAX_BLOCK

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int):
        """Store k, v [kv_heads, T, head_dim] at `positions` (a device tensor: no host sync, graph-safe); return this
        layer's keys and values over the first kv_len positions."""
        self.k[layer].index_copy_(1, positions, k)
        self.v[layer].index_copy_(1, positions, v)
        return self.k[layer, :, :kv_len], self.v[layer, :, :kv_len]

    def nbytes_per_token(self) -> int:
        return 2 * self.k[:, :, 0].numel() * self.k.element_size()


@dataclass
class LinearSnapshot:
    """Gated DeltaNet states at some cache length (a prompt checkpoint the engine can come back to)."""
    length: int
    conv: torch.Tensor
    state: torch.Tensor


class LinearStateCache:
    def __init__(self, layers: int, conv_dim: int, conv_kernel: int, value_heads: int, key_dim: int, value_dim: int,
                 max_block: int, device, dtype, key_heads: int | None = None):
        key_heads = key_heads or value_heads
        self.width = conv_kernel - 1  # inputs the next token's convolution needs
        self.conv = torch.zeros(layers, self.width, conv_dim, device=device, dtype=dtype)
        self.state = torch.zeros(layers, value_heads, key_dim, value_dim, device=device, dtype=torch.float32)
        self.conv_window = torch.zeros(layers, self.width + max_block, conv_dim, device=device, dtype=dtype)
        # a verify's recurrence inputs (reviewer_kernels/gdn_state.gdn_verify): accept() replays the kept ones.
        # Per-token states instead would be 1 GB of writes per 16-token verify at the 35B-A3B shape, and 960 MB
        # of memory
        self.record = GdnRecord.empty(layers, max_block, key_heads, key_dim, value_heads, value_dim, device, dtype)
        self.max_block = max_block
        # accept() as a CUDA graph per keep (FastModel turns this on with its own graphs): the replay's Triton launch
        # from Python cost the speculative cycle 0.25 ms of host time on its critical path (H200, 2026-12-02)
        self.cuda_graphs = False
        self._accept_graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def accept(self, keep: int) -> None:
        """After a recorded forward: take the states after the first `keep` block tokens (1 <= keep <= block)."""
        if not 1 <= keep <= self.max_block:
            raise ValueError(f"keep must be in [1, {self.max_block}], got {keep}")
        if not self.cuda_graphs:
            self._accept(keep)
            return
        graph = self._accept_graphs.get(keep)
        if graph is None:
            note_capture("gated deltanet accept", keep)
            self.states_after(keep)  # compiles the replay kernel for these tensors, off the live state
            graph = self._accept_graphs[keep] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # recorded, not run
                self._accept(keep)
        graph.replay()

    def _accept(self, keep: int) -> None:
        gdn_replay(self.record, self.state, keep)
        self.conv.copy_(self.conv_window[:, keep:keep + self.width])

    def states_after(self, keep: int) -> torch.Tensor:
        """What accept(keep) would make the states, leaving them as they are (for comparisons: bench/layer_diff)."""
        states = self.state.clone()
        gdn_replay(self.record, states, keep)
        return states

    def reset(self) -> None:
        self.conv.zero_()
        self.state.zero_()

    def snapshot(self, length: int) -> LinearSnapshot:
        return LinearSnapshot(length, self.conv.clone(), self.state.clone())

    def restore(self, snap: LinearSnapshot) -> None:
        self.conv.copy_(snap.conv)
        self.state.copy_(snap.state)

    def nbytes_state(self) -> int:
        """Bytes a forward must read of these states (and write back, on a decode step)."""
        return self.conv.numel() * self.conv.element_size() + self.state.numel() * 4
