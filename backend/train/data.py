"""Training data for DFlash drafters: prompts -> the target's own greedy responses -> the target's features, in shards.

Data flow (backend/train/run.py drives it):
  prompts      prompts.py: load_builtin() (backend/prompts/builtin.jsonl, made by bench/train_build_prompts.py)
               and/or load_from_db() (the review loop's transcripts in reviews.db: every assistant turn's context)
  token ids    render() with the target's chat template (backend.chat, exactly as the server renders requests)
  responses    generate_responses(): the target's greedy continuation (and, with samples, sampled ones), batched
               (the drafter learns the target's distribution, not a dataset's); all of them are also written to
               <data dir>/responses.jsonl, and load_responses() reads such files back so a later run (another
               machine, another session) reuses them instead of generating again
  features     extract_features(): one forward over prompt + response; keeps per position the outputs of the
               `target_layer_ids` decoder layers (what the drafter reads), the final normed hidden state (the KL loss
               recomputes the target's logits from it with the frozen LM head) and the target's argmax (CE labels,
               from exact logits); written to safetensors shards with a manifest
  FeatureSet   the shards loaded back onto the training device, with padded batch gathering
"""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backend.chat import render_chat, stop_token_ids
from backend.dflash.model import select_features
from backend.train.config import DataError
from backend.train.prompts import PromptRecord

MANIFEST = "manifest.json"
RESPONSES = "responses.jsonl"


# ---- token ids ----------------------------------------------------------------------------------------------------


def render(tokenizer, record: PromptRecord) -> list[int]:
    """The prompt's token ids, rendered as the server renders a chat request for this target."""
    _, ids = render_chat(tokenizer, record.messages, record.tools)
    return [int(t) for t in ids]


GEN_CACHES = ("dynamic", "static")


@torch.inference_mode()
def generate_responses(model, prompts: list[list[int]], *, max_new_tokens: int, stops: tuple[int, ...],
                       batch_size: int, batch_tokens: int = 1 << 18, temperature: float = 0.0, seed: int = 0,
                       cache: str = "dynamic", log=print) -> list[list[int]]:
    """The target's responses (greedy, or sampled at `temperature` > 0 from `seed`), batched with left padding; each
    cut after its first stop token (kept: the drafter learns to draft the end of a turn too).
    cache: "dynamic" (transformers' default: the KV cache grows by concatenation every step) or "static" (allocated
    once per batch and written in place, eager). Only bench/train_gen_speed.py asks for static: on the H200 it gave
    nothing (fp32 generation is bound by fp32 matmuls and attention, not by the cache's copies; --dtype bfloat16 is
    what halves it)."""
    if cache not in GEN_CACHES:
        raise DataError(f"unknown generation cache {cache!r}: choose one of {', '.join(GEN_CACHES)}")
    if temperature > 0:
        torch.manual_seed(seed)
    device = next(model.parameters()).device
    pad = stops[0] if stops else 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    out: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    start = 0
    while start < len(order):
        # at most batch_size prompts, and at most batch_tokens cache positions (long agent prompts batch fewer)
        end = start + 1
        while (end < len(order) and end - start < batch_size
               and (end - start + 1) * (len(prompts[order[end]]) + max_new_tokens) <= batch_tokens):
            end += 1
        idx = order[start:end]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, temperature=None, top_p=None,
                  top_k=None)
        if temperature > 0:  # the whole distribution at that temperature: no top-k / top-p cut
            kw.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        if cache == "static":
            kw.update(cache_implementation="static", disable_compile=True)
        if stops:
            kw["eos_token_id"] = list(stops)
        else:
            kw["min_new_tokens"] = max_new_tokens
        gen = model.generate(ids.to(device), attention_mask=mask.to(device), **kw)[:, width:].tolist()
        for row, i in enumerate(idx):
            tokens = gen[row]
            cut = next((j for j, t in enumerate(tokens) if t in stops), None)
            out[i] = tokens if cut is None else tokens[: cut + 1]
        start = end
        log(f"  generated {end}/{len(order)} responses ({time.perf_counter() - t0:.1f} s)")
    return out


