"""`reviewer train`: train a DFlash drafter for a target on the target's own outputs.

    backend.train.run.main(model="embedded", out=Path("runs/smol"), loss="kl", attention="mixed", steps=2000)
    python -m backend.train --model embedded --out runs/smol --loss kl --attention mixed --steps 2000

Pipeline: prompts (the built-in set, --from-db, --from-transcripts) -> the target's greedy responses -> the target's features
in shards (backend/train/data.py) -> training -> a z-lab checkpoint in --out (config.json + model.safetensors, what
dflash.checkpoint.load_drafter and the engine load) -> evaluation: the training-time estimate of the accepted length on
held-out features, and tau measured by the real speculative engine on held-out prompts.

The drafter is backend.dflash.model.DFlashDrafter; the target's embedding and LM head are used frozen (the drafter has
none of its own). Training runs many blocks per sequence in one forward (`block_forward`): every block's queries see
the context features before its anchor and its own block, which is exactly what DFlashDrafter.block_hidden computes
at inference for one block (tests/backend/train/test_train.py checks the two agree).

Knobs (all on the command line): loss `ce` (labels = the target's argmax) or `kl` (to the target's distribution),
position weight w_k = exp(-(k-1)/decay); block attention `mixed` | `bidirectional` | `causal`; corruption `full`
(every slot but the first masked, as at inference) or `uniform` (each block masks a random fraction r ~ U(0,1) of
its slots; loss on masked slots only); labels `on-path` (a slot trains only while the hidden tokens before it are the
target's greedy choices) or `all`; block size, layers, MLP width, target layers, restricted vocabulary top-K, seed;
`--init-from` a saved drafter.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

import torch

from backend.dflash.checkpoint import build_draft_vocab, read_drafter_config, save_drafter
from backend.dflash.model import BLOCK_ATTENTION_MODES, DFlashDrafter
from backend.loading import ModelLoadError, load_model
from backend.train import data as td
from backend.train import prompts as tp
from backend.train import config
from backend.train.objective import (block_loss, frozen_parts, init_from_checkpoint, make_blocks, new_drafter,
                                  parse_layer_ids, position_weights, sample_batch)
from backend.train.config import (ARCH_KNOBS, CORRUPTIONS, KNOB_BEFORE_IT_EXISTED, LABELS, LOSSES, METRICS_FILE,
                                  OPTION_HELP, STATE_FILE, TrainConfig, TrainError, log)
from backend.train.evaluate import estimate_acceptance, evaluate_engine, walk_acceptance, walk_anchor_table

# ---- checkpoints --------------------------------------------------------------------------------------------------


def save_checkpoint(drafter: DFlashDrafter, out: Path, state: dict) -> None:
    """The drafter in the z-lab format (bf16 weights: what the engine loads) and the training state beside it
    (fp32 master weights, optimizer, step, history), each written to a temporary name and renamed into place."""
    copy = DFlashDrafter(drafter.cfg)
    copy.load_state_dict(drafter.state_dict())
    copy.to(torch.bfloat16)
    if drafter.draft_vocab is not None:
        copy.restrict_vocab(drafter.draft_vocab.cpu(), drafter.cfg.vocab_size)
    tmp = out / ".saving"
    save_drafter(copy, tmp)
    for name in ("config.json", "model.safetensors"):
        (tmp / name).replace(out / name)
    tmp.rmdir()
    torch.save(state, out / (STATE_FILE + ".tmp"))
    (out / (STATE_FILE + ".tmp")).replace(out / STATE_FILE)


def _lr_at(step: int, cfg: TrainConfig) -> float:
    warmup = max(1, cfg.steps // 20)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))  # cosine to a tenth


class Progress:
    """A rich progress bar on a terminal; plain log lines every `every` steps otherwise (CI, logs, the GPU box)."""

    def __init__(self, total: int, start: int, every: int):
        self.every, self.bar = every, None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                           TextColumn("{task.fields[info]}"), transient=False)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, step: int, info: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif step % self.every == 0:
            log(f"step {step:>6}  {info}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# ---- main ---------------------------------------------------------------------------------------------------------


def _check(cfg: TrainConfig) -> None:
    choices = {"loss": LOSSES, "attention": BLOCK_ATTENTION_MODES, "corruption": CORRUPTIONS, "labels": LABELS,
               "device": ("auto", "cpu", "cuda"), "dtype": ("auto", "float32", "bfloat16")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise TrainError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, not {getattr(cfg, name)!r}")
    positive = ("layers", "intermediate_size", "steps", "batch_blocks", "anchors_per_seq", "length_groups",
                "max_new_tokens", "gen_batch", "gen_tokens", "save_every", "log_every", "max_prompt_tokens")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise TrainError(f"--{name.replace('_', '-')} must be positive")
    if cfg.block_size < 2:
        raise TrainError("--block-size must be at least 2 (the known token plus one draft)")
    if cfg.decay <= 0 or cfg.lr <= 0:
        raise TrainError("--decay and --lr must be positive")
    if not 0.0 <= cfg.walk_anchors <= 1.0:
        raise TrainError("--walk-anchors must be between 0 and 1")
    if cfg.samples_per_prompt < 0 or cfg.sample_temperature <= 0:
        raise TrainError("--samples-per-prompt must be >= 0 and --sample-temperature positive")
    if not cfg.builtin_prompts and not cfg.builtin_extra and not cfg.from_db and not cfg.from_transcripts:
        raise TrainError("no prompts: keep the built-in set or give --from-db reviews.db or --from-transcripts FILE")
    if cfg.sliding_window < -1:
        raise TrainError("--sliding-window must be a number of positions, 0 (none) or -1 (the --init-from drafter's)")


def inherited_window(cfg: TrainConfig) -> int:
    """--sliding-window -1 (the default): the window of the drafter --init-from names (a fine-tune of the shipped
    drafter keeps the window it drafts with: bench/results/drafter_window_*), else none. An unreadable --init-from is
    left to init_from_checkpoint, which says what is wrong with it."""
    if cfg.sliding_window >= 0:
        return cfg.sliding_window
    if not cfg.init_from:
        return 0
    try:
        return read_drafter_config(cfg.init_from).sliding_window or 0
    except (OSError, ValueError):
        return 0


def load_records(cfg: TrainConfig) -> list[tp.PromptRecord]:
    import hashlib

    records = ((tp.load_builtin() if cfg.builtin_prompts else [])
               + (tp.load_builtin(tp.BUILTIN_EXTRA) if cfg.builtin_extra else [])
               + (tp.load_from_db(cfg.from_db) if cfg.from_db else [])
               + (tp.load_transcripts(cfg.from_transcripts) if cfg.from_transcripts else []))
    order = sorted(records, key=lambda r: hashlib.sha256(r.id.encode()).hexdigest())  # stable, category-mixed
    train = [r for r in order if r.split == "train"]
    held = [r for r in order if r.split == "heldout"]
    if cfg.max_prompts:
        train = train[: cfg.max_prompts]
    if not train:
        raise TrainError("the prompt sources gave no training prompts")
    return train + held[: cfg.max_heldout]


@dataclass
class Run:
    """The state of a training run that a checkpoint saves and a resume restores."""
    drafter: DFlashDrafter
    opt: torch.optim.Optimizer
    gen: torch.Generator
    cfg: TrainConfig
    step: int = 0
    history: list = field(default_factory=list)
    train_seconds: float = 0.0

    def state_dict(self) -> dict:
        return {"drafter": self.drafter.state_dict(), "optimizer": self.opt.state_dict(), "rng": self.gen.get_state(),
                "step": self.step, "history": self.history, "train_seconds": self.train_seconds,
                "config": asdict(self.cfg)}

    def resume(self, state_path: Path, out: Path, device) -> None:
        state = torch.load(state_path, map_location=device, weights_only=False)
        changed = [k for k in ARCH_KNOBS
                   if state["config"].get(k, KNOB_BEFORE_IT_EXISTED.get(k)) != getattr(self.cfg, k)]
        if changed:
            raise TrainError(f"--resume: {', '.join('--' + k.replace('_', '-') for k in changed)} differ from the run "
                             f"in {out}")
        self.drafter.load_state_dict(state["drafter"])
        self.opt.load_state_dict(state["optimizer"])
        self.gen.set_state(state["rng"].cpu())  # map_location moved it to the device
        self.step, self.history, self.train_seconds = state["step"], state["history"], state["train_seconds"]
        log(f"resumed {out} at step {self.step}")


def main(**knobs) -> dict:
    """Train (or resume) a drafter; returns the metrics also written to <out>/metrics.json."""
    unknown = set(knobs) - {f.name for f in fields(TrainConfig)}
    if unknown:
        raise TypeError(f"unknown options: {sorted(unknown)}")
    cfg = TrainConfig(**{k: (str(v) if isinstance(v, Path) else v) for k, v in knobs.items()})
    _check(cfg)
    cfg.sliding_window = inherited_window(cfg)

    t_start = time.perf_counter()
    loaded = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    target, device = loaded.model, torch.device(loaded.device)
    target.requires_grad_(False)
    out = Path(cfg.out or f"runs/dflash-{loaded.name}")
    if (out / STATE_FILE).is_file() and not cfg.resume:
        raise TrainError(f"{out} holds a training run already: pass --resume to continue it, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    layer_ids = parse_layer_ids(cfg.target_layers, target.config.get_text_config().num_hidden_layers)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else out / "data"
    t0 = time.perf_counter()
    manifest = prepare_training_data(cfg, loaded, data_dir, layer_ids)
    data_seconds = time.perf_counter() - t0
    if cfg.responses_only:
        return manifest  # the summary: where the responses went
    if cfg.data_only:
        summary = {"data_dir": str(data_dir), "seconds": round(data_seconds, 1),
                   "splits": {s: {k: v for k, v in m.items() if k not in ("shards", "records", "categories")}
                              | {"sequences": len(m["records"])} for s, m in manifest["splits"].items()}}
        log(json.dumps(summary))
        return summary
    train_set = td.load_features(data_dir, "train", device)
    held_set = td.load_features(data_dir, "heldout", device) if manifest["splits"]["heldout"]["shards"] else None
    log(f"data: {len(train_set)} train sequences ({train_set.tokens.shape[0]} positions, "
        f"{int(train_set.anchor_counts().sum())} block starts), {len(held_set) if held_set else 0} held out")

    run, frozen = new_run(cfg, target, loaded.name, layer_ids, train_set, out, device)
    n_seqs = max(1, cfg.batch_blocks // cfg.anchors_per_seq)
    stopped_early = train_steps(cfg, run, frozen, train_set, manifest, out, device, n_seqs)
    log(f"trained {run.step} steps in {run.train_seconds:.0f} s; drafter in {out}")

    cuda = device.type == "cuda"
    metrics = {"command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "config": asdict(cfg), "target": loaded.name, "target_layer_ids": layer_ids,
               "device": torch.cuda.get_device_name() if cuda else "cpu",
               "data": {k: manifest["splits"][s].get(k) for s in ("train",) for k in ("prompt_tokens", "response_tokens")}
               | {"train_sequences": len(train_set), "heldout_sequences": len(held_set) if held_set else 0,
                  "seconds": round(data_seconds, 1)},
               "budget": {"steps": run.step, "blocks_per_step": n_seqs * cfg.anchors_per_seq,
                          "blocks_seen": run.step * n_seqs * cfg.anchors_per_seq, "stopped_by_time_limit": stopped_early},
               "train_seconds": round(run.train_seconds, 1), "history": run.history,
               "params_m": round(sum(p.numel() for p in run.drafter.parameters()) / 1e6, 2),
               "checkpoint_mb": round((out / "model.safetensors").stat().st_size / 2**20, 2)}
    if held_set is not None:
        metrics.update(held_out_metrics(cfg, run.drafter, frozen, held_set, target, out, manifest))
    metrics["total_seconds"] = round(time.perf_counter() - t_start, 1)
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def prepare_training_data(cfg: TrainConfig, loaded, data_dir: Path, layer_ids: list[int]) -> dict:
    """The prompts' target responses and features in data_dir (generated, or reused where present); the manifest."""
    records = load_records(cfg)
    given = td.load_responses([Path(p) for p in cfg.responses.split(",") if p], loaded.name) if cfg.responses \
        else None
    if given:
        log(f"data: {len(given)} responses from earlier runs ({cfg.responses})")
    return td.prepare_data(loaded.model, loaded.tokenizer, records, data_dir, target_name=loaded.name,
                           layer_ids=layer_ids, max_new_tokens=cfg.max_new_tokens,
                           max_prompt_tokens=cfg.max_prompt_tokens, gen_batch=cfg.gen_batch, gen_tokens=cfg.gen_tokens,
                           samples=cfg.samples_per_prompt, temperature=cfg.sample_temperature, seed=cfg.seed,
                           given=given, responses_only=cfg.responses_only, log=log)


