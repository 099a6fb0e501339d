"""What `reviewer bench` records and prints: the machine (GPU or CPU name, threads, torch), the numerics it ran, the
greedy outputs compared prompt by prompt, the spec_e2e summary of each speculative run side by side with plain
decoding, and the text table."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from backend.loading import cpu_has_bf16_matmul


def machine_info(device: str) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "device": device}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    else:
        info["cpu"] = cpu_model() or platform.processor() or platform.machine()
    return info


def cpu_model() -> str | None:
    """The CPU's name as /proc/cpuinfo gives it (platform.processor() says only x86_64 on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def numerics(device: str, dtype: torch.dtype) -> str:
    """Which arithmetic the run used, in the words a user needs to judge the figures: on a CPU, bf16 is fast only
    with AMX (backend.loading.cpu_has_bf16_matmul); without it the engine runs fp32, and speculative decoding gains
    far less (a 16-token verify then costs several decode steps)."""
    name = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))
    if torch.device(device).type == "cuda":
        return f"{name} on CUDA"
    amx = cpu_has_bf16_matmul()
    if name == "bf16":
        return "bf16 with AMX" if amx else "bf16 without AMX (slow bf16 matmuls on this CPU)"
    return f"{name}, CPU {'with' if amx else 'without'} AMX"


def compare(run: dict, plain: dict) -> None:
    """Greedy output against plain decoding, prompt by prompt."""
    same = [a == b for a, b in zip(run["outputs"], plain["outputs"])]
    run["identical_to_plain"] = all(same)
    run["identical"], run["identical_of"] = sum(same), len(same)
    run["first_difference"] = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                               for a, b, ok in zip(run["outputs"], plain["outputs"], same) if not ok]


def summary(r: dict, l_target_ms: float, baseline: dict) -> dict:
    """The spec_e2e figures of one speculative run, side by side with plain decoding of the same run."""
    keys = ("T_d_ms", "T_t_ms", "host_ms_per_cycle", "cycle_ms", "tau", "eta_predicted", "eta_measured")
    out = {"L_target_ms": l_target_ms, **{k: r.get(k) for k in keys}, "plain_decode_tok_s": baseline["decode_tok_s"],
           "speculative_decode_tok_s": r["decode_tok_s"], "identical": r.get("identical"),
           "prompts": r.get("identical_of")}
    if "forced_acceptance" in r:
        out["forced_tau"] = r["forced_acceptance"]["tau"]
    return out


def format_table(res: dict) -> str:
    m, runs = res["model"], res["runs"]
    lines = [f"reviewer bench  {res['date']}  {res['machine']['device']} "
             f"({res['machine'].get('gpu') or res['machine'].get('cpu')}, {res['machine']['torch_threads']} thread{'' if res['machine']['torch_threads'] == 1 else 's'})",
             f"target  {m['name']} ({m['class']}, {m['layers']} layers, {m['params_m']}M params, {m['dtype']})",
             f"drafter {res['drafter']['source']}"
             + (f", block {res['drafter']['block_size']}, {res['drafter']['block_attention']} block attention"
                if res["drafter"].get("block_size") else ""),
             f"numerics {res.get('numerics', '?')}",
             f"{res['prompts']} prompts x up to {res['max_tokens']} tokens, greedy", "",
             f"{'run':<28}{'tokens':>7}{'tok/s':>9}{'decode tok/s':>14}  identical"]
    labels = {"hf_generate": "transformers generate", "plain": "engine, plain",
              "plain_default": "engine, plain (default kernels)",
              "speculative": "engine, speculative", "speculative_adaptive": "engine, spec + adaptive k"}
    labels.update({k: "engine, forced tau " + k.removeprefix("forced_tau_").replace("_adaptive", " + adaptive k")
                   for k in runs if k.startswith("forced_")})
    for key, r in runs.items():
        same = r.get("identical_to_plain", r.get("identical_to_hf_generate"))
        ref = " (vs plain)" if "identical_to_plain" in r else (" (vs generate)" if same is not None else "")
        lines.append(f"{labels[key]:<28}{r['tokens']:>7}{r['tok_s']:>9.1f}"
                     f"{(r['decode_tok_s'] if 'decode_tok_s' in r else r['tok_s']):>14.1f}  "
                     f"{'-' if same is None else ('yes' if same else 'NO')}{ref}")
    eng = res.get("engine", {})
    mode = ", exact (batch-invariant) mode" if eng.get("exact") else (
        ", invariant verify path (plain = its plain decoding)" if eng.get("invariant_verify") else "")
    lines.append(f"\nengine path: {eng.get('path')}{mode}; speed ratios against {labels[res.get('baseline', 'plain')]}")
    lines.append(f"L_target (plain decode time per token) {res['L_target_ms']:.2f} ms")
    for key in [k for k in runs if k.startswith(("speculative", "forced_"))]:
        r = runs.get(key)
        if not r or not r.get("cycles"):
            continue
        lines += [f"\n{labels[key]}: {r['cycles']} cycles, tau {r['tau']:.2f}, "
                  f"T_d {r['T_d_ms']:.2f} ms, T_t {r['T_t_ms']:.2f} ms, accept/rollback {r['rollback_ms']:.2f} ms, "
                  f"host {r['host_ms_per_cycle']:.2f} ms, cycle {r['cycle_ms']:.2f} ms"
                  + (f" (+ a first draft of {r['first_draft_ms_per_generation']:.2f} ms a generation)"
                     if r.get("first_draft_ms_per_generation") else "")
                  + f"; identical {r['identical']}/{r['identical_of']} prompts",
                  f"  eta predicted tau*L_target/(T_t+T_d) = {r['eta_predicted']:.2f}, "
                  f"measured {r['eta_measured']:.2f}",
                  "  acceptance by draft position: "
                  + " ".join(f"{k + 1}:{a:.2f}" for k, a in enumerate(r["acceptance_per_position"])),
                  f"  verify sizes (tokens: cycles) {r['verify_sizes']}"]
        e = r.get("experts_per_layer")
        if e and e.get("verify_block") is not None:
            lines.append(f"  experts woken per MoE layer: {e['verify_block']:.1f} of {e['of']} for a "
                         f"{e['verify_block_tokens']}-token verify block, "
                         f"{e['decode_step'] or 0:.1f} for a decode step")
        if r.get("out_of_draft_vocab"):
            lines.append(f"  committed tokens outside the draft vocabulary: {r['out_of_draft_vocab']}")
    return "\n".join(lines)
