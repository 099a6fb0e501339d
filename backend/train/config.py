"""The training run's options: TrainConfig (every knob of `reviewer train`, with its help text), the choices they
take, what a resumed run must keep, and TrainError for user mistakes."""

from __future__ import annotations

from dataclasses import dataclass

LOSSES = ("kl", "ce")
CORRUPTIONS = ("full", "uniform")
LABELS = ("on-path", "all")
STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.json"
# knobs that must not change when a run is resumed (the rest: steps, time limit, logging, evaluation)
ARCH_KNOBS = ("loss", "decay", "attention", "corruption", "block_size", "layers", "intermediate_size", "target_layers",
              "vocab_top_k", "sliding_window", "mask_token_id", "batch_blocks", "anchors_per_seq", "lr", "seed",
              "labels", "walk_anchors")
# what a run saved before a knob existed trained with (resuming such a run must not trip over the new knob)
KNOB_BEFORE_IT_EXISTED = {"labels": "all", "walk_anchors": 0.0}


class DataError(ValueError):
    """Unusable training data (a missing or malformed file, an empty prompt set): reported without a traceback."""


class TrainError(ValueError):
    """A user mistake (bad option, unusable output folder): reported as one line, no traceback."""


@dataclass
class TrainConfig:
    model: str = "embedded"
    out: str = ""
    device: str = "auto"
    dtype: str = "float32"  # the target's dtype while generating data and features
    # data
    builtin_prompts: bool = True
    builtin_extra: bool = False
    from_db: str | None = None
    from_transcripts: str | None = None
    max_prompts: int = 0  # 0: all training prompts
    max_heldout: int = 96
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 256
    samples_per_prompt: int = 0  # sampled responses per training prompt, beside the greedy one
    sample_temperature: float = 0.8
    gen_batch: int = 64
    gen_tokens: int = 1 << 18
    data_dir: str | None = None
    data_only: bool = False
    responses: str | None = None
    responses_only: bool = False
    # drafter
    layers: int = 3
    intermediate_size: int = 1536
    block_size: int = 16
    target_layers: str = "auto"
    vocab_top_k: int = 0
    sliding_window: int = -1  # -1: the --init-from drafter's window, else none
    mask_token_id: int = -1
    # training
    loss: str = "kl"
    decay: float = 7.0
    attention: str = "mixed"
    corruption: str = "full"
    labels: str = "on-path"
    init_from: str | None = None
    steps: int = 2000
    batch_blocks: int = 512
    anchors_per_seq: int = 16
    walk_anchors: float = 0.0
    length_groups: int = 1
    lr: float = 1e-3
    seed: int = 0
    time_limit: float = 0.0
    save_every: int = 500
    log_every: int = 25
    resume: bool = False
    # evaluation
    eval_prompts: int = 16
    eval_max_tokens: int = 128
    eval_check_plain: bool = False


