"""argmax_confidence(): each row's argmax and softmax probability of it, in two launches, for the drafter's head.

A DFlash draft takes the argmax of 15 rows of logits over the target's vocabulary (248,320 for Qwen3.6) and the
drafter's confidence in it, exp(max - logsumexp), which the adaptive verify length reads. torch.compile made that three
reductions of 15 programs each, one per row (61 us a draft on the H200: 6% of it). Here every row is cut into chunks
of BLOCK columns, one program per (row, chunk) computes its chunk's max, first argmax and sum of exp(x - max), and one
program per row combines them: 15 x 61 programs instead of 15.

    choice, confidence = argmax_confidence(logits)     # logits [R, V] -> [R] int64, [R] fp32

Ties go to the first index, as torch.argmax. Off Triton, the PyTorch expression runs. The draft only decides speed
(the target verifies every token), so nothing downstream depends on these bits.
"""

from __future__ import annotations

import torch

from reviewer_kernels.fused_moe import triton, triton_usable

BLOCK = 4096

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _argmax_partial_kernel(x_ptr, stride, n, part_max, part_idx, part_sum, CHUNKS: tl.constexpr,
                               BLOCK: tl.constexpr):
        row, chunk = tl.program_id(0), tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < n, other=-float("inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        idx = tl.min(tl.where(x == m, cols, n), axis=0)  # the first column holding the max
        s = tl.sum(tl.exp(x - m), axis=0)
        tl.store(part_max + row * CHUNKS + chunk, m)
        tl.store(part_idx + row * CHUNKS + chunk, idx)
        tl.store(part_sum + row * CHUNKS + chunk, s)

    @triton.jit
    def _argmax_combine_kernel(part_max, part_idx, part_sum, choice_ptr, conf_ptr, n, CHUNKS: tl.constexpr,
                        CP: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, CP)
        ok = c < CHUNKS
        m = tl.load(part_max + row * CHUNKS + c, mask=ok, other=-float("inf"))
        idx = tl.load(part_idx + row * CHUNKS + c, mask=ok, other=n)
        s = tl.load(part_sum + row * CHUNKS + c, mask=ok, other=0.0)
        best = tl.max(m, axis=0)
        total = tl.sum(s * tl.exp(m - best), axis=0)
        tl.store(choice_ptr + row, tl.min(tl.where(m == best, idx, n), axis=0).to(tl.int64))
        tl.store(conf_ptr + row, 1.0 / total)  # exp(best - logsumexp) = exp(best - best - log(total))


def argmax_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] (any float dtype, rows contiguous) -> (argmax [R] int64, softmax probability of it [R] fp32)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows, got {tuple(logits.shape)}")
    if not triton_usable(logits):
        best, choice = logits.max(-1)
        return choice, torch.exp(best.float() - torch.logsumexp(logits.float(), -1))
    rows, n = logits.shape
    chunks = triton.cdiv(n, BLOCK)
    part_max, part_sum = torch.empty(2, rows, chunks, device=logits.device, dtype=torch.float32)
    part_idx = torch.empty(rows, chunks, device=logits.device, dtype=torch.int32)
    choice = torch.empty(rows, device=logits.device, dtype=torch.int64)
    conf = torch.empty(rows, device=logits.device, dtype=torch.float32)
    _argmax_partial_kernel[(rows, chunks)](logits, logits.stride(0), n, part_max, part_idx, part_sum, CHUNKS=chunks,
                                           BLOCK=BLOCK, num_warps=8)
    _argmax_combine_kernel[(rows,)](part_max, part_idx, part_sum, choice, conf, n, CHUNKS=chunks,
                                    CP=triton.next_power_of_2(chunks), num_warps=1)
    return choice, conf
