"""Building the decode step's and verify's Triton kernels for the H200 (sm_90) without a GPU, as a launch at the
Qwen3.6-35B-A3B shape builds them: for tests/reviewer_kernels/test_sm90_compile.py (each compiles, fits, spills
nothing) and bench/sass_order.py (what the machine code does, in order).

Each kernel is specialised as a launch specialises it: pointers 16-byte aligned (torch's allocations and the
workspaces' slices are: fused_moe.align_workspace) and integer arguments divisible by 16 unless the kernel marks them
do_not_specialize or the 35B-A3B shape's value is not (NOT_DIVISIBLE). Without that, Triton can prove no vector
alignment: a build then loads element by element, pipelines no loop, and ptxas reports spills a real launch does
not have (the experts' gate_up read 1.9 KB a thread that way; specialised, 128 registers and none).
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from reviewer_kernels.moe_routing import ROUTER_NORM_BLOCK_K
from reviewer_kernels.norms import PADDED_GATED_NORM

H200 = GPUTarget("cuda", 90, 32)
FLOATS = {"eps", "scale"}
# integer arguments whose value at the 35B-A3B shape is not a multiple of 16 (top-8 routing)
NOT_DIVISIBLE = {"top_k", "slots"}


def compile_for_h200(module: str, kernel: str, constexprs: dict, pointers: dict | None = None,
                     warps: int = 4, stages: int = 3):
    """Compile module.kernel for sm_90 as a launch at the 35B-A3B shape specialises it: arguments named *_ptr are
    bf16 pointers (unless `pointers` says otherwise), 16-byte aligned; eps / scale fp32; the constexprs given; every
    other argument i32, divisible by 16 unless do_not_specialize or in NOT_DIVISIBLE."""
    fn = getattr(importlib.import_module(module), kernel)
    pointers = pointers or {}
    signature, attrs = {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if not param.do_not_specialize and name not in NOT_DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=H200, options={"num_warps": warps, "num_stages": stages})


def _nvdisasm() -> str:
    """nvdisasm from Triton's wheel."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def ptxas_report(compiled) -> str:
    """ptxas -v's resource lines for the compiled kernel's PTX (registers, stack, spill bytes), with the ptxas Triton
    itself picks for sm_90 (its wheel carries two)."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        run = subprocess.run([getattr(ptxas, "path", ptxas), "-v", "--gpu-name=sm_90a", str(ptx), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True, check=True)
    return run.stderr


# SASS opcodes by what they make a thread wait for or do, in bench/sass_order.py's one-letter summary
SASS_CLASSES = (("LDGSTS", "L"), ("LDG", "L"), ("LDSM", "s"), ("LDS", "s"), ("SHFL", "S"), ("STG", "W"),
                ("RED", "W"), ("ATOMG", "W"), ("BAR", "B"), ("HMMA", "M"), ("HGMMA", "M"), ("EXIT", "X"))


def sass_order(compiled) -> str:
    """The kernel's SASS as one letter per instruction that matters for latency, in program order: L a global load,
    s a shared-memory load, S a warp shuffle, W a global store or atomic, B a barrier, M a tensor-core MMA, X an exit,
    < a branch back (a loop) and > one forward. Runs of three or more are written as the letter and a count."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([_nvdisasm(), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    labels, ops = {}, []
    for line in text.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
        inst = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);", line)
        if inst:
            ops.append((inst.group(1), inst.group(2)))
    out = []
    for at, (op, args) in enumerate(ops):
        if op.startswith("BRA"):
            target = re.search(r"(\.L_x_\d+)", args)
            out.append("<" if target and labels.get(target.group(1), len(ops)) <= at else ">")
        else:
            out += [letter for prefix, letter in SASS_CLASSES if op.startswith(prefix)][:1]
    return re.sub(r"(.)\1{2,}", lambda m: f"{m.group(1)}{len(m.group(0))}", "".join(out))