# ---- features -----------------------------------------------------------------------------------------------------


@torch.inference_mode()
def extract_features(model, sequences: list[list[int]], prompt_lens: list[int], layer_ids: list[int],
                     out_dir: Path, *, prompt_keys: list[int] | None = None, batch_tokens: int = 16384,
                     shard_tokens: int = 1 << 20, log=print) -> list[dict]:
    """Run the target over each prompt + response; write shards of per-position features to out_dir.
    Sequences with the same prompt_keys entry share their prompt (a training prompt's greedy and sampled responses):
    its positions' features are stored once, with the first of them written, and the others store only their
    response positions (`skip` = prompt length; causal attention makes the prompt's features the same in all of
    them). With four sampled responses per prompt that was 55% of the features on disk.
    Returns the shard list for the manifest."""
    from safetensors.torch import save_file

    device = next(model.parameters()).device
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    head = model.get_output_embeddings()
    out_dir.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    shards: list[dict] = []
    pending: dict[str, list] = {"tokens": [], "features": [], "final": [], "argmax": [], "lengths": [], "prompt": [],
                                "index": [], "skip": [], "prompt_key": []}
    keys = prompt_keys if prompt_keys is not None else list(range(len(sequences)))
    stored_prompts: set[int] = set()

    def flush():
        if not pending["lengths"]:
            return
        name = f"shard-{len(shards):04d}.safetensors"
        tensors = {
            "tokens": torch.cat(pending["tokens"]).int(), "features": torch.cat(pending["features"]),
            "final": torch.cat(pending["final"]), "argmax": torch.cat(pending["argmax"]).int(),
            "lengths": torch.tensor(pending["lengths"], dtype=torch.int64),
            "prompt_lens": torch.tensor(pending["prompt"], dtype=torch.int64),
            "index": torch.tensor(pending["index"], dtype=torch.int64),
            "skip": torch.tensor(pending["skip"], dtype=torch.int64),
            "prompt_key": torch.tensor(pending["prompt_key"], dtype=torch.int64),
        }
        save_file(tensors, str(out_dir / name))
        shards.append({"file": name, "sequences": len(pending["lengths"]), "tokens": int(sum(pending["lengths"])),
                       "feature_rows": int(tensors["features"].shape[0])})
        for v in pending.values():
            v.clear()

    t0, start, done = time.perf_counter(), 0, 0
    while start < len(order):
        width = len(sequences[order[start]])
        end = start + 1
        while end < len(order) and (end - start + 1) * len(sequences[order[end]]) <= batch_tokens:
            end += 1
        idx = order[start:end]
        width = max(len(sequences[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # right padding: causal attention keeps the real positions exact
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
            mask[row, : len(sequences[i])] = 1
        out = decoder(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        feats = select_features(out.hidden_states, layer_ids)
        final = out.last_hidden_state
        for row, i in enumerate(idx):
            n = len(sequences[i])
            skip = prompt_lens[i] if keys[i] in stored_prompts else 0  # the prompt's features are stored already
            stored_prompts.add(keys[i])
            pending["tokens"].append(ids[row, :n])
            pending["features"].append(feats[row, skip:n].to(torch.bfloat16).cpu())
            pending["final"].append(final[row, skip:n].to(torch.bfloat16).cpu())
            # exact labels, from full-precision logits
            pending["argmax"].append(head(final[row, skip:n]).argmax(-1).cpu())
            pending["lengths"].append(n)
            pending["prompt"].append(prompt_lens[i])
            pending["index"].append(i)
            pending["skip"].append(skip)
            pending["prompt_key"].append(keys[i])
            if sum(pending["lengths"]) >= shard_tokens:
                flush()
        done += len(idx)
        start = end
    flush()
    log(f"  features for {done} sequences, {sum(s['tokens'] for s in shards)} positions "
        f"({sum(s['feature_rows'] for s in shards)} stored: prompts once), {len(shards)} shards "
        f"({time.perf_counter() - t0:.1f} s)")
    return shards


def write_manifest(data_dir: Path, manifest: dict) -> None:
    (data_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest(data_dir: Path) -> dict | None:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


# ---- loading back -------------------------------------------------------------------------------------------------


@dataclass
class FeatureSet:
    """All sequences of one split, flattened: tokens per position, and the target's outputs (features, final
    hidden state, argmax) per stored row. A sequence stores rows from position `skip` on; positions before it (a
    prompt shared with an earlier sequence) are read from that prompt's rows at `prompt_rows`."""

    tokens: torch.Tensor  # (T,) long
    features: torch.Tensor  # (R, n_layers * hidden) bf16, R <= T rows
    final: torch.Tensor  # (R, hidden) bf16
    argmax: torch.Tensor  # (R,) long
    offsets: torch.Tensor  # (n + 1,) long: token offsets
    prompt_lens: torch.Tensor  # (n,) long
    index: list[int] = field(default_factory=list)  # position of each sequence in the split's record list
    row_offsets: torch.Tensor | None = None  # (n,) long: where a sequence's stored rows start (None: = offsets)
    skip: torch.Tensor | None = None  # (n,) long: its first stored position (0, or its prompt length)
    prompt_rows: torch.Tensor | None = None  # (n,) long: the row of position 0 of its prompt

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return self.prompt_lens.shape[0]

    def anchor_counts(self) -> torch.Tensor:
        """Block starts per sequence: positions from the first response token to the second-to-last token."""
        return (self.lengths - 1 - self.prompt_lens).clamp_min(0)

    def gather(self, seqs: torch.Tensor, need_final: bool) -> dict:
        """Padded batch for sequences `seqs`: tokens/argmax (S, L), features (S, L, F), final (S, L, H) if asked,
        lengths and prompt lengths (S,)."""
        lengths = self.lengths[seqs]
        width = int(lengths.max())
        pos = torch.minimum(torch.arange(width, device=self.tokens.device)[None, :], lengths[:, None] - 1)
        flat = self.offsets[seqs][:, None] + pos
        rows = flat
        if self.skip is not None:
            skip = self.skip[seqs][:, None]
            rows = torch.where(pos < skip, self.prompt_rows[seqs][:, None] + pos,
                               self.row_offsets[seqs][:, None] + pos - skip)
        batch = {"tokens": self.tokens[flat], "argmax": self.argmax[rows], "features": self.features[rows],
                 "lengths": lengths, "prompt_lens": self.prompt_lens[seqs]}
        if need_final:
            batch["final"] = self.final[rows]
        return batch


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32,
                       "I64": torch.int64}
_ON_DEVICE = ("features", "final")  # the big ones: straight to the training device


def load_features(data_dir: Path, split: str, device: torch.device | str) -> FeatureSet:
    """The split's shards, concatenated. The two big tensors (features, final: ~7 KB a position) are allocated once on
    `device` and filled a shard at a time, so host memory holds one shard's tensor, not the set twice over (a 57 GB
    set would not fit a 128 GB host as list + concatenation)."""
    from safetensors import safe_open

    manifest = read_manifest(data_dir)
    if manifest is None or split not in manifest.get("splits", {}):
        raise DataError(f"no {split} features in {data_dir}")
    files = [str(Path(data_dir) / split / shard["file"]) for shard in manifest["splits"][split]["shards"]]
    if not files:
        raise DataError(f"the {split} split in {data_dir} is empty")
    shapes: dict[str, list[list[int]]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                part = h.get_slice(k)
                shapes.setdefault(k, []).append(part.get_shape())
                dtypes[k] = _SAFETENSORS_DTYPES[part.get_dtype()]
    cat, filled = {}, dict.fromkeys(shapes, 0)
    for k, parts in shapes.items():
        rows = sum(shape[0] for shape in parts)
        cat[k] = torch.empty((rows, *parts[0][1:]), dtype=dtypes[k], device=device if k in _ON_DEVICE else "cpu")
    for f in files:
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                cat[k][filled[k]: filled[k] + t.shape[0]].copy_(t)
                filled[k] += t.shape[0]
                del t
    lengths = cat["lengths"]
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    shared = {}
    if "skip" in cat and bool((cat["skip"] > 0).any()):  # some prompts stored once for several sequences
        skip, keys = cat["skip"], cat["prompt_key"]
        row_offsets = torch.zeros_like(lengths)
        row_offsets[1:] = (lengths - skip).cumsum(0)[:-1]
        first_row = {k: r for k, r, s in zip(keys.tolist(), row_offsets.tolist(), skip.tolist()) if s == 0}
        missing = {k for k in keys.tolist() if k not in first_row}
        if missing:
            raise DataError(f"the {split} split in {data_dir} lacks the stored prompts of {len(missing)} sequences")
        prompt_rows = torch.tensor([first_row[k] for k in keys.tolist()], dtype=torch.long)
        shared = {"row_offsets": row_offsets.to(device), "skip": skip.to(device), "prompt_rows": prompt_rows.to(device)}
    return FeatureSet(tokens=cat["tokens"].long().to(device), features=cat["features"].to(device),
                      final=cat["final"].to(device), argmax=cat["argmax"].long().to(device), offsets=offsets.to(device),
                      prompt_lens=cat["prompt_lens"].to(device), index=cat["index"].tolist(), **shared)


def token_counts(data: FeatureSet, vocab: int) -> torch.Tensor:
    """How often the target emitted each token in its responses (for a restricted draft vocabulary)."""
    counts = torch.zeros(vocab, dtype=torch.long, device=data.tokens.device)
    starts, ends = data.offsets[:-1] + data.prompt_lens, data.offsets[1:]
    for s, e in zip(starts.tolist(), ends.tolist()):
        counts.index_add_(0, data.tokens[s:e], torch.ones(e - s, dtype=torch.long, device=counts.device))
    return counts.cpu()


# ---- the whole preparation ----------------------------------------------------------------------------------------


def data_key(target_name: str, layer_ids: list[int], records: list[PromptRecord], max_new_tokens: int,
             max_prompt_tokens: int, samples: int = 0, temperature: float = 0.0, seed: int = 0,
             given: dict[str, list[int]] | None = None) -> str:
    """Identifies a prepared data set: reused only when target, layers, prompts, lengths, sampling and any responses
    given from earlier runs all match."""
    h = hashlib.sha256()
    sampling = [samples, temperature, seed] if samples else []  # greedy-only keys stay what they were
    h.update(json.dumps([target_name, layer_ids, max_new_tokens, max_prompt_tokens] + sampling).encode())
    for r in records:
        h.update(r.id.encode())
    for rid in sorted(given or {}):
        h.update(json.dumps([rid, given[rid]]).encode())
    return h.hexdigest()[:16]


def save_responses(path: Path, target_name: str, responses: dict[str, list[int]], meta: dict) -> None:
    """responses.jsonl: a header line (target, settings), then one {"id", "tokens"} per response. Record ids are the
    prompt's id for its greedy response and "<id>~k" for the k-th sampled one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        f.write(json.dumps({"target": target_name, **meta}) + "\n")
        for rid, tokens in responses.items():
            f.write(json.dumps({"id": rid, "tokens": tokens}) + "\n")
    tmp.replace(path)  # never a half-written file under the real name


def load_responses(paths: list[Path], target_name: str) -> dict[str, list[int]]:
    """Responses written by earlier runs (save_responses; plain or gzipped), for this target only; later files win on
    repeated ids."""
    out: dict[str, list[int]] = {}
    for path in paths:
        path = Path(path)
        if path.is_dir():
            path = path / RESPONSES
        if not path.is_file():
            raise DataError(f"no responses file at {path}")
        # gzipped (.gz) files too: a responses file shrinks ~5x, which matters when it travels to a GPU machine
        with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
            try:
                header = json.loads(f.readline() or "{}")
                rows = [json.loads(line) for line in f if line.strip()]
            except ValueError as exc:
                raise DataError(f"{path} is not a responses file (JSON lines): {exc}") from None
        if header.get("target") != target_name:
            raise DataError(f"{path} holds responses of {header.get('target')!r}, not of the target {target_name!r}")
        for row in rows:
            if not isinstance(row.get("id"), str) or not isinstance(row.get("tokens"), list):
                raise DataError(f"{path}: a line without an id and a token list")
            out[row["id"]] = [int(t) for t in row["tokens"]]
    return out


def _generate_missing(model, prompts: list[list[int]], ids: list[str], given: dict[str, list[int]], log,
                      **gen) -> tuple[list[list[int]], int]:
    """Responses for `prompts` (record ids `ids`): from `given` where it has them, generated for the rest."""
    missing = [i for i, rid in enumerate(ids) if rid not in given]
    made = generate_responses(model, [prompts[i] for i in missing], log=log, **gen) if missing else []
    out = [given.get(rid) for rid in ids]
    for i, tokens in zip(missing, made):
        out[i] = tokens
    return out, len(missing)


@dataclass
class SplitResponses:
    """One split's prompts and responses, kept from generation until its features are extracted (after the
    responses file is written, so a run stopped during extraction loses no generation). Response i answers prompt
    i % n_prompts: the greedy round first, then each sampled round; prompts holds the kept prompts once per round."""

    split: str
    prompts: list[list[int]]
    ids: list[str]
    categories: list[str]
    skipped: int
    n_prompts: int
    responses: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class Sampling:
    """Sampled responses for training prompts: `samples` rounds at `temperature`, round k seeded seed * 1000 + k."""

    samples: int
    temperature: float
    seed: int


def render_split(tokenizer, records: list[PromptRecord], split: str, max_prompt_tokens: int) -> SplitResponses:
    """The split's prompts as token ids, those longer than max_prompt_tokens left out (counted in skipped)."""
    prompts, kept, skipped = [], [], 0
    for r in records:
        if r.split != split:
            continue
        ids = render(tokenizer, r)
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        prompts.append(ids)
        kept.append(r)
    return SplitResponses(split=split, prompts=prompts, ids=[r.id for r in kept],
                          categories=[r.category for r in kept], skipped=skipped, n_prompts=len(prompts))


def respond_split(model, data: SplitResponses, gen: dict, sampling: Sampling, rounds: int,
                  given: dict[str, list[int]], log) -> SplitResponses:
    """Fill data with the greedy responses and `rounds` sampled rounds (taken from `given` where it has them)."""
    split, n_prompts = data.split, data.n_prompts
    base_ids, base_categories, base_prompts = list(data.ids), list(data.categories), list(data.prompts)
    data.responses, made = _generate_missing(model, base_prompts, base_ids, given, log, **gen)
    if made < n_prompts:
        log(f"data[{split}]: {n_prompts - made} greedy responses taken from earlier runs")
    for k in range(rounds):
        log(f"data[{split}]: sampled responses, round {k + 1}/{sampling.samples} (temperature {sampling.temperature})")
        round_ids = [f"{rid}~{k + 1}" for rid in base_ids]
        more, made = _generate_missing(model, base_prompts, round_ids, given, log, **gen,
                                       temperature=sampling.temperature, seed=sampling.seed * 1000 + k)
        if made < n_prompts:
            log(f"data[{split}]: {n_prompts - made} of them taken from earlier runs")
        data.responses += more
        data.ids += round_ids
        data.categories += base_categories
    data.prompts = base_prompts * (len(data.responses) // n_prompts)
    return data


def responses_summary(path: Path, all_responses: dict[str, list[int]], t0: float, log) -> dict:
    """What a responses-only run returns (and logs): the file, how many responses and tokens, how long it took."""
    summary = {"responses_file": str(path), "responses": len(all_responses),
               "response_tokens": sum(map(len, all_responses.values())),
               "seconds": round(time.perf_counter() - t0, 1)}
    log(f"data: {summary['responses']} responses ({summary['response_tokens']} tokens) in "
        f"{summary['responses_file']}")
    return summary


def extract_split(model, data: SplitResponses, layer_ids: list[int], data_dir: Path, batch_tokens: int,
                  log) -> dict:
    """The split's features written as shards under data_dir/<split>; returns its manifest entry."""
    prompts, responses = data.prompts, data.responses
    sequences = [p + r for p, r in zip(prompts, responses)]
    # sequence i answers prompt i % n_prompts (the greedy round, then each sampled round)
    shards = extract_features(model, sequences, [len(p) for p in prompts], layer_ids, data_dir / data.split,
                              prompt_keys=[i % data.n_prompts for i in range(len(sequences))],
                              batch_tokens=batch_tokens, log=log)
    return {"shards": shards, "records": data.ids, "categories": data.categories,
            "skipped_long": data.skipped, "prompt_tokens": sum(map(len, prompts)),
            "response_tokens": sum(map(len, responses))}


def prepare_data(model, tokenizer, records: list[PromptRecord], data_dir: Path, *, target_name: str,
                 layer_ids: list[int], max_new_tokens: int, max_prompt_tokens: int, gen_batch: int,
                 gen_tokens: int = 1 << 18, batch_tokens: int = 16384, samples: int = 0, temperature: float = 0.8,
                 seed: int = 0, given: dict[str, list[int]] | None = None, responses_only: bool = False,
                 log=print) -> dict:
    """Render, generate and extract features for both splits into data_dir (reusing it when its key matches).
    Training prompts get their greedy response and `samples` more sampled at `temperature` (record ids "<id>~k").
    `given` (load_responses) supplies responses by record id; only the others are generated. Every response is
    written to data_dir/responses.jsonl. responses_only: stop there (no features; returns a summary, no manifest).
    Returns the manifest."""
    data_dir = Path(data_dir)
    given = given or {}
    key = data_key(target_name, layer_ids, records, max_new_tokens, max_prompt_tokens, samples, temperature, seed,
                   given)
    manifest = read_manifest(data_dir)
    if manifest is not None and manifest.get("key") == key and not responses_only:
        log(f"data: reusing {data_dir} (key {key})")
        return manifest
    stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    manifest = {"key": key, "target": target_name, "layer_ids": layer_ids, "max_new_tokens": max_new_tokens,
                "max_prompt_tokens": max_prompt_tokens, "stop_ids": list(stops), "splits": {},
                "samples_per_prompt": samples, "sample_temperature": temperature if samples else None}
    gen = dict(max_new_tokens=max_new_tokens, stops=stops, batch_size=gen_batch, batch_tokens=gen_tokens)
    sampling = Sampling(samples=samples, temperature=temperature, seed=seed)
    pending: list[SplitResponses] = []  # until the responses file is written
    t0 = time.perf_counter()
    for split in ("train", "heldout"):
        data = render_split(tokenizer, records, split, max_prompt_tokens)
        if not data.prompts:
            manifest["splits"][split] = {"shards": [], "records": [], "skipped_long": data.skipped}
            continue
        log(f"data[{split}]: {data.n_prompts} prompts ({data.skipped} longer than {max_prompt_tokens} tokens "
            f"skipped), generating up to {max_new_tokens} tokens each")
        rounds = samples if split == "train" else 0  # held-out prompts: the greedy response only
        pending.append(respond_split(model, data, gen, sampling, rounds, given, log))
    all_responses = {rid: tokens for data in pending for rid, tokens in zip(data.ids, data.responses)}
    save_responses(data_dir / RESPONSES, target_name, all_responses,
                   {"max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
                    "samples_per_prompt": samples, "sample_temperature": temperature if samples else None,
                    "seed": seed, "dtype": str(next(model.parameters()).dtype)})
    if responses_only:
        return responses_summary(data_dir / RESPONSES, all_responses, t0, log)
    for data in pending:
        manifest["splits"][data.split] = extract_split(model, data, layer_ids, data_dir, batch_tokens, log)
    manifest["seconds"] = round(time.perf_counter() - t0, 1)
    data_dir.mkdir(parents=True, exist_ok=True)
    write_manifest(data_dir, manifest)
    return manifest
