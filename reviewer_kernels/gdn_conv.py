"""The Gated DeltaNet's short causal convolution for a decode step or verify block, with its cache update, in one launch.

    qkv = gdn_conv(mixed, conv_state, conv_w, T)                      # a decode step: conv_state <- the last inputs
    qkv = gdn_conv(mixed, conv_state, conv_w, T, window_out=window)   # a verify: the whole window kept for accept()

mixed [R, C] are the projected [q; k; v] columns of R >= T rows (a padded step: R = 16, the first T real), conv_state
[W, C] the last W inputs before them, conv_w [C, W + 1] the depthwise kernel. Row r of the result is
silu(sum_j window[r + j] * conv_w[:, j]) over window = [conv_state; mixed] (transformers' causal_conv1d_update: the
products in fp32, added in j order, rounded to the input dtype, then SiLU rounded again), for every one of the R rows;
rows past T read padding, and nothing reads them. Then either conv_state becomes window[T:T + W] (the W inputs before
the next token) or window_out[:W + T] receives window[:W + T] (a verify: LinearStateCache.accept copies the kept
part later).

Why a kernel: in the compiled glue the window's concatenation, the convolution with SiLU, and the cache copy were
three launches a Gated DeltaNet layer (30 layers a step at the 35B-A3B shape), ~4 us of kernels and their gaps.
Each program owns a slice of channels and loads every input it needs before it stores anything, so the in-place
update of conv_state is safe. The rounding points are the glue's; SiLU itself may round an ulp apart from PyTorch's.
Decode steps and verifies both run this kernel, row by row alike, so their bits agree.

    qkv = gdn_conv_prefill(mixed, conv_state, conv_w)                 # a prefill piece: every row real, any length

A prefill piece (hundreds of rows) runs in row blocks side by side instead, and moves the conv state on afterwards in
a small second launch; its eager glue was ~12 launches over [T, C] in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reviewer_kernels.fused_moe import triton, triton_usable

BLOCK_C = 64  # channels a program: 8,192 at the 35B-A3B shape -> 128 programs
PREFILL_ROWS = 32  # a prefill's rows a program (gdn_conv_prefill): 1,024 rows -> 32 x 128 programs

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _window_rows(state_ptr, mixed_ptr, rows, cols, c_ok, stride_s, stride_m, W: tl.constexpr, R):
        """Rows `rows` of [conv_state; mixed] for channels `cols`, in the inputs' dtype (0 past its W + R rows)."""
        from_state = rows < W
        from_mixed = (rows >= W) & (rows < W + R)
        s = tl.load(state_ptr + rows[:, None] * stride_s + cols[None, :], mask=from_state[:, None] & c_ok[None, :],
                    other=0.0)
        m = tl.load(mixed_ptr + (rows - W)[:, None] * stride_m + cols[None, :],
                    mask=from_mixed[:, None] & c_ok[None, :], other=0.0)
        return tl.where(from_state[:, None], s, m)

    @triton.jit
    def _conv_silu(state_ptr, mixed_ptr, w_ptr, r, cols, c_ok, stride_s, stride_m, W: tl.constexpr, R,
                   BR: tl.constexpr, BC: tl.constexpr, dtype: tl.constexpr):
        """silu(conv) of rows r [BR] for channels cols [BC]: the products in fp32, added in tap order (the glue's
        sum), rounded to dtype, then SiLU rounded again."""
        acc = tl.zeros([BR, BC], tl.float32)
        for j in tl.static_range(W + 1):
            x = _window_rows(state_ptr, mixed_ptr, r + j, cols, c_ok, stride_s, stride_m, W, R)
            wj = tl.load(w_ptr + cols * (W + 1) + j, mask=c_ok, other=0.0).to(tl.float32)
            acc += x.to(tl.float32) * wj[None, :]
        conv = acc.to(dtype).to(tl.float32)
        return (conv * tl.sigmoid(conv)).to(dtype)

    @triton.jit(do_not_specialize=["T"])
    def _conv_kernel(mixed_ptr, state_ptr, w_ptr, out_ptr, window_ptr, T, C, stride_m, stride_s, stride_o,
                     stride_win, R: tl.constexpr, RP: tl.constexpr, W: tl.constexpr, WS: tl.constexpr,
                     WP: tl.constexpr, KEEP_WINDOW: tl.constexpr, BC: tl.constexpr):
        """Grid (C / BC): every row of silu(conv) for BC channels, and their cache update."""
        cols = tl.program_id(0) * BC + tl.arange(0, BC)
        c_ok = cols < C
        r = tl.arange(0, RP)
        act = _conv_silu(state_ptr, mixed_ptr, w_ptr, r, cols, c_ok, stride_s, stride_m, W, R, RP, BC,
                         out_ptr.dtype.element_ty)
        if KEEP_WINDOW:  # a verify: window[:W + T] for accept()
            rows = tl.arange(0, WP)
            win = _window_rows(state_ptr, mixed_ptr, rows, cols, c_ok, stride_s, stride_m, W, R)
            tl.store(window_ptr + rows[:, None] * stride_win + cols[None, :], win,
                     mask=(rows < W + T)[:, None] & c_ok[None, :])
        else:  # the W inputs before the next token, read before this program's conv_state columns are replaced
            rows = tl.arange(0, WS)
            last = _window_rows(state_ptr, mixed_ptr, T + rows, cols, c_ok, stride_s, stride_m, W, R)
            tl.debug_barrier()  # every thread's loads of these columns happen before any thread's store
            tl.store(state_ptr + rows[:, None] * stride_s + cols[None, :], last,
                     mask=(rows < W)[:, None] & c_ok[None, :])
        tl.store(out_ptr + r[:, None] * stride_o + cols[None, :], act, mask=(r < R)[:, None] & c_ok[None, :])

    @triton.jit(do_not_specialize=["T"])
    def _conv_rows_kernel(mixed_ptr, state_ptr, w_ptr, out_ptr, T, C, stride_m, stride_s, stride_o,
                          W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """Grid (C / BC, T / BR): rows of silu(conv) for BC channels (a prefill piece: every row real, no cache
        update here, so row blocks can run side by side)."""
        cols = tl.program_id(0) * BC + tl.arange(0, BC)
        c_ok = cols < C
        r = tl.program_id(1) * BR + tl.arange(0, BR)
        act = _conv_silu(state_ptr, mixed_ptr, w_ptr, r, cols, c_ok, stride_s, stride_m, W, T, BR, BC,
                         out_ptr.dtype.element_ty)
        tl.store(out_ptr + r[:, None].to(tl.int64) * stride_o + cols[None, :], act,
                 mask=(r < T)[:, None] & c_ok[None, :])


def causal_conv(window: torch.Tensor, conv_w: torch.Tensor, rows: int) -> torch.Tensor:
    """The depthwise causal convolution of `rows` rows over window [W + rows, C], conv_w [C, W + 1]: the products in
    fp32, added in tap order, rounded once to the window's dtype (a conv with fp32 accumulation, as plain elementwise
    code, which torch.compile fuses with what surrounds it; the model's prefill glue calls this too)."""
    return sum(window[j:j + rows].float() * conv_w[:, j].float() for j in range(conv_w.shape[1])).to(window.dtype)


def gdn_conv_torch(mixed, conv_state, conv_w, T: int, window_out=None):
    """The PyTorch twin (the prefill glue's math): returns silu(conv) for every row of mixed; updates conv_state or
    fills window_out[:W + T] as gdn_conv does."""
    width = conv_state.shape[0]
    window = torch.cat([conv_state, mixed], dim=0)
    conv = causal_conv(window, conv_w, mixed.shape[0])
    if window_out is not None:
        window_out[:width + T].copy_(window[:width + T])
    else:
        conv_state.copy_(window[T:T + width])
    return F.silu(conv)


def _check(fn: str, mixed, conv_state, conv_w, rows_ok: bool, rows_rule: str, T: int) -> None:
    C, width = mixed.shape[1], conv_state.shape[0]
    if conv_state.shape[1] != C or tuple(conv_w.shape) != (C, width + 1) or not rows_ok:
        raise ValueError(f"{fn} takes mixed [R, C], conv_state [W, C], conv_w [C, W + 1] and {rows_rule}; got "
                         f"{tuple(mixed.shape)}, {tuple(conv_state.shape)}, {tuple(conv_w.shape)}, T={T}")


def gdn_conv(mixed: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor, T: int, *,
             window_out: torch.Tensor | None = None, use_triton: bool | None = None) -> torch.Tensor:
    """See the module docstring. mixed [R, C] (columns contiguous; a slice of the projection is fine), conv_state
    [W, C], conv_w [C, W + 1], 1 <= T <= R; window_out [>= W + T, C] or None. Returns silu(conv) [R, C]."""
    R, C = mixed.shape
    width = conv_state.shape[0]
    _check("gdn_conv", mixed, conv_state, conv_w, 1 <= T <= R, "1 <= T <= R", T)
    if window_out is not None and (window_out.shape[0] < width + T or window_out.shape[1] != C):
        raise ValueError(f"window_out must hold at least {width + T} rows of {C}, got {tuple(window_out.shape)}")
    if use_triton is None:
        use_triton = triton_usable(mixed)
    if not use_triton:
        return gdn_conv_torch(mixed, conv_state, conv_w, T, window_out)
    if mixed.stride(-1) != 1 or conv_state.stride(-1) != 1 or (window_out is not None and window_out.stride(-1) != 1):
        raise ValueError("gdn_conv needs contiguous channels (last dimension)")
    conv_w = conv_w if conv_w.is_contiguous() else conv_w.contiguous()
    out = torch.empty(R, C, dtype=mixed.dtype, device=mixed.device)
    win = window_out if window_out is not None else out  # unused without KEEP_WINDOW
    _conv_kernel[(triton.cdiv(C, BLOCK_C),)](
        mixed, conv_state, conv_w, out, win, T, C, mixed.stride(0), conv_state.stride(0), out.stride(0),
        win.stride(0), R=R, RP=triton.next_power_of_2(R), W=width, WS=triton.next_power_of_2(width),
        WP=triton.next_power_of_2(width + R), KEEP_WINDOW=window_out is not None, BC=BLOCK_C, num_warps=4)
    return out


def gdn_conv_prefill(mixed: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor, *,
                     use_triton: bool | None = None) -> torch.Tensor:
    """A prefill piece's convolution: silu(conv) [T, C] of every row of mixed [T, C] over [conv_state; mixed], then
    conv_state <- the last W inputs (a second, small launch: the row blocks of the first cannot order their reads
    of conv_state before its update). Same rounding points as the glue (causal_conv, then SiLU), in one launch
    instead of the glue's ~12 over [T, C] in fp32 (a 1,024-token piece at the 35B-A3B shape: 32 MB each)."""
    T, C = mixed.shape
    width = conv_state.shape[0]
    _check("gdn_conv_prefill", mixed, conv_state, conv_w, T >= 1, "T >= 1", T)
    if use_triton is None:
        use_triton = triton_usable(mixed)
    if not use_triton:
        return gdn_conv_torch(mixed, conv_state, conv_w, T)
    if mixed.stride(-1) != 1 or conv_state.stride(-1) != 1:
        raise ValueError("gdn_conv_prefill needs contiguous channels (last dimension)")
    conv_w = conv_w if conv_w.is_contiguous() else conv_w.contiguous()
    out = torch.empty(T, C, dtype=mixed.dtype, device=mixed.device)
    _conv_rows_kernel[(triton.cdiv(C, BLOCK_C), triton.cdiv(T, PREFILL_ROWS))](
        mixed, conv_state, conv_w, out, T, C, mixed.stride(0), conv_state.stride(0), out.stride(0), W=width,
        BR=PREFILL_ROWS, BC=BLOCK_C, num_warps=4)
    if T >= width:
        conv_state.copy_(mixed[T - width:])
    else:
        conv_state.copy_(torch.cat([conv_state[T:], mixed]))
    return out