# One line of help per option: the argparse CLI (run.py) and `reviewer train` (typer) both use it.
OPTION_HELP = {
    "model": "Target: 'embedded' (SmolLM2-135M-Instruct), a Hugging Face folder or a .gguf file.",
    "out": "Output folder: the drafter (config.json + model.safetensors, z-lab format), train_state.pt, metrics.json "
           "[default: runs/dflash-<target name>].",
    "device": "auto, cpu or cuda.",
    "dtype": "The target's dtype while it writes responses and features: float32, bfloat16 or auto.",
    "builtin_prompts": "The built-in prompt set (backend/prompts/builtin.jsonl) is used unless --no-builtin-prompts.",
    "builtin_extra": "Also the extra built-in training prompts (backend/prompts/builtin_extra.jsonl.gz: 9,135 code "
                     "review, debugging, performance, agent, README and coding prompts on code and docs the main set "
                     "does not quote; training split only, so the held-out prompts and their figures stay the same).",
    "from_db": "Also learn the review loop's own workload: prompts from the transcripts in this reviews.db.",
    "from_transcripts": "Also learn agent sessions replayed through `reviewer serve` (`python -m backend.bench.replay "
                        "--transcripts FILE`): every assistant turn's context, growing to the window (comma-separated "
                        "files). Raise --max-prompt-tokens to keep the long turns.",
    "max_prompts": "At most this many training prompts (0: all).",
    "max_heldout": "At most this many held-out prompts (features for the estimate; the first --eval-prompts of them "
                   "for the engine).",
    "max_prompt_tokens": "Skip prompts longer than this (tokens).",
    "max_new_tokens": "Length cap of the target's greedy responses (tokens).",
    "samples_per_prompt": "Also this many sampled responses per training prompt (beside the greedy one): more, and "
                          "more varied, contexts from the target's own distribution (held-out prompts stay greedy).",
    "sample_temperature": "Temperature of those sampled responses.",
    "gen_batch": "Prompts per batch while the target generates its responses.",
    "gen_tokens": "Cache positions per generation batch (its prompts' tokens plus their response caps): long prompts "
                  "batch fewer. Raise it with --gen-batch on a big GPU (fp32 SmolLM2: ~46 KB per position).",
    "data_dir": "Where the response/feature shards go; reused when target, layers and prompts match "
                "[default: <out>/data].",
    "data_only": "Generate the responses and features, then stop.",
    "responses": "Reuse responses generated earlier: comma-separated responses.jsonl files, gzipped ones too (or "
                 "data dirs holding one; every run writes <data-dir>/responses.jsonl). Prompts and sample rounds they "
                 "cover are not generated again; the target must be the same model.",
    "responses_only": "Generate the responses, write <data-dir>/responses.jsonl and stop (no features, no training): "
                      "e.g. on a CPU, for a GPU run to reuse with --responses.",
    "layers": "Drafter layers (the last one full attention, the others sliding-window layers).",
    "intermediate_size": "Drafter MLP width (its hidden size is the target's: it shares the target's embedding and "
                         "LM head).",
    "block_size": "Block size: the known token plus block_size-1 drafted tokens.",
    "target_layers": "Target layers whose outputs the drafter reads: 'auto' (5 spread over the depth) or e.g. "
                     "'1,8,14,21,28'.",
    "vocab_top_k": "Restrict the draft vocabulary to the K tokens the target emits most (0: the full vocabulary).",
    "sliding_window": "Sliding window of the sliding layers, in positions (0: none; -1: the window of the drafter "
                      "--init-from names, else none).",
    "mask_token_id": "Token id used for masked block slots (-1: the last id of the vocabulary).",
    "loss": "kl (to the target's distribution) or ce (labels = the target's argmax).",
    "decay": "Position weight w_k = exp(-(k-1)/decay) for draft position k.",
    "attention": "Attention inside the block: mixed (causal on sliding layers, bidirectional on full), "
                 "bidirectional or causal.",
    "corruption": "full (mask every slot but the first, as at inference) or uniform (mask a random fraction).",
    "labels": "Which drafted slots a block learns from: on-path (slot k counts only while the masked response tokens "
              "before it in the block are the target's own greedy choices: a sampled response leaves the greedy path, "
              "and a drafter that sees only masks cannot know where, while the engine only ever extends the greedy "
              "path) or all.",
    "init_from": "Start from this drafter's weights (a checkpoint folder, e.g. the shipped one) instead of random "
                 "ones: fine-tune it on more data, new prompts (--from-db) or other knobs. Its shape (MLP width, "
                 "target layers, block size) must match the run's; a restricted vocabulary in it is not kept. More "
                 "--layers than it has: the new layers go before its last one with their outputs at zero, so the "
                 "run starts from the same drafts.",
    "steps": "Optimizer steps.",
    "batch_blocks": "Blocks per step.",
    "anchors_per_seq": "Blocks per sequence in a step (sequences per step = batch_blocks / anchors_per_seq).",
    "walk_anchors": "Share of each step's blocks anchored where greedy decoding with the drafter as the run starts "
                    "(--init-from or --resume) anchors them: right after a draft miss, the blocks tau_walk and the "
                    "engine measure, harder than the evenly spread rest. Walked on the greedy responses (the engine's "
                    "path) when the run starts; sampled responses keep uniform anchors. 0: all uniform.",
    "length_groups": "Run a step's sequences in this many sub-batches of similar length, each padded only to its own "
                     "longest context (the same loss and gradients as one batch; 1: one batch). Faster on a CPU (2.2x "
                     "at 4), slower on the H200 (0.37x at 4): see docs/training.md.",
    "lr": "Peak learning rate (AdamW; linear warm-up over the first twentieth of the steps, then cosine down to a tenth).",
    "seed": "Seed of the initialization and of the batch sampling.",
    "time_limit": "Stop training once the run has trained this many seconds in all, earlier sessions of a resumed "
                  "run included (0: no limit); the checkpoint is saved.",
    "save_every": "Save a checkpoint every this many steps.",
    "log_every": "Log loss and per-position accuracy every this many steps (the progress bar on a terminal).",
    "resume": "Continue the run in --out from its last checkpoint, up to --steps.",
    "eval_prompts": "Held-out prompts decoded by the real speculative engine after training (0: skip).",
    "eval_max_tokens": "Tokens per held-out prompt in that evaluation.",
    "eval_check_plain": "Also decode the held-out prompts without the drafter and check the output is identical.",
}


def log(msg: str) -> None:
    print(msg, flush=True)
