"""Which parts of the Qwen3.5/3.6-MoE fast path compute a row differently in a verify block than in a decode step?
(GPU, bf16, random weights at the Qwen3.6-35B-A3B layer shape; the map for making its verify batch-invariant.)

Each part of a layer is fed the same input rows twice, as a decode step runs it (one row, the one-token kernels) and
as a verify runs it (16 rows, the compiled glue, cuBLAS and the grouped experts), with the glue compiled as the
engine serves it. A row is `equal` when all 16 rows of the block equal their one-row results bit for bit.

    python bench/qwen_invariance.py --json bench/results/qwen_invariance_h200_20261201.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from backend.models.llama import glue, residual_add  # noqa: E402
from backend.models.qwen3_5_moe import (  # noqa: E402
    Qwen35MoeConfig,
    attention_in,
    attention_out,
    deltanet_in,
    deltanet_out,
    qwen_rms_norm,
)
from reviewer_kernels.gdn_state import gdn_recurrent  # noqa: E402
from reviewer_kernels.gemv import gemv  # noqa: E402


def shape_config() -> Qwen35MoeConfig:
    """The 35B-A3B layer shape with one Gated DeltaNet and one attention layer (bench/target_step.py's numbers)."""
    return Qwen35MoeConfig(vocab_size=248320, hidden_size=2048, layer_types=["linear_attention", "full_attention"],
                           num_heads=16, num_kv_heads=2, head_dim=256, linear_num_key_heads=16,
                           linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                           conv_kernel=4, num_experts=256, top_k=8, moe_intermediate_size=512,
                           shared_intermediate_size=512, rms_norm_eps=1e-6, tie_embeddings=False)


def rows_equal(one_row_fn, block_fn, rows: int = 16):
    """(every row of block_fn() equals one_row_fn(t) bit for bit, largest |difference|)."""
    block = block_fn()
    diffs = [float((block[t:t + 1].float() - one_row_fn(t).float()).abs().max()) for t in range(rows)]
    return all(d == 0.0 for d in diffs), max(diffs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-prefill-first", action="store_true",
                    help="compile each glue function at 16 and 1 rows first, not at a prefill's length")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("qwen_invariance.py needs a CUDA GPU")
    import target_step
    torch.manual_seed(0)
    c = shape_config()
    model, _ = target_step.random_qwen(c, 10_000.0, 0.25, "cuda", torch.bfloat16)
    model.setup_caches(max_context=1024, max_block=16)
    dn, attn_layer = model.layers[0], model.layers[1]
    eps, H, T = c.rms_norm_eps, c.hidden_size, 16
    bf = lambda *s: (torch.randn(*s, device="cuda") * 0.5).bfloat16()  # noqa: E731
    x, y = bf(T, H), bf(T, H)
    results = {}
    if not args.no_prefill_first:
        # as served: the engine's first compiled call of each glue function is a prefill chunk (T = 300 here), so
        # its 16-row calls run torch.compile's dynamic-shape kernels and its one-row calls a T = 1 specialisation
        P = 300
        pos_p = torch.arange(P, device="cuda")
        glue(attention_in, True)(bf(P, H), attn_layer.norm1, attn_layer.mixer.wqkv, attn_layer.mixer.q_norm,
                                 attn_layer.mixer.k_norm, model.cos[pos_p], model.sin[pos_p], eps, c.num_heads,
                                 c.num_kv_heads, c.head_dim)
        glue(attention_out, True)(bf(P, c.num_heads * c.head_dim), bf(P, c.num_heads * c.head_dim),
                                  attn_layer.mixer.wo)
        glue(deltanet_in, True)(bf(P, H), dn.norm1, dn.mixer.w_in,
                                torch.zeros(c.conv_kernel - 1, c.conv_dim, device="cuda", dtype=torch.bfloat16),
                                dn.mixer.conv_w, eps, c.linear_num_key_heads, c.linear_num_value_heads,
                                c.linear_key_head_dim, c.linear_value_head_dim)
        glue(deltanet_out, True)(bf(P, c.linear_num_value_heads, c.linear_value_head_dim),
                                 bf(P, c.linear_num_value_heads, c.linear_value_head_dim), dn.mixer.norm,
                                 dn.mixer.w_out, eps)
        dn.moe(bf(P, H), bf(P, H), dn.norm2, eps, True)

    def record(name, ok_diff):
        results[name] = {"equal": ok_diff[0], "max_abs_diff": ok_diff[1]}
        print(f"{name:58s} {'equal' if ok_diff[0] else 'DIFFERS'}  max |diff| {ok_diff[1]:.3g}", flush=True)

    # attention in: pre-norm, fused projection (cuBLAS), q/k norms, RoPE: the same glue for decode and verify
    m = attn_layer.mixer
    pos = torch.arange(100, 100 + T, device="cuda")
    cos, sin = model.cos[pos], model.sin[pos]
    ain = glue(attention_in, True)
    args_in = (attn_layer.norm1, m.wqkv, m.q_norm, m.k_norm)
    record("attention_in (compiled glue), q", rows_equal(
        lambda t: ain(x[t:t + 1], *args_in, cos[t:t + 1], sin[t:t + 1], eps, c.num_heads, c.num_kv_heads,
                      c.head_dim)[0][:, 0],
        lambda: ain(x, *args_in, cos, sin, eps, c.num_heads, c.num_kv_heads, c.head_dim)[0].transpose(0, 1)))
    # attention out: decode = gemv(gate, projection, residual) in one kernel; verify = compiled attention_out, then
    # the residual add inside moe_in
    a, g = bf(T, c.num_heads * c.head_dim), bf(T, c.num_heads * c.head_dim)
    aout = glue(attention_out, True)
    record("attention out + residual (decode gemv vs verify glue)", rows_equal(
        lambda t: gemv(a[t:t + 1], m.wo, g[t:t + 1], residual=x[t:t + 1]),
        lambda: residual_add(x, aout(a, g, m.wo))))
    record("attention out + residual (glue at 1 row vs 16)", rows_equal(
        lambda t: residual_add(x[t:t + 1], aout(a[t:t + 1], g[t:t + 1], m.wo)),
        lambda: residual_add(x, aout(a, g, m.wo))))
    # Gated DeltaNet in: pre-norm, projection, conv window (from a zero conv state per row), SiLU
    d = dn.mixer
    conv0 = torch.zeros(c.conv_kernel - 1, c.conv_dim, device="cuda", dtype=torch.bfloat16)
    din = glue(deltanet_in, True)
    dargs = (dn.norm1, d.w_in)
    dims = (eps, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    record("deltanet_in (compiled glue), z of each row", rows_equal(
        lambda t: din(x[t:t + 1], *dargs, conv0, d.conv_w, *dims)[4].reshape(1, -1),
        lambda: din(x, *dargs, conv0, d.conv_w, *dims)[4].reshape(T, -1)))
    # the recurrence: decode updates the live state; a verify writes every position's state
    q, k = bf(T, c.linear_num_key_heads, c.linear_key_head_dim), bf(T, c.linear_num_key_heads, c.linear_key_head_dim)
    v = bf(T, c.linear_num_value_heads, c.linear_value_head_dim)
    ga, gb = bf(T, c.linear_num_value_heads), bf(T, c.linear_num_value_heads)
    s0 = torch.randn(c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, device="cuda") * 0.1
    gates = (d.neg_A, d.dt_bias)
    snaps = torch.empty(T, *s0.shape, device="cuda")
    block_out = gdn_recurrent(q, k, v, ga, gb, s0, snaps, every_position=True, gates=gates)
    state, step_outs = s0.clone(), []
    for t in range(T):
        step_outs.append(gdn_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], ga[t:t + 1], gb[t:t + 1], state, state,
                                       every_position=False, gates=gates))
    same_out = torch.equal(block_out, torch.cat(step_outs))
    record("gdn_recurrent outputs (verify every position vs decode steps)",
           (same_out, float((block_out.float() - torch.cat(step_outs).float()).abs().max())))
    record("gdn_recurrent state after the block", (torch.equal(snaps[-1], state),
                                                   float((snaps[-1] - state).abs().max())))
    # Gated DeltaNet out: decode = gemv(gated norm, projection, residual); verify = compiled deltanet_out + moe_in's add
    core, z = bf(T, c.linear_num_value_heads, c.linear_value_head_dim), bf(T, c.linear_num_value_heads,
                                                                          c.linear_value_head_dim)
    dout = glue(deltanet_out, True)
    record("deltanet out + residual (decode gemv vs verify glue)", rows_equal(
        lambda t: gemv(core[t].reshape(1, -1), d.w_out, z[t].reshape(1, -1), d.norm, eps, residual=x[t:t + 1]),
        lambda: residual_add(x, dout(core, z, d.norm, d.w_out, eps))))
    # the MoE block: decode = norm inside the router kernel + reviewer_kernels/moe_decode.py; verify = compiled moe_in
    # norm + router kernel + the grouped fused_moe
    moe = dn.moe
    xr = residual_add(x, y)
    record("MoE (decode path vs verify path)", rows_equal(
        lambda t: moe(xr[t:t + 1], None, dn.norm2, eps, True),
        lambda: moe(x, y, dn.norm2, eps, True)))
    record("MoE verify path at 1 row vs 16", rows_equal(
        lambda t: moe(x[t:t + 1], y[t:t + 1], dn.norm2, eps, True),
        lambda: moe(x, y, dn.norm2, eps, True)))
    record("MoE decode path at 1 row vs 16 rows (if it takes them)", rows_equal(
        lambda t: moe(xr[t:t + 1], None, dn.norm2, eps, True),
        lambda: moe(xr, None, dn.norm2, eps, True)))
    # the invariant mode (QwenNumerics.padded_rows): glue output projections for every row count, experts' tiles
    # fixed at the 16-token entry, the grouped path even for one token
    record("deltanet out + residual (glue at 1 row vs 16)", rows_equal(
        lambda t: residual_add(x[t:t + 1], dout(core[t:t + 1], z[t:t + 1], d.norm, d.w_out, eps)),
        lambda: residual_add(x, dout(core, z, d.norm, d.w_out, eps))))
    fixed = model.expert_tiles(x)
    padded = lambda a: torch.cat([a, a.new_zeros(T - a.shape[0], a.shape[1])])  # noqa: E731 (16 rows, as _padded_rows)
    # the result and the next norm computed by the slot sum, side by side
    moe_pad = lambda a, b, n: torch.cat(dn.moe.padded(a, b, dn.norm2, eps, n, True, fixed, model.norm), 1)  # noqa
    record("MoE verify path, tiles fixed, at 1 row vs 16 (invariant mode: SparseMoE.padded)", rows_equal(
        lambda t: moe_pad(padded(x[t:t + 1]), padded(y[t:t + 1]), 1)[:1],
        lambda: moe_pad(x, y, T)))
    # block attention at the 35B-A3B head shape (16 query heads of 256 over 2 KV heads): a 16-token verify block
    # against 16 decode steps on a copy of the same cache (a 100-token prefix), each at its own span bucket
    from reviewer_kernels.block_attention import block_attention
    L, start = 1024, 100
    kc = torch.zeros(c.num_kv_heads, L, c.head_dim, device="cuda", dtype=torch.bfloat16)
    kc[:, :start] = bf(c.num_kv_heads, start, c.head_dim)
    vc = torch.zeros_like(kc)
    vc[:, :start] = bf(c.num_kv_heads, start, c.head_dim)
    kc2, vc2 = kc.clone(), vc.clone()
    qb, kb, vb = bf(c.num_heads, T, c.head_dim), bf(c.num_kv_heads, T, c.head_dim), bf(c.num_kv_heads, T, c.head_dim)
    blk_pos = torch.arange(start, start + T, device="cuda")
    block_att = block_attention(qb, kb, vb, kc, vc, blk_pos[:1], 128, use_triton=True)
    steps = []
    for t in range(T):
        p1 = blk_pos[t:t + 1]
        span = 128 if t % 2 else start + t + 1  # two span buckets: the span must not change a row's bits
        steps.append(block_attention(qb[:, t:t + 1].contiguous(), kb[:, t:t + 1].contiguous(),
                                     vb[:, t:t + 1].contiguous(), kc2, vc2, p1, span, positions=p1, use_triton=True))
    record("block attention, head 256, GQA 8 (verify vs decode steps)",
           (torch.equal(block_att, torch.cat(steps)), float((block_att.float() - torch.cat(steps).float()).abs().max())))
    # the final norm and the LM head (eager norm; cuBLAS)
    record("final norm + LM head", rows_equal(
        lambda t: torch.nn.functional.linear(qwen_rms_norm(x[t:t + 1], model.norm, eps), model.lm_head),
        lambda: torch.nn.functional.linear(qwen_rms_norm(x, model.norm, eps), model.lm_head)))
    doc = {"benchmark": "qwen_invariance", "device": torch.cuda.get_device_name(),
           "model": "Qwen3.6-35B-A3B layer shape, random weights, bf16, compiled glue",
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": "python bench/qwen_invariance.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
           "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print("wrote", args.json)


if __name__ == "__main__":
    main()
