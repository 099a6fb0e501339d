"""The DFlash drafter on the GPU fast path: what backend/models/fast.py is for the target, for backend/dflash/model.py's
DFlashDrafter. It is also the drafter's context (the engine keeps it where it keeps a DraftContext).

    fd = FastDrafter(drafter, max_context=8192)
    fd.add_pending(prompt_features)          # eager: the prompt's context keys/values, any length
    fd.launch(token=first_token)             # draft after a host-known token
    fd.launch(features=verify_feats, rows=k + 1, keep=keep_dev, token=bonus_dev)   # after a verify: all on device
    fd.block_tokens                          # [B] device: [token, draft 1, ..., draft B-1]
    fd.confidence                            # [B-1] device: the drafter's probability of each draft

Why it exists: eagerly the drafter of the released Qwen3.6 shape costs 10.8 ms a cycle on the H200 (tens of small
launches per layer, a mask and positions built on the host, the full-vocabulary head in fp32, a .tolist()), four
target steps. Here:
  - every layer's context keys/values live in one preallocated cache ([layers, kv heads, max_context + B, D]);
  - a cycle is one CUDA-graph replay, keyed by the feature rows to absorb (attention skips the columns past the
    context's length, so one graph serves every length; capture_graphs() takes them all before a server is ready):
    absorb the last verify's features (all its rows, written at the context's end; only `keep` of them count),
    advance the context length on the device by `keep`, then the block forward, the head over the drafted positions
    only, in the model dtype, and argmax + confidence (reviewer_kernels/argmax.py);
  - positions and the context length are device tensors and RoPE is gathered from tables, so nothing waits for the
    host: the speculative cycle reads one small result per cycle (backend/decoding/device_cycle.py);
  - attention runs through reviewer_kernels/block_attention.py on CUDA (block keys written to the cache and attended in
    the same launches, causal or bidirectional per layer, no mask): cuDNN's SDPA with a mask built every replay and two
    index_copy_ a layer were ~40% of the SmolLM2 drafter's GPU time (0.39 -> 0.25 ms a draft on the H200,
    bench/drafter_step.py). Layers with a sliding window (none shipped) keep SDPA and a device-built mask.
The arithmetic is DFlashDrafter's own (its modules are called), except that each layer's q/k/v and gate/up
projections run as one matmul each over fused weight rows (fuse_rows: the modules keep working on views of them, so
the weights are held once): two cuBLAS launches a layer instead of five, and one for the context's keys and values
instead of two (the fused rows' k/v part). The block's keys are written to the cache instead of concatenated. Draft
quality never touches the output: the target verifies every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.dflash.model import DFlashDrafter, rope
from backend.models.captures import note_capture
from backend.models.llama import fuse_rows, glue
from backend.sampling import sampling_probs
from reviewer_kernels.argmax import argmax_confidence
from reviewer_kernels.block_attention import MAX_BLOCK, block_attention, supports, write_block
from reviewer_kernels.fused_moe import triton_usable


class FastDrafter:
    def __init__(self, drafter: DFlashDrafter, max_context: int, *, cuda_graphs: bool | None = None,
                 compile: bool | None = None, min_span: int = 256):
        self.drafter = drafter
        cfg = drafter.cfg
        self.block_size = B = drafter.block_size
        weight = drafter.fc.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.max_context = int(max_context) + B  # room for the block past the last context position
        layers = drafter.layers
        kv_heads, head_dim = layers[0].self_attn.kv_heads, layers[0].self_attn.head_dim
        self.k = torch.zeros(len(layers), kv_heads, self.max_context, head_dim, device=self.device, dtype=self.dtype)
        self.v = torch.zeros_like(self.k)
        self.min_span = min_span
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        # torch.compile the per-layer glue (norms, projections, q/k norms, RoPE, residuals, MLP, head + argmax):
        # eagerly a draft of the SmolLM2 drafter is ~200 launches (0.92 ms in a graph on the H200), most of them
        # elementwise; compiled, the elementwise chains fuse
        self.compiled = (self.device.type == "cuda") if compile is None else compile
        self._pre, self._post, self._head, self._context, self._context_kv = (
            glue(f, self.compiled) for f in (_layer_pre, _layer_post, _head, _context, _context_kv))
        self.fused = [FusedProjections(layer) for layer in layers]
        # the block's attention through reviewer_kernels/block_attention.py (cache write + attention in two or three
        # launches, causal or bidirectional, no mask): on the H200 cuDNN's SDPA with a mask built per replay, and
        # two index_copy_ per layer, were ~40% of the SmolLM2 drafter's GPU time (bench/drafter_step.py --profile).
        # Eager CUDA runs (cuda_graphs=False) keep SDPA: the reference the graph test compares the kernel path with
        # sliding windows (the released Qwen3.6 drafter: 5 of 6 layers) go through the kernel's window too: through
        # SDPA the graphs were keyed by span, captured on the request path as a context grew (issue 39)
        self.block_kernel = (self.cuda_graphs and triton_usable(weight) and supports(head_dim)
                             and all(layer.sliding_window is None or layer.sliding_window >= MAX_BLOCK
                                     for layer in layers))
        # RoPE tables for every position, gathered by device positions inside the compiled glue (computed per replay
        # they were ~10 elementwise launches); the same fp32 arithmetic per position as drafter.rotary
        self.cos, self.sin = drafter.rotary(torch.arange(self.max_context, device=self.device), self.dtype)
        features = len(drafter.target_layer_ids) * cfg.hidden_size
        # graph inputs (static addresses)
        self.length_dev = torch.zeros(1, dtype=torch.long, device=self.device)  # context length on the device
        self.keep_dev = torch.zeros(1, dtype=torch.long, device=self.device)  # rows of the absorbed block to keep
        self.token_dev = torch.zeros(1, dtype=torch.long, device=self.device)  # the block's known token
        self.features = torch.zeros(B, features, device=self.device, dtype=self.dtype)  # last verify's features
        self._arange = torch.arange(B, device=self.device)
        self._ids = torch.full((B,), drafter.mask_token_id, dtype=torch.long, device=self.device)
        # graph outputs
        self.block_tokens = torch.zeros(B, dtype=torch.long, device=self.device)
        self.confidence = torch.zeros(B - 1, device=self.device)
        self.logits = None  # [B-1, draft vocab] of the last draft (sampling reads it)
        self.length = 0  # host mirror: context positions known to be absorbed (exact after each host sync)
        self._graphs: dict[tuple, tuple] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    # ---- the DraftContext interface the engine uses -------------------------------------------------------------

    @property
    def covered(self) -> int:
        return self.length

    def reset(self) -> None:
        self.set_length(0)

    def set_length(self, n: int) -> None:
        """The context covers exactly the first n positions (host and device agree)."""
        self.length = int(n)
        self.length_dev.fill_(self.length)

    def crop(self, n: int) -> None:
        if n < self.length:
            self.set_length(n)

    @torch.inference_mode()
    def add_pending(self, features: torch.Tensor) -> None:
        """Absorb target features [1, T, F] (a prompt, any length) at the context's end, eagerly."""
        feats = features.reshape(-1, features.shape[-1]).to(self.dtype)
        n = feats.shape[0]
        if n == 0:
            return
        if self.length + n > self.max_context - self.block_size:
            raise ValueError(f"drafter context of {self.max_context - self.block_size} positions exceeded")
        self._absorb(feats, torch.arange(self.length, self.length + n, device=self.device))
        self.set_length(self.length + n)

    # ---- drafting -------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, *, token=None, features=None, rows: int = 0, keep=None, upper_length: int | None = None):
        """Queue one draft on the device, returning at once. token: a host int, a one-element device tensor, or
        None when token_dev already holds it (the device cycle's acceptance test writes the verify's own token
        there). features [rows, F] (device): the last verify's features, absorbed before drafting, of which the
        first keep (1 <= keep <= rows: a device tensor, or None when keep_dev already holds it) are kept.
        upper_length: a host bound on the context length after absorbing (default: length + rows), which sets the
        attention span. Results land in block_tokens / confidence / logits."""
        if isinstance(token, int):
            self.token_dev.fill_(token)
        elif token is not None:
            self.token_dev.copy_(token.reshape(1))
        if rows:
            self.features[:rows].copy_(features[:rows])
        if keep is not None:
            self.keep_dev.copy_(keep.reshape(1))
        bound = upper_length if upper_length is not None else self.length + rows
        if bound + self.block_size > self.max_context:
            raise ValueError(f"drafter context of {self.max_context - self.block_size} positions exceeded")
        span = self._span(bound + self.block_size)
        if not self.cuda_graphs:
            self.logits = self._body(rows, span)
            return
        key = (rows, span)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(rows, span)
        graph, self.logits = entry
        graph.replay()

    def sample(self, temperature: float, top_p: float, rng: torch.Generator) -> torch.Tensor:
        """Sampling: replace the argmax drafts of the last launch by drafts sampled from the drafter's distribution,
        on the device. Returns q [B-1, target vocab], the distributions they were drawn from (rejection sampling
        needs them)."""
        d = self.drafter
        q = sampling_probs(self.logits, temperature, top_p)
        choice = torch.multinomial(q, 1, generator=rng)[:, 0]
        self.confidence.copy_(q.gather(1, choice[:, None])[:, 0])
        if d.draft_vocab is not None:
            choice = d.draft_vocab[choice]
            q = q.new_zeros(q.shape[0], d._vocab).index_copy_(1, d.draft_vocab, q)
        self.block_tokens[1:].copy_(choice)
        return q

    def _span(self, end: int) -> int:
        """Cache columns attended for a context ending at `end`: the whole cache through the block-attention kernel
        (it skips the columns past the length: one graph per rows for every length, as the target's graphs);
        through SDPA and a mask, a quarter of the enclosing power of two (few graphs, at most 25% masked columns)."""
        if self.block_kernel:
            return self.max_context
        quarter = max(self.min_span, (1 << (end - 1).bit_length()) // 4)
        return min(-(-end // quarter) * quarter, self.max_context)

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture, now, the graph of every cycle kind (a first draft after a prompt, and after a verify whose 1..B
        rows are absorbed), so that none is captured on the request path; returns how many are held. Only when the
        graphs are length-independent (the block kernel); the context is empty afterwards."""
        if not self.cuda_graphs or not self.block_kernel:
            return len(self._graphs)
        self.reset()
        self.launch(token=0)
        for rows in range(1, self.block_size + 1):
            self.reset()
            self.launch(token=0, features=self.features, rows=rows, keep=self._arange[:1] + 1)
        self.reset()
        return len(self._graphs)

    def _capture(self, rows: int, span: int):
        note_capture("drafter", (rows, span))
        return self._graph_of(lambda: self._body(rows, span))

    def _graph_of(self, body):
        """(graph, body's output): body run twice off the capture stream (compiled glue, cuBLAS and SDPA choices),
        then captured; the context length is put back after each run, so the caller's replay applies the effect
        once."""
        saved = self.length_dev.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.length_dev.copy_(saved)
                body()
        torch.cuda.current_stream().wait_stream(stream)
        self.length_dev.copy_(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = body()
        self.length_dev.copy_(saved)
        return graph, out

    def _absorb(self, feats: torch.Tensor, positions: torch.Tensor) -> None:
        """Context keys/values of `feats` [n, F] at `positions` [n] (device; consecutive) into every layer's
        cache."""
        d = self.drafter
        context = self._context(d, feats)  # [1, n, hidden]
        for i, (layer, w) in enumerate(zip(d.layers, self.fused)):
            # [1, kv heads, n, D]
            k, v = self._context_kv(layer, w.kv, w.kv_bias, context, self.cos, self.sin, positions)
            write_block(k[0], v[0], self.k[i], self.v[i], positions[:1], use_triton=self.block_kernel)

    def _body(self, rows: int, span: int) -> torch.Tensor:
        """What one graph replays: absorb `rows` features (keep of them), then draft the block after token.
        Returns the draft logits [B-1, draft vocab] (a graph's static output)."""
        d, B = self.drafter, self.block_size
        if rows:
            self._absorb(self.features[:rows], self.length_dev + self._arange[:rows])
            self.length_dev.add_(self.keep_dev)
        start = self.length_dev  # [1]
        positions = start + self._arange  # the block's positions
        ids = torch.cat([self.token_dev, self._ids[1:]])
        x = d._embed(ids)[None]
        if d.cfg.input_embedding_scale != 1.0:
            x = x * d.cfg.input_embedding_scale
        masks = {}
        for i, (layer, w) in enumerate(zip(d.layers, self.fused)):
            q, k, v = self._pre(layer, w.qkv, w.qkv_bias, x, self.cos, self.sin, positions)
            if self.block_kernel:  # [B, heads * D]
                out = block_attention(q[0], k[0], v[0], self.k[i], self.v[i], start, span, use_triton=True,
                                      causal=layer.causal, window=layer.sliding_window or 0)
            else:
                key = (layer.causal, layer.sliding_window)
                if key not in masks:  # one mask per kind of layer, built on the device
                    masks[key] = self._mask(layer, positions, start, span)
                self.k[i].index_copy_(1, positions, k[0])
                self.v[i].index_copy_(1, positions, v[0])
                attn = layer.self_attn
                out = F.scaled_dot_product_attention(q, self.k[i, :, :span][None], self.v[i, :, :span][None],
                                                     attn_mask=masks[key], enable_gqa=attn.heads != attn.kv_heads)
                out = out[0].transpose(0, 1).reshape(B, -1)
            x = self._post(layer, w.gate_up, x, out)
        logits = self._head(d, x)
        choice, confidence = argmax_confidence(logits)
        self.confidence.copy_(confidence)
        if d.draft_vocab is not None:
            choice = d.draft_vocab[choice]
        self.block_tokens[:1].copy_(self.token_dev)
        self.block_tokens[1:].copy_(choice)
        return logits

    def _mask(self, layer, positions, start, span: int) -> torch.Tensor:
        """SDPA's mask for one kind of layer (causal or not, sliding window), built on the device: the context
        before the block, and the block as the layer sees it. [1, 1, B, span] bool."""
        B = self.block_size
        cols = torch.arange(span, device=self.device)[None, :]
        query = positions[:, None]
        in_block = (cols >= start) & (cols < start + B)
        visible = (cols < start) | (in_block & (cols <= query) if layer.causal else in_block)
        if layer.sliding_window is not None:
            visible = visible & (query - cols < layer.sliding_window)
        return visible[None, None]


# ---- the glue, as plain functions so that torch.compile fuses them (llama.glue: compiled once per layer object) ----


def _context(drafter, feats):
    """The context vectors of target features [n, F]: hidden_norm(fc(features)), [1, n, hidden]."""
    return drafter.hidden_norm(drafter.fc(feats))[None]


def _context_kv(layer, w_kv, b_kv, context, cos_table, sin_table, positions):
    """One layer's context keys (normed, rotated at `positions`) and values, through the fused k/v rows."""
    return _keys_values(layer.self_attn, F.linear(context, w_kv, b_kv), cos_table[positions], sin_table[positions])


def _keys_values(attn, kv, cos, sin):
    """DraftAttention.keys_values after its projection: kv [1, n, 2 * kv heads * D] -> k (normed, rotated), v, each
    [1, kv heads, n, D]."""
    n = kv.shape[1]
    k, v = kv.view(1, n, 2, attn.kv_heads, attn.head_dim).unbind(2)
    return rope(attn.k_norm(k).transpose(1, 2), cos, sin), v.transpose(1, 2)


def _layer_pre(layer, w_qkv, b_qkv, x, cos_table, sin_table, positions):
    """Pre-norm, the fused q/k/v projection, q/k norms and RoPE (at `positions`) of one drafter layer for the block
    x [1, B, hidden]."""
    cos, sin = cos_table[positions], sin_table[positions]
    attn, h = layer.self_attn, layer.input_layernorm(x)
    n = h.shape[1]
    q, kv = F.linear(h, w_qkv, b_qkv).split([attn.heads * attn.head_dim, 2 * attn.kv_heads * attn.head_dim], -1)
    q = attn.q_norm(q.view(1, n, attn.heads, attn.head_dim)).transpose(1, 2)
    k, v = _keys_values(attn, kv, cos, sin)
    return rope(q, cos, sin), k, v


def _layer_post(layer, w_gate_up, x, attn_out):
    """Output projection of the attention rows attn_out [B, heads * D] + residual, then the MLP (its gate and up
    projections fused) + residual."""
    x = x + layer.self_attn.o_proj(attn_out[None])
    mlp = layer.mlp
    gate, up = F.linear(layer.post_attention_layernorm(x), w_gate_up).chunk(2, dim=-1)
    return x + mlp.down_proj(mlp.act(gate) * up)


class FusedProjections:
    """One drafter layer's fused weight rows: [q; k; v] (kv: its k/v rows, a view) and [gate; up]."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.qkv = fuse_rows(parts, "weight")
        self.qkv_bias = fuse_rows(parts, "bias") if attn.q_proj.bias is not None else None
        q_rows = attn.q_proj.weight.shape[0]
        self.kv = self.qkv[q_rows:]
        self.kv_bias = self.qkv_bias[q_rows:] if self.qkv_bias is not None else None
        self.gate_up = fuse_rows([mlp.gate_proj, mlp.up_proj], "weight")


def _head(drafter, x):
    """The drafted positions only: 15 rows of the head, in the model dtype (their argmax and the drafter's probability
    of it come from reviewer_kernels/argmax.py: compiled here, the three row reductions ran one program per row)."""
    return drafter.logits(drafter.norm(x)[0, 1:])
