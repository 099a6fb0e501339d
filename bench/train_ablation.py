"""The seed's four drafter arms x two seeds at equal budget, then the best arm trained longer: one command, meant for
the GPU box (it also runs on a CPU with a tiny target and tiny budgets, which is how it was tested).

    python bench/train_ablation.py --model /tmp/g/SmolLM2-135M-Instruct.gguf --work /tmp/w --out $OUT \
        --arm-steps 600 --deadline 540

Every training run is a real `python -m backend.train` process (what `reviewer train` runs) on one shared data
directory (the target's responses and features, made once by the first call with --data-only). The arms run
--parallel at a time on the one GPU. Each arm is scored by tau from the real speculative engine on the same
held-out prompts, and by the training-time estimate on held-out features. The best arm (mean engine tau over the
seeds) is then trained again from scratch for as many steps as the time left allows, evaluated on more held-out
prompts with the plain-vs-speculative identity check, and written to --out/drafter/ (weights split into shards of
< 16 MB so that they come back from the GPU box).

--calibrate builds a random target shaped like SmolLM2-135M (with a small test tokenizer) instead of loading --model,
to time every stage of the pipeline before the real run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {  # the seed's four arms
    "kl_mixed_full": {"loss": "kl", "attention": "mixed", "corruption": "full"},
    "kl_mixed_uniform": {"loss": "kl", "attention": "mixed", "corruption": "uniform"},
    "ce_causal_full": {"loss": "ce", "attention": "causal", "corruption": "full"},
    "ce_bidirectional_full": {"loss": "ce", "attention": "bidirectional", "corruption": "full"},
}
T0 = time.perf_counter()


SOLO_STEPS_PER_S = 22.0  # one SmolLM2 drafter run alone on the H200, 512 blocks per step (measured 2026-11-30)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def make_random_smollm(path: Path) -> None:
    """A random Llama with SmolLM2-135M's shape and the tests' small tokenizer (calibration only)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TEMPLATES, build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = TEMPLATES["chatml"]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                      tie_word_embeddings=True, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def train_cmd(a, out: Path, extra: dict) -> list[str]:
    knobs = {"model": a.model, "data-dir": a.work / "data", "out": out, "device": a.device,
             "max-new-tokens": a.max_new_tokens, "max-prompts": a.max_prompts, "max-heldout": a.max_heldout,
             "layers": a.layers, "intermediate-size": a.intermediate_size, "block-size": a.block_size,
             "batch-blocks": a.batch_blocks, "anchors-per-seq": a.anchors_per_seq, "lr": a.lr,
             "gen-batch": a.gen_batch, "log-every": a.log_every, "save-every": 100000,
             "samples-per-prompt": a.samples_per_prompt, "sample-temperature": a.sample_temperature}
    knobs.update(extra)
    cmd = [sys.executable, "-m", "backend.train.run"]
    for k, v in knobs.items():
        if v is True:
            cmd.append(f"--{k}")
        elif v is not False and v is not None:
            cmd += [f"--{k}", str(v)]
    return cmd


def run_many(jobs: list[tuple[str, list[str]]], parallel: int, logs: Path) -> dict[str, int]:
    """Run (name, argv) jobs, `parallel` at a time; each one's output goes to logs/<name>.log."""
    logs.mkdir(parents=True, exist_ok=True)
    pending, running, codes = list(jobs), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            name, cmd = pending.pop(0)
            f = open(logs / f"{name}.log", "w")
            running[name] = (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT), f)
        time.sleep(1.0)
        for name, (proc, f) in list(running.items()):
            if proc.poll() is not None:
                f.close()
                codes[name] = proc.returncode
                del running[name]
                log(f"  {name}: exit {proc.returncode}")
    return codes


