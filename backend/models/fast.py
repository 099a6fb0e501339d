"""FastModel: what the engine drives on the fast path. Owns the cache length, runs prefill / decode / verify over one of
the model files (llama.py, qwen3_5_moe.py), rolls back to an accepted prefix, and on CUDA replays each decode step and
each block verify from a CUDA graph.

    fm = FastModel(model, max_context=8192)
    logits, feats = fm.prefill(prompt_ids, hidden_ids=drafter.target_layer_ids)   # logits [V] after the prompt
    logits, _ = fm.decode(token)                                                  # one plain step
    logits, feats = fm.verify([token, *draft])                                     # logits [T, V]
    fm.accept(accepted + 1)                                                        # keep that many block tokens
    snap = fm.snapshot(); ...; fm.restore(snap)                                    # prompt checkpoints

Invariant: fm.length tokens are in the caches. Between verify() and accept() the caches hold the block tentatively
(attention KV written, Gated DeltaNet states not advanced); every other call is refused until accept().

CUDA graphs: one per (kind, tokens, hidden_ids). Attention (reviewer_kernels/block_attention.py) reads the cache length
from the positions, which live in a static device buffer like the tokens, and visits only the filled columns, so a graph
captured at one length replays at every length up to max_context: capture_graphs() captures all of them once, before
a server says ready, and nothing is captured on the request path. (Where attention falls back to SDPA with a mask,
e.g. a head dim the kernel does not take, graphs stay keyed by a rounded attention span: see _span.) Capturing runs
the forward (warm-up and capture); the Gated DeltaNet states are saved before and put back after, so capture never
changes the caches. Each capture is counted in backend/models/captures.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.models.captures import note_capture
from backend.models.numerics import EXACT_SPAN, Numerics


# On CUDA a prefill forward takes up to the targets' chunk (backend/decoding/target.py), so an agent turn's ~1,700 new
# tokens go in one piece: a piece of an MoE model reads nearly every expert's weights whatever its length (1,024
# tokens wake all 256 of the 35B-A3B shape's), and two pieces of 1,024 + 676 read them twice
CUDA_PREFILL_CHUNK = 2048


@dataclass
class Snapshot:
    length: int
    linear: object  # LinearSnapshot, or None for models without linear-attention state


class FastModel:
    def __init__(self, model, max_context: int, max_block: int = 16, *, cuda_graphs: bool | None = None,
                 compile: bool | str = False, prefill_chunk: int | None = None, min_span: int = 256,
                 numerics: Numerics | None = None):
        """numerics: which kernels decode steps and verifies run (backend/models/numerics.py; the model reads it in
        setup_caches, once; default Numerics(): the one-token path). prefill_chunk: tokens a prefill forward takes
        at most (default: CUDA_PREFILL_CHUNK on CUDA, else 1024)."""
        self.model = model
        self.config = model.config
        self.device = model.embed.device
        self.dtype = model.embed.dtype
        self.max_context = int(max_context)
        self.max_block = int(max_block)
        self.prefill_chunk = prefill_chunk or (CUDA_PREFILL_CHUNK if self.device.type == "cuda" else 1024)
        self.min_span = min_span
        self.vocab_size = model.config.vocab_size
        model.setup_caches(self.max_context, self.max_block, numerics)
        self.span_multiple = EXACT_SPAN if self.numerics.exact else 0  # exact mode's padding (decoding/target.py)
        self.length = 0
        self._pending = 0  # block size of a verify awaiting accept()
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        if getattr(model, "linear", None) is not None:
            model.linear.cuda_graphs = self.cuda_graphs  # accept() replays a graph too
        # torch.compile for decode steps and verifies; prefill stays eager, its time is in the matmuls.
        #   True / "glue": the per-layer glue functions (two compiles each: one token, then any block size)
        #   "full": the whole forward, layers unrolled, our Triton kernels called from inside (one compile per
        #           (tokens, span) key: for benchmarks of how far fusion goes; slow to warm up)
        if compile not in (False, True, "glue", "full"):
            raise ValueError(f"compile must be False, True, 'glue' or 'full', got {compile!r}")
        self.compile = "glue" if compile is True else compile
        self._full_forward = None
        self._graphs: dict[tuple, tuple] = {}
        # the graphs' inputs: tokens in row 0, positions in row 1, written by one copy per call (_stage)
        self._inputs = torch.zeros(2, self.max_block, dtype=torch.long, device=self.device)
        self._tokens, self._positions = self._inputs[0], self._inputs[1]
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self._host = self._host_view = self._staged = None  # pinned twin of _inputs, made on the first replay

    @property
    def numerics(self) -> Numerics:
        """The record the model runs (given at construction)."""
        return self.model.numerics

    @property
    def span_multiple(self) -> int:
        """> 0 (exact mode: EXACT_SPAN where the record's kind is "exact"; decoding/target.py): every eager call
        attends over a multiple of this many cache columns (the masked ones add exact zeros), so a position's logits
        do not depend on how far the cache happened to reach. It also turns off reviewer_kernels/block_attention, whose
        block tokens take another path than cached ones."""
        return self._span_multiple

    @span_multiple.setter
    def span_multiple(self, columns: int) -> None:
        self._span_multiple = int(columns)
        if self.model.kv is not None:
            self.model.kv.use_block_kernel = self.model.kv.block_kernel_available and not columns
        if getattr(self, "_graphs", None):  # captured under the old setting
            self.drop_graphs()

    @property
    def hybrid(self) -> bool:
        """True when the model carries Gated DeltaNet state: then a cache can only be cut back to its full length,
        an accepted block prefix, or a snapshot."""
        return self.model.linear is not None

    # ---- state ----------------------------------------------------------------------------------------------------

    def reset(self) -> None:
        self.length, self._pending = 0, 0
        if self.hybrid:
            self.model.linear.reset()

    def truncate(self, n: int) -> None:
        """Forget tokens past the first n. Always possible for pure-attention models; hybrid models keep no per-token
        record of their linear states, so for them only n == length (or restore() a snapshot)."""
        self._check_idle()
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate {self.length} cached tokens to {n}")
        if self.hybrid and n != self.length:
            raise ValueError("a hybrid (Gated DeltaNet) cache cannot be cut back; restore a snapshot instead")
        self.length = n

    def snapshot(self) -> Snapshot:
        self._check_idle()
        linear = self.model.linear.snapshot(self.length) if self.hybrid else None
        return Snapshot(self.length, linear)

    def restore(self, snap: Snapshot) -> None:
        """Back to a snapshot. The attention KV of its first snap.length tokens must be unchanged since it was taken
        (the caller restores only onto a common prefix, as backend/decoding/engine.py does for prompt checkpoints)."""
        self._check_idle()
        if snap.length > self.length:
            raise ValueError("the snapshot lies past the cached tokens")
        if snap.linear is not None:
            self.model.linear.restore(snap.linear)
        self.length = snap.length

    def _check_idle(self) -> None:
        if self._pending:
            raise RuntimeError("a verified block awaits accept()")

    # ---- forward passes ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, tokens, hidden_ids: tuple[int, ...] = (), *, block: int = 0):
        """Append `tokens` (prompt or any run of known tokens). Returns (logits [V] after the last one, features
        [T, F] for all of them, or None without hidden_ids).

        block > 0 (exact mode; pure-attention models): every forward holds exactly `block` rows, the last one padded,
        so a token's results do not depend on where its chunk started or on whether it was decoded instead (a CPU
        bf16 matmul picks its algorithm by row count: rows of a 16-row and of a 300-row matmul round differently)."""
        self._check_idle()
        ids = _as_ids(tokens, self.device)
        if ids.numel() == 0:
            raise ValueError("nothing to prefill")
        if block and self.hybrid:
            raise ValueError("a padded prefill would advance the Gated DeltaNet state over the padding")
        feats, logits = [], None
        step = block or self.prefill_chunk
        for start in range(0, ids.numel(), step):
            piece = ids[start:start + step]
            n = piece.numel()
            if block:
                piece = torch.cat([piece, piece.new_zeros(block - n)])
            last = start + step >= ids.numel()  # only the last chunk's logits are returned
            logits, f = self._forward(piece, record=False, all_logits=bool(block) and last,
                                      hidden_ids=tuple(hidden_ids), graph=False, compiled=False)
            if block:  # forget the padding (its keys sit past the length: masked, then overwritten)
                self.length -= block - n
                logits, f = (logits[:n] if last else logits), (f[:n] if f is not None else None)
            feats.append(f)
        return logits[-1], (torch.cat(feats) if hidden_ids else None)

    @torch.inference_mode()
    def decode(self, token: int, hidden_ids: tuple[int, ...] = ()):
        """One plain step. Returns (logits [V], features [1, F] or None)."""
        self._check_idle()
        logits, feats = self._forward([int(token)], record=False, all_logits=False, hidden_ids=tuple(hidden_ids),
                                      graph=self.cuda_graphs, compiled=self.compile)
        return logits[-1], feats

    @torch.inference_mode()
    def verify(self, tokens, hidden_ids: tuple[int, ...] = (), *, fresh: bool = True):
        """Run a block (the last committed token + drafts) with logits for every position. The caches hold the block
        tentatively until accept(n), or abandon(). Returns (logits [T, V], features [T, F] or None). fresh=False:
        from a CUDA graph, its own output buffers rather than copies, valid until the next forward (for a caller
        whose readers are queued before it: two copies fewer on the device's critical path)."""
        self._check_idle()
        ids = tokens.reshape(-1) if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
        T = len(ids)
        if not 1 <= T <= self.max_block:
            raise ValueError(f"a verify block holds 1..{self.max_block} tokens, got {T}")
        out = self._forward(ids, record=self.hybrid, all_logits=True, hidden_ids=tuple(hidden_ids),
                            graph=self.cuda_graphs, compiled=self.compile, fresh=fresh)
        self._pending = T
        return out

    def accept(self, keep: int) -> None:
        """Keep the first `keep` tokens of the verified block (1..T): the caches then hold exactly those."""
        if not self._pending:
            raise RuntimeError("accept() without a verified block")
        if not 1 <= keep <= self._pending:
            raise ValueError(f"keep must be in [1, {self._pending}], got {keep}")
        if self.hybrid:
            self.model.linear.accept(keep)
        self.length += keep - self._pending
        self._pending = 0

    def abandon(self) -> None:
        """Drop the verified block: the caches hold what they held before it (a verify leaves the live Gated DeltaNet
        state alone and writes keys/values only past the cached length)."""
        self.length -= self._pending
        self._pending = 0

    def _forward(self, ids, *, record: bool, all_logits: bool, hidden_ids: tuple, graph: bool, compiled: bool,
                 fresh: bool = True):
        """ids: a list of ints or a tensor (on any device)."""
        T = len(ids)
        if self.length + T > self.max_context:
            raise ValueError(f"{self.length} cached + {T} new tokens exceed the context of {self.max_context}")
        if not graph:
            ids = _as_ids(ids, self.device)
            positions = torch.arange(self.length, self.length + T, device=self.device)
            end = self.length + T
            if self.span_multiple:
                end = min(-(-end // self.span_multiple) * self.span_multiple, self.max_context)
            elif self.model.kv is not None and self.model.kv.block_kernel(T):
                # as the graphs do: the kernel skips the columns past the length, and its launch shape (so its
                # compiled variant) stays one for every length, on the request path too
                end = self.max_context
            if self.model.kv is not None:
                self.model.kv.reserve(end)  # a CPU cache grows with use (static_cache.KVCache); CUDA's is whole
            out = self._run(ids, positions, end, record, all_logits, hidden_ids, compiled,
                            lower_right=end == self.length + T)
        else:
            out = self._replay(ids, record, all_logits, hidden_ids, compiled, fresh)
        self.length += T
        return out

    def _run(self, ids, positions, kv_len, record, all_logits, hidden_ids, compiled, lower_right: bool = False):
        """One model forward; `compiled` (a decode step or verify of a compiling FastModel) picks the compile mode.
        lower_right: positions end at kv_len - 1 (an eager call over exactly the filled columns)."""
        if compiled == "full":
            if self._full_forward is None:
                import torch._dynamo

                # one graph per (tokens, span): more than dynamo's default of 8 before it gives up and runs eagerly
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
                self._full_forward = torch.compile(self.model.forward, dynamic=False)
            return self._full_forward(ids, positions, kv_len, record=record, all_logits=all_logits,
                                      hidden_ids=hidden_ids, compiled=False, lower_right=lower_right)
        return self.model(ids, positions, kv_len, record=record, all_logits=all_logits, hidden_ids=hidden_ids,
                          compiled=bool(compiled), lower_right=lower_right)

    # ---- CUDA graphs ----------------------------------------------------------------------------------------------

    def _span(self, end: int) -> int:
        """Cache columns a graph attends over for a cache ending at `end`. Through the block-attention kernel (or
        without attention layers): the whole cache, one graph for every length, since the kernel skips the columns
        past the length. Through SDPA and a mask: rounded up to a quarter of the enclosing power of two (at most 25%
        of the KV read wasted on masked columns; ~4 graphs per doubling of the context)."""
        kv = self.model.kv
        if kv is None or kv.use_block_kernel:
            return self.max_context
        quarter = max(self.min_span, (1 << (end - 1).bit_length()) // 4, self.span_multiple)
        return min(-(-end // quarter) * quarter, self.max_context)

    def drop_graphs(self) -> None:
        """Forget captured graphs (after changing anything they baked in, e.g. a benchmark's routing override)."""
        self._graphs.clear()
        if self.cuda_graphs:
            # a fresh memory pool: the old one may outlive its graphs (blocks still held by compiled code's
            # caches), and capturing into a pool whose graphs are gone trips an allocator assert (seen on the H200)
            self._pool = torch.cuda.graph_pool_handle()

    def _stage(self, ids, T: int) -> None:
        """Tokens and positions into the graphs' input buffer. A decode step cannot start on the GPU before this
        is done, so it is one asynchronous copy from a pinned host buffer, filled through a numpy view (a torch op
        costs microseconds of host time; allocating pinned memory per call cost 18 us, a device tensor + copy +
        arange kernel ~180 us under cProfile on the H200 machine). The event makes sure the previous copy has left
        the buffer before it is overwritten. Ids already on the device are copied device to device."""
        if self._host is None:
            self._host = torch.zeros(2, self.max_block, dtype=torch.long, pin_memory=True)
            self._host_view = self._host.numpy()
            self._staged = torch.cuda.Event()
        else:
            self._staged.synchronize()
        self._host_view[1, :T] = range(self.length, self.length + T)
        on_device = isinstance(ids, torch.Tensor) and ids.device.type != "cpu"
        if not on_device:
            self._host_view[0, :T] = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        self._inputs.copy_(self._host, non_blocking=True)
        self._staged.record()
        if on_device:
            self._tokens[:T].copy_(ids)

    def _replay(self, ids, record, all_logits, hidden_ids, compiled, fresh: bool = True):
        T = len(ids)
        self._stage(ids, T)
        key = (T, self._span(self.length + T), record, all_logits, hidden_ids, compiled)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(*key)
        graph, (logits, feats) = entry
        graph.replay()
        if not fresh:
            return logits, feats
        return logits.clone(), (feats.clone() if feats is not None else None)

    @torch.inference_mode()
    def capture_graphs(self, hidden_ids: tuple[int, ...] = (), verify: bool = True) -> int:
        """Capture, now, every graph a decode step and (verify=True) a verify of 1..max_block tokens with
        `hidden_ids` features, and its Gated DeltaNet accept, will replay, so that none is captured on the request
        path; returns how many are held. Only when every key is length-independent (see _span), on an idle model;
        the caches and the length are as before."""
        if not self.cuda_graphs or self._span(1) != self.max_context:
            return len(self._graphs)
        self._check_idle()
        snap = self.snapshot()
        self.decode(0)
        self.restore(snap)
        if verify:
            for T in range(1, self.max_block + 1):
                self.verify([0] * T, tuple(hidden_ids))
                if self.hybrid:  # the accept graph for keep = T (its replay advances the states: put them back)
                    self.accept(T)
                    self.restore(snap)
                else:
                    self.abandon()
        return len(self._graphs)

    def _capture(self, T, span, record, all_logits, hidden_ids, compiled):
        note_capture("target", (T, span, record, all_logits, hidden_ids, compiled))
        saved = self.model.linear.snapshot(self.length) if self.hybrid else None
        run = lambda: self._run(self._tokens[:T], self._positions[:T], span, record,  # noqa: E731
                                all_logits, hidden_ids, compiled)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture (torch.compile / Triton compile, cuBLAS picks)
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = run()
        if saved is not None:
            self.model.linear.restore(saved)
        return graph, out


def _as_ids(tokens, device) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        return tokens.reshape(-1).to(device=device, dtype=torch.long)
    return torch.tensor([int(t) for t in tokens], dtype=torch.long, device=device)