def new_run(cfg: TrainConfig, target, target_name: str, layer_ids: list[int], train_set, out: Path, device):
    """The drafter (new, from --init-from, or resumed with its optimizer and RNG) and the target's frozen parts."""
    drafter = new_drafter(cfg, target, layer_ids, target_name)
    resuming = cfg.resume and (out / STATE_FILE).is_file()
    if cfg.init_from and not resuming:  # a resumed run continues from its own weights
        init_from_checkpoint(drafter, Path(cfg.init_from))
        log(f"drafter: starting from the weights in {cfg.init_from}")
    vocab = target.get_input_embeddings().weight.shape[0]
    if cfg.vocab_top_k:
        drafter.restrict_vocab(build_draft_vocab(td.token_counts(train_set, vocab), cfg.vocab_top_k), vocab)
    drafter.to(device).train()
    frozen = frozen_parts(target, drafter.draft_vocab, torch.bfloat16 if device.type == "cuda" else torch.float32)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    run = Run(drafter, opt, torch.Generator().manual_seed(cfg.seed), cfg)
    if resuming:
        run.resume(out / STATE_FILE, out, device)
    return run, frozen


def train_steps(cfg: TrainConfig, run: Run, frozen, train_set, manifest: dict, out: Path, device, n_seqs: int) -> bool:
    """Steps until cfg.steps (or the time limit: returns True then), checkpointing every save_every and at the end."""
    cuda = device.type == "cuda"
    drafter, mask_id = run.drafter, run.drafter.cfg.mask_token_id
    weights = position_weights(cfg.block_size, cfg.decay, device)
    counts = train_set.anchor_counts()
    walk = None
    if cfg.walk_anchors > 0:
        t0 = time.perf_counter()
        records = manifest["splits"]["train"]["records"]
        greedy = [i for i, r in enumerate(train_set.index) if "~" not in records[r]]  # "<id>~k": sampled
        walk = walk_anchor_table(drafter, frozen, train_set, cfg.block_size, mask_id, greedy, autocast=cuda)
        n_walked = int(walk.counts.sum())
        log(f"walk anchors: {n_walked} block starts greedy decoding visits in {len(greedy)} greedy responses "
            f"(tau_walk {int(counts[greedy].sum()) / max(n_walked, 1):.2f} on them), "
            f"{time.perf_counter() - t0:.0f} s")
    need_final = cfg.loss == "kl"
    progress = Progress(cfg.steps, run.step, cfg.log_every)
    window = {"loss": 0.0, "n": 0, "hits": torch.zeros(cfg.block_size, device=device),
              "counts": torch.zeros(cfg.block_size, device=device)}
    t_loop = time.perf_counter() - run.train_seconds
    stopped_early = False
    try:
        while run.step < cfg.steps:
            if cfg.time_limit and time.perf_counter() - t_loop > cfg.time_limit:
                stopped_early = True
                break
            for group in run.opt.param_groups:
                group["lr"] = _lr_at(run.step, cfg)
            seqs, anchors = sample_batch(train_set, counts, n_seqs, cfg.anchors_per_seq, run.gen, walk,
                                         cfg.walk_anchors)
            blocks = make_blocks(train_set, seqs, anchors, cfg.block_size, mask_id, cfg.corruption, need_final,
                                 torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + run.step),
                                 on_path_only=cfg.labels == "on-path")
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss, hits, n = block_loss(drafter, frozen, blocks, cfg.loss, weights,
                                           length_groups=cfg.length_groups)
            run.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            run.opt.step()
            run.step += 1
            window["loss"] += float(loss.detach())
            window["n"] += 1
            window["hits"] += hits
            window["counts"] += n
            if run.step % cfg.log_every == 0 or run.step == cfg.steps:
                acc = (window["hits"] / window["counts"].clamp_min(1)).tolist()[1:]
                run.history.append({"step": run.step, "loss": window["loss"] / window["n"],
                                    "acc": [round(a, 4) for a in acc], "seconds": round(time.perf_counter() - t_loop, 1)})
                window = {"loss": 0.0, "n": 0, "hits": torch.zeros_like(window["hits"]),
                          "counts": torch.zeros_like(window["counts"])}
                progress.update(run.step, f"loss {run.history[-1]['loss']:.3f}  acc@1..4 "
                                          + " ".join(f"{a:.2f}" for a in acc[:4]))
            else:
                progress.update(run.step, "")
            if run.step % cfg.save_every == 0 and run.step < cfg.steps:
                run.train_seconds = time.perf_counter() - t_loop
                save_checkpoint(drafter, out, run.state_dict())
    finally:
        progress.close()
    run.train_seconds = time.perf_counter() - t_loop
    save_checkpoint(drafter, out, run.state_dict())
    return stopped_early