def arm_summary(metrics: list[dict]) -> dict:
    def mean_sd(xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            return None, None
        m = sum(xs) / len(xs)
        return m, (sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0

    taus = [m.get("engine", {}).get("tau") for m in metrics]
    ests = [m.get("estimate", {}).get("tau_est") for m in metrics]
    tau, tau_sd = mean_sd(taus)
    est, est_sd = mean_sd(ests)
    return {"tau": tau, "tau_sd": tau_sd, "tau_by_seed": taus, "tau_est": est, "tau_est_sd": est_sd,
            "tau_est_by_seed": ests, "final_loss_by_seed": [m["history"][-1]["loss"] if m.get("history") else None
                                                          for m in metrics]}


def split_safetensors(src: Path, dst: Path, max_bytes: int) -> list[str]:
    """Copy src/model.safetensors into shards of at most max_bytes (load_drafter reads every *.safetensors)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    shards, cur, size = [], {}, 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if cur and size + nbytes > max_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + nbytes
    shards.append(cur)
    names = []
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst / name))
        names.append(name)
    return names


def plot_curves(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in result["arms"].items():
        for run in runs:
            h = run.get("history") or []
            seed = run["config"]["seed"]
            label = f"{name} seed {seed}" if isinstance(seed, int) else name
            ax[0].plot([p["step"] for p in h], [p["loss"] for p in h], label=label)
            ax[1].plot([p["step"] for p in h], [p["acc"][0] for p in h], label=label)
    ax[0].set(xlabel="step", ylabel="training loss (own loss: KL or CE)", yscale="log")
    ax[1].set(xlabel="step", ylabel="draft position 1 accuracy (train)")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--arm-steps", type=int, default=1000)
    ap.add_argument("--parallel", type=int, default=4, help="runs at once on the GPU (8 KL+CE runs did not fit in 139 GB)")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds from start by which everything must end")
    ap.add_argument("--ship-eval-reserve", type=float, default=150.0, help="seconds kept for the final evaluation "
                    "(the engine runs ~25-40 tok/s on the GPU: Python-bound; the plain run for the identity check too)")
    ap.add_argument("--long-steps-max", type=int, default=20000)
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--ship-eval-prompts", type=int, default=16)
    ap.add_argument("--eval-max-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompts", type=int, default=0)
    ap.add_argument("--max-heldout", type=int, default=96)
    ap.add_argument("--gen-batch", type=int, default=384)
    ap.add_argument("--samples-per-prompt", type=int, default=0, help="sampled responses per training prompt "
                    "beside the greedy one (backend.train.run --samples-per-prompt)")
    ap.add_argument("--sample-temperature", type=float, default=0.8)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--intermediate-size", type=int, default=1536)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch-blocks", type=int, default=512)
    ap.add_argument("--anchors-per-seq", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--skip-long", action="store_true")
    ap.add_argument("--long-arm", default=None, help="skip the arms and train this arm long (a second call on a "
                    "machine still warm from the first, whose data and arms sit in --work); 'best': the arm that "
                    "ranks first on the metrics.json files in --work (mean engine tau, then tau_est)")
    ap.add_argument("--arm-time-limit", type=float, default=None, help="seconds of training per arm, a safety net "
                    "so that the call ends inside its limit (default with --skip-long: what the deadline leaves "
                    "per wave of --parallel runs after data, model loads and evaluation; else none)")
    ap.add_argument("--long-extra", default="", help="extra backend.train.run options for the long run only, e.g. "
                    "'--layers 2 --block-size 8' for a drafter shaped for the CPU")
    a = ap.parse_args()
    if a.long_arm and a.long_arm != "best" and a.long_arm not in ARMS:
        ap.error(f"--long-arm must be 'best' or one of {', '.join(ARMS)}")
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("REVIEWER_CACHE_DIR", str(a.work / "cache"))
    os.environ["PYTHONUNBUFFERED"] = "1"
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if a.calibrate:
        a.model = str(a.work / "random-smollm")
        if not Path(a.model, "config.json").is_file():
            make_random_smollm(Path(a.model))
        log(f"calibration target: random SmolLM2-shaped Llama in {a.model}")
    logs = a.work / "logs"
    result: dict = {"command": " ".join(sys.argv), "arms": {}, "timings": {}}

    log("data: target responses and features (once, shared by every run)")
    codes = run_many([("data", train_cmd(a, a.work / "data-run", {"data-only": True}))], 1, logs)
    print((logs / "data.log").read_text()[-3000:], flush=True)
    if codes["data"] != 0:
        sys.exit("data preparation failed")
    result["timings"]["data"] = round(time.perf_counter() - T0, 1)

    seeds = [int(s) for s in a.seeds.split(",")]
    waves = -(-len(a.arms.split(",")) * len(seeds) // max(1, a.parallel))
    arm_limit = a.arm_time_limit
    if arm_limit is None and a.skip_long:  # 75 s per wave: target load + engine evaluation of the arm
        arm_limit = max(60, int((a.deadline - (time.perf_counter() - T0)) / waves - 75))
    if arm_limit:
        log(f"arms: training time limit {arm_limit:.0f} s each (safety net; metrics say if it stopped a run)")
    jobs = []
    for name in a.arms.split(","):
        for seed in seeds:
            jobs.append((f"{name}-s{seed}", train_cmd(a, a.work / "arms" / f"{name}-s{seed}", {
                **ARMS[name], "seed": seed, "steps": a.arm_steps, "eval-prompts": a.eval_prompts,
                "eval-max-tokens": a.eval_max_tokens, "time-limit": arm_limit or None})))
    if a.long_arm:
        jobs = []  # the arms ran in an earlier call: read their metrics from --work
    log(f"arms: {len(jobs)} runs x {a.arm_steps} steps x {a.batch_blocks} blocks, {a.parallel} at a time")
    t_arms = time.perf_counter()
    run_many(jobs, a.parallel, logs)
    result["timings"]["arms"] = round(time.perf_counter() - t_arms, 1)
    rates = []
    for name in a.arms.split(","):
        runs = []
        for seed in seeds:
            path = a.work / "arms" / f"{name}-s{seed}" / "metrics.json"
            if path.is_file():
                m = json.loads(path.read_text())
                runs.append(m)
                if m["train_seconds"]:
                    rates.append(m["budget"]["steps"] / m["train_seconds"])
            else:
                print((logs / f"{name}-s{seed}.log").read_text()[-2000:], flush=True)
        result["arms"][name] = runs
    result["summary"] = {name: arm_summary(runs) for name, runs in result["arms"].items() if runs}
    ranked = sorted(result["summary"], key=lambda n: (result["summary"][n]["tau"] or 0, result["summary"][n]["tau_est"] or 0),
                    reverse=True)
    result["ranking"] = ranked
    if a.long_arm and a.long_arm != "best":
        ranked = [a.long_arm]
    if not ranked:
        sys.exit("no arm finished")
    best = ranked[0]
    result["best"] = best
    log(f"best arm: {best}")

    if not a.skip_long:
        # no arm metrics (--long-arm NAME on a fresh --work): the rate one run alone reached on the H200, 22-24
        # steps/s at 512 blocks (2026-11-30), stands in, scaled so that the formula below returns it
        concurrent_rate = sum(rates) / len(rates) if rates else SOLO_STEPS_PER_S / (a.parallel * 0.7)
        # alone on the GPU a run is faster, but not `parallel` times (2026-11-29: 8 at once ran 5 steps/s each, one
        # alone 17.5); with --long-arm the arms ran in an earlier call, --parallel at a time
        ran_at_once = a.parallel if a.long_arm else min(a.parallel, max(1, len(jobs)))
        solo_rate = concurrent_rate * ran_at_once * 0.7
        left = a.deadline - (time.perf_counter() - T0) - a.ship_eval_reserve - 25  # 25 s: target + data load
        steps = int(max(a.arm_steps, min(a.long_steps_max, solo_rate * left)))
        log(f"long run: {best}, {steps} steps planned (time limit {max(30, int(left))} s, {solo_rate:.1f} steps/s "
            "expected)")
        result["long_plan"] = {"arm": best, "steps": steps, "time_limit": max(30, int(left)),
                               "expected_steps_per_s": round(solo_rate, 2)}
        long_out = a.work / "long"
        cmd = train_cmd(a, long_out, {**ARMS[best], "seed": seeds[0], "steps": steps, "time-limit": max(30, int(left)),
                                      "eval-prompts": a.ship_eval_prompts, "eval-max-tokens": a.eval_max_tokens,
                                      "eval-check-plain": True})
        run_many([("long", cmd + a.long_extra.split())], 1, logs)
        if (long_out / "metrics.json").is_file():
            result["long"] = json.loads((long_out / "metrics.json").read_text())
            ship = a.out / "drafter"
            ship.mkdir(exist_ok=True)
            (ship / "config.json").write_text((long_out / "config.json").read_text())
            result["long"]["shards"] = split_safetensors(long_out, ship, 15 * 2**20)
        else:
            print((logs / "long.log").read_text()[-3000:], flush=True)
    result["timings"]["total"] = round(time.perf_counter() - T0, 1)
    (a.out / "ablation.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(a.out / "logs.txt", "w") as f:
        for p in sorted(logs.glob("*.log")):
            f.write(f"===== {p.name}\n{p.read_text()[-6000:]}\n")
    curves = dict(result["arms"])
    if "long" in result:
        curves[f"long {best}"] = [{"config": {"seed": "long"}, "history": result["long"].get("history")}]
    plot_curves({"arms": curves}, a.out / "loss_curves.png")

    print(f"\n{'arm':<24}{'tau (engine)':>16}{'tau_est':>16}{'final loss':>22}")
    for name, s in result["summary"].items():
        fl = " ".join(f"{x:.3f}" for x in s["final_loss_by_seed"] if x is not None)
        print(f"{name:<24}{s['tau'] or 0:>9.2f} ±{s['tau_sd'] or 0:<5.2f}{s['tau_est'] or 0:>9.2f} ±{s['tau_est_sd'] or 0:<5.2f}"
              f"{fl:>22}")
    if "long" in result:
        e, L = result["long"].get("engine", {}), result["long"]
        print(f"long {best}: {L['budget']['steps']} steps in {L['train_seconds']} s, tau_est "
              f"{L.get('estimate', {}).get('tau_est')}, engine tau {e.get('tau')}, identical {e.get('identical_to_plain')}"
              f" ({e.get('identical_prompts')}/{e.get('prompts')}), acceptance "
              + " ".join(f"{x:.2f}" for x in e.get("acceptance", [])))
    log("done")


if __name__ == "__main__":
    main()