F32 = "*fp32"
CASES = {
    "attention_prep": ("reviewer_kernels.attention_prep", "_attention_prep_kernel",
                       dict(H=16, HKV=2, D=256, ROT=64), {"qn_ptr": F32, "kn_ptr": F32, "pos_ptr": "*i64"},
                       2, 1),
    "block_attention_partial": ("reviewer_kernels.block_attention", "_partial_kernel",
                                dict(GROUP=8, D=256, BLOCK_M=16, BLOCK_N=32, BLOCK_T=16, SPLIT_COLS=288,
                                     N_SPLITS=114, N_CHUNKS=8, CAUSAL=True, IEEE=False, WINDOW=0),
                                {"po_ptr": F32, "pm_ptr": F32, "pl_ptr": F32, "start_ptr": "*i64"}, 4, 3),
    "block_attention_combine_gated": ("reviewer_kernels.block_attention", "_combine_kernel",
                                      dict(GROUP=8, D=256, DC=64, BLOCK_M=16, N_SPLITS=114, N_CHUNKS=8, SP=128,
                                           SPLIT_COLS=288, CAUSAL=True, HAS_GATE=True),
                                      {"po_ptr": F32, "pm_ptr": F32, "pl_ptr": F32, "start_ptr": "*i64"}, 4, 1),
    "slot_sum_with_norm": ("reviewer_kernels.fused_moe", "_sum_slots_kernel",
                           dict(TOP_K=8, HAS_SHARED=True, HAS_RESIDUAL=True, HAS_NORM=True, BH=2048),
                           {"rows_ptr": F32, "nw_ptr": F32}, 8, 1),
    "wide_linear_residual_sumsq": ("reviewer_kernels.wide_linear", "_wide_kernel",
                                   dict(K=4096, KS=1024, BK=256, SPLITS=4, BN=64, STAGES=4, IEEE=False,
                                        RESIDUAL=True, SUMSQ=True),
                                   {"part_ptr": F32, "count_ptr": "*i32", "ss_ptr": F32}, 4, 1),
    "router_norm_from_partials": ("reviewer_kernels.moe_routing", "_router_partial_kernel",
                                  dict(BM=16, BE=16, BK=ROUTER_NORM_BLOCK_K, PRECISION="tf32", HAS_NORM=False, HP=2048,
                                       ROUTE=False,
                                       PARTS=4, RENORMALIZE=True, K=8, KP=8, EP=256, SS_PARTS=32, SS_P=32),
                                  {"nw_ptr": F32, "part_ptr": F32, "ss_ptr": F32, "count_ptr": "*i32",
                                   "ids_ptr": "*i64"}, 4, 3),
    # the experts in the invariant tile set (fused_moe_configs.json's E256_H2048_I512_K8_S1_invariant), sorted blocks
    "experts_gate_up": ("reviewer_kernels.fused_moe", "_gate_up_kernel",
                        dict(HAS_SHARED_GATE=True, DIRECT=False, SPLIT_K=1, EVEN_K=True, EVEN_N=True, PRECISION="tf32",
                             BM=16, BN=32, BK=256, HP=2048),
                        {"part_ptr": F32, "count_ptr": "*i32", "sgate_ptr": F32, "ids_ptr": "*i64",
                         "sorted_ptr": "*i32", "bexp_ptr": "*i32", "bstart_ptr": "*i32", "bcount_ptr": "*i32"}, 4, 3),
    "experts_down": ("reviewer_kernels.fused_moe", "_down_kernel",
                     dict(HAS_SHARED_GATE=True, DIRECT=False, EVEN_K=True, EVEN_N=True, PRECISION="tf32", BM=16,
                          BN=64, BK=128, SUM_IN_DOWN=False, TOP_K=8, HAS_SHARED=True, HAS_RESIDUAL=True),
                     {"sgate_ptr": F32, "rows_ptr": F32, "ids_ptr": "*i64", "sorted_ptr": "*i32", "bexp_ptr": "*i32",
                      "bstart_ptr": "*i32", "bcount_ptr": "*i32", "count_ptr": "*i32"}, 4, 3),
    # the one-token experts (reviewer_kernels/moe_decode.py), with their token axis (gemv_tokens)
    "one_token_gate_up": ("reviewer_kernels.moe_decode", "_gate_up_kernel",
                          dict(H=2048, I=512, HP=2048, HAS_SHARED_GATE=True, BN=1),
                          {"ids_ptr": "*i64", "sgate_ptr": F32}, 8, 1),
    "one_token_down": ("reviewer_kernels.moe_decode", "_down_kernel",
                       dict(H=2048, I=512, IP=512, TOP_K=8, KP=8, HAS_SHARED=True, HAS_SHARED_GATE=True,
                            HAS_RESIDUAL=True, BH=1),
                       {"ids_ptr": "*i64", "sgate_ptr": F32}, 1, 1),
    # the one-token programs for a verify block (gemv_sorted_from): an expert's rows read once, its slots walked
    "blocks_gate_up": ("reviewer_kernels.moe_decode", "_gate_up_blocks_kernel",
                       dict(H=2048, I=512, HP=2048, HAS_SHARED_GATE=True, BN=1),
                       {"ids_ptr": "*i64", "sgate_ptr": F32, "slots_ptr": "*i32", "bexp_ptr": "*i32",
                        "bstart_ptr": "*i32", "bcount_ptr": "*i32"}, 8, 1),
    "tokens_down": ("reviewer_kernels.moe_decode", "_down_tokens_kernel",
                    dict(H=2048, I=512, IP=512, TOP_K=8, KP=8, HAS_SHARED=True, HAS_SHARED_GATE=True,
                         HAS_RESIDUAL=True, BH=1),
                    {"ids_ptr": "*i64", "sgate_ptr": F32}, 1, 1),
    "experts_align": ("reviewer_kernels.fused_moe", "_align_kernel",
                      dict(HAS_SHARED=True, EP=512, CH=128, BM=16, IN_REGISTERS=True),
                      {"ids_ptr": "*i64", "counts_ptr": "*i32", "sorted_ptr": "*i32", "bexp_ptr": "*i32",
                       "bstart_ptr": "*i32", "bcount_ptr": "*i32"}, 8, 1),
    "route": ("reviewer_kernels.moe_routing", "_route_kernel",
              dict(RENORMALIZE=True, K=8, KP=8, EP=256, BT=1, PARTS=4, PART_ROWS=16),
              {"logits_ptr": F32, "ids_ptr": "*i64"}, 1, 1),
    "gated_rms_norm": ("reviewer_kernels.norms", "_gated_rms_norm_kernel", dict(BR=32, BN=128), {}, 4, 1),
    "gated_rms_norm_padded": ("reviewer_kernels.norms", "_gated_rms_norm_kernel",
                              dict(BR=PADDED_GATED_NORM["rows_per_program"], BN=128), {},
                              PADDED_GATED_NORM["num_warps"], 1),
    # the embedded model's (SmolLM2-135M) invariant projections: the o-projection with its residual (one split,
    # rows_linear.TUNED) and the q/k/v projection with RoPE (plan(): 9 splits of one K step, the last adds them)
    "rows_linear_o_residual": ("reviewer_kernels.rows_linear", "_rows_linear_kernel",
                               dict(K=576, KS=768, BK=256, SPLITS=1, NORM=False, EPILOGUE=0, HALF=1,
                                    HAS_RESIDUAL=True, BN=16, STAGES=3, IEEE=False),
                               {"pos_ptr": "*i64", "part_ptr": F32, "ss_ptr": F32, "count_ptr": "*i32"}, 4, 3),
    "rows_linear_qkv_rope": ("reviewer_kernels.rows_linear", "_rows_linear_kernel",
                             dict(K=576, KS=64, BK=64, SPLITS=9, NORM=True, EPILOGUE=2, HALF=32,
                                  HAS_RESIDUAL=False, BN=16, STAGES=0, IEEE=False),
                             {"pos_ptr": "*i64", "part_ptr": F32, "ss_ptr": F32, "count_ptr": "*i32"}, 4, 3),
    "gdn_recurrent": ("reviewer_kernels.gdn_state", "_gdn_recurrent_kernel",
                      dict(HV=32, GROUP=2, DK=128, DV=128, DKP=128, BV=16, EVERY_POSITION=False, PREFETCH=True,
                           RAW_GATES=True, RECORD=True, STORE_OUT=True, STORE_STATE=False),
                      {"neg_a_ptr": F32, "dt_bias_ptr": F32, "state_in_ptr": F32, "states_out_ptr": F32,
                       "rg_ptr": F32, "rb_ptr": F32}, 1, 1),
    "gdn_walk": ("reviewer_kernels.gdn_state", "_gdn_walk_kernel",
                 dict(C=64, DK=128, DV=128, BV=16, KS=16, DOT="ieee", stride_uc=1),  # the solve's rows: stride 1
                 {"u_ptr": F32, "ke_ptr": F32, "decay_ptr": F32, "s_ptr": F32, "starts_ptr": F32}, 8, 2),
    "gdn_chunk_out": ("reviewer_kernels.gdn_state", "_gdn_chunk_out_kernel",
                      dict(C=64, DK=128, DV=128, BV=64, DOT="tf32"),
                      {"u_ptr": F32, "qd_ptr": F32, "qk_ptr": F32, "starts_ptr": F32}, 4, 1),
}
# the down kernel again, with the slots summed by the last program of each token and N-tile (the config's sum_in_down)
_module, _kernel, _constexprs, *_launch = CASES["experts_down"]
CASES["experts_down_sum_in_down"] = (_module, _kernel, dict(_constexprs, SUM_IN_DOWN=True), *_launch)