def held_out_metrics(cfg: TrainConfig, drafter, frozen, held_set, target, out: Path, manifest: dict) -> dict:
    """The held-out estimate and walk, and (--eval-prompts) tau by the real speculative engine."""
    cuda = next(drafter.parameters()).is_cuda
    mask_id = drafter.cfg.mask_token_id
    metrics = {"estimate": estimate_acceptance(drafter, frozen, held_set, cfg.block_size, mask_id, autocast=cuda),
               "walk": walk_acceptance(drafter, frozen, held_set, cfg.block_size, mask_id, autocast=cuda)}
    walk = metrics["walk"]["tau_walk"]
    log(f"held-out estimate: tau_est {metrics['estimate']['tau_est']:.2f} over {metrics['estimate']['blocks']} blocks"
        + (f"; tau_walk {walk:.2f} (the blocks decoding visits, {metrics['walk']['cycles']} cycles)" if walk else ""))
    if cfg.eval_prompts:
        n = min(cfg.eval_prompts, len(held_set))
        prompts = [held_set.tokens[held_set.offsets[i]: held_set.offsets[i] + held_set.prompt_lens[i]].tolist()
                   for i in range(n)]
        metrics["engine"] = e = evaluate_engine(target, out, prompts, cfg.eval_max_tokens,
                                                tuple(manifest.get("stop_ids", ())), cfg.eval_check_plain)
        log(f"engine on {n} held-out prompts: tau {e['tau']:.2f}, acceptance "
            + " ".join(f"{a:.2f}" for a in e["acceptance"][:8])
            + (f", identical to plain: {e['identical_to_plain']}" if "identical_to_plain" in e else ""))
    return metrics


# ---- command line (python -m backend.train; `reviewer train` calls main with the same options) ----------------


def cli(argv: list[str] | None = None, prog: str = "python -m backend.train") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        text = OPTION_HELP[f.name]
        if f.type in ("bool", bool):
            if f.name == "builtin_prompts":
                ap.add_argument("--no-builtin-prompts", dest=f.name, action="store_false", help=text)
            else:
                ap.add_argument(flag, action="store_true", help=text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            ap.add_argument(flag, type=kind, default=f.default,
                            help=text + ("" if f.default in (None, "") else f" [default: {f.default}]"))
    a = ap.parse_args(argv)

    try:
        main(**vars(a))
    except (TrainError, config.DataError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
