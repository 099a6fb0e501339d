"""Where, inside the engine's own forward, does a verify row stop being bit-identical to the decode step it stands for?
(GPU diagnostic for batch invariance, issue 25; not a benchmark.)

Runs a FastModel as the engine does (CUDA graphs, compiled glue): prefill a prompt, decode `--steps` tokens greedily
one by one, then go back to the prompt's end (snapshot) and verify the same tokens as one block. Every glue function,
attention, recurrence, routing and expert call of the model files records its outputs (rows first) into static
buffers, captured into the graphs like everything else; the Gated DeltaNet states are read after each decode step and
from the verify's recorded inputs, replayed. Then, row by row, the first call whose output differs is named, with the
layers where the logits and the residual stream first differ. Also: blocks of every size 2..16 against the decode
steps (logits), and the hand-off (verify 8, accept 3, then decode on: logits against plain decoding).

    python bench/layer_diff.py --model qwen3.6-35b-a3b-shape --invariant --json /tmp/layer_diff.json
    python bench/layer_diff.py --model embedded --llama-steps glue
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import backend.models.llama as llama_mod  # noqa: E402
import backend.models.qwen3_5_moe as qwen_mod  # noqa: E402
from backend.bench.run import load_target  # noqa: E402
from backend.models import load_fast  # noqa: E402
from backend.models.numerics import LlamaNumerics, Numerics, QwenNumerics  # noqa: E402

ROWS = 16


class Recorder:
    """Wraps the model files' calls so each call's row-first outputs land in a static buffer [16, n] keyed by
    (name, occurrence in the forward). The copies run inside the captured graphs; read() takes the first T rows."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.count = collections.Counter()
        self.active = True

    def store(self, name: str, tensors) -> None:
        if not self.active:
            return
        for j, t in enumerate(tensors):
            if t is None:
                continue
            T = t.shape[0]
            if T > ROWS:  # a prefill: nothing to compare
                return
            key = (name, self.count[name], j)
            flat = t.reshape(T, -1)
            buf = self.buffers.get(key)
            if buf is None or buf.shape[1] != flat.shape[1] or buf.dtype != flat.dtype:
                buf = self.buffers[key] = torch.zeros(ROWS, flat.shape[1], dtype=flat.dtype, device=flat.device)
            buf[:T].copy_(flat)
        self.count[name] += 1

    def read(self, T: int) -> dict:
        return {k: b[:T].clone() for k, b in self.buffers.items()}


# which outputs of each wrapped call are [T, ...] (or become so), by position; the rest are skipped
def rows_of(name: str, out):
    if name == "attention_in":  # q [H, T, D], k, v [Hkv, T, D], gate [T, H*D]
        q, k, v, gate = out
        return [q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), gate]
    if name == "deltanet_in":  # window [K-1+T, C] skipped
        return list(out[1:])
    if name in ("cached_attention", "block_attention", "gemv", "fused_moe", "gdn_recurrent"):
        return [out]
    if name == "attention_prep":  # q [H, T, D], k, v [Hkv, T, D], gate [T, H, D]
        q, k, v, gate = out
        return [q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), gate]
    if name in ("attention_out", "deltanet_out", "final_norm", "attention_out_mlp", "moe_in", "route"):
        return list(out) if isinstance(out, tuple) else [out]
    if name == "llama_attention_in":  # x, q, k, v
        x, q, k, v = out
        return [x, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)]
    return [out] if isinstance(out, torch.Tensor) else [o for o in out if isinstance(o, torch.Tensor)]


def install(rec: Recorder, model) -> None:
    def wrap(name, fn):
        def recorded(*args, **kw):
            out = fn(*args, **kw)
            rec.store(name, rows_of(name, out))
            return out
        return recorded

    glue = llama_mod.glue

    def recording_glue(fn, compiled):
        name = fn.__name__
        if fn.__module__.endswith("llama") and name == "attention_in":
            name = "llama_attention_in"
        return wrap(name, glue(fn, compiled))

    qwen_mod.glue = recording_glue
    llama_mod.glue = recording_glue
    for name in ("cached_attention", "block_attention", "gdn_recurrent", "fused_moe", "gemv", "attention_prep"):
        setattr(qwen_mod, name, wrap(name, getattr(qwen_mod, name)))
    qwen_mod.gdn_verify = wrap("gdn_recurrent", qwen_mod.gdn_verify)  # a verify's recurrence: compared with a step's
    qwen_mod.route_topk_from_hidden = wrap("route", qwen_mod.route_topk_from_hidden)
    model.register_forward_pre_hook(lambda *_: rec.count.clear())


def first_difference(step: dict, block: dict, row: int, order: list) -> dict | None:
    """The first recorded call (in forward order) whose row differs between a decode step (row 0) and the block."""
    for key in order:
        if key not in step or key not in block:
            continue
        a, b = step[key][0], block[key][row]
        if not torch.equal(a, b):
            return {"call": key[0], "occurrence": key[1], "output": key[2],
                    "max_abs": float((a.float() - b.float()).abs().max()),
                    "elements_differing": int((a != b).sum())}
    return None


def engine_pair(hf, fm, prompt, fed, step_logits, args) -> dict:
    """What the engine does beyond one FastModel: the plain engine and the speculative one each build their own
    FastModel over the same weights, and the speculative one prefills and verifies with the drafter's feature
    layers. Rows of 16-token verifies on a second FastModel, with and without features, and on the first one with
    features, against the first model's decode steps; and the second model's first decode step."""
    n = fm.config.num_layers
    features = tuple(sorted({1, n // 4, n // 2, 3 * n // 4, n - 3}))  # like a drafter's target_layer_ids
    second = load_fast(hf, max_context=4096, max_block=ROWS, compile=args.device == "cuda", numerics=args.numerics)
    out = {"feature_layers": list(features)}
    for label, model, hidden in (("same model, features", fm, features), ("second model", second, ()),
                                 ("second model, features", second, features)):
        model.reset()
        model.prefill(prompt, hidden)
        logits, _ = model.verify(fed, hidden)
        out[label] = sum(bool(torch.equal(logits[j], step_logits[j])) for j in range(len(fed)))
        model.accept(len(fed))
    second.reset()
    second.prefill(prompt)
    logits, _ = second.decode(fed[0])
    out["second model, decode step 0 equal"] = bool(torch.equal(logits, step_logits[0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.6-35b-a3b-shape")
    ap.add_argument("--invariant", action="store_true", help="Qwen3.5-MoE: decode steps and verifies through the padded rows (QwenNumerics.padded_rows)")
    ap.add_argument("--llama-steps", default=None, choices=["rows", "glue"],
                    help="Llama: decode steps and verifies through the row kernels or the glue (LlamaNumerics.step_path)")
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offset", type=int, default=0, help="plain decode steps after the prompt before the compared "
                    "ones")
    ap.add_argument("--engine-pair", action="store_true", help="also a second FastModel over the same weights, and "
                    "verifies with drafter features, as the plain and the speculative engine run")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", default="cuda", help="cuda (what this is for), or cpu to try the script on a tiny "
                    "model")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("layer_diff.py needs a CUDA GPU")
    # the fast models' record (backend/models/numerics.py), for this model and the engine pair's second one
    args.numerics = Numerics("invariant" if args.invariant else "one_token", "bench/layer_diff.py: its flags",
                             LlamaNumerics(step_path=args.llama_steps or "rows"),
                             QwenNumerics(padded_rows=args.invariant), invariant_steps=args.invariant,
                             compile=args.device == "cuda")
    hf, tokenizer, name, _ = load_target(args.model, args.device)
    fm = load_fast(hf, max_context=4096, max_block=ROWS, compile=args.device == "cuda", numerics=args.numerics)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rec = Recorder()
    install(rec, fm.model)
    vocab = fm.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, vocab - 1, (args.prompt_len,), generator=gen).tolist()
    T = args.steps
    hybrid = fm.hybrid

    def plain_run(n):
        """From the prompt's end: n decode steps; returns (tokens fed, logits, records, states after each)."""
        fm.restore(snap)
        tok = first
        fed, logits, records, states = [], [], [], []
        for _ in range(n):
            lg, _ = fm.decode(tok)
            sync()
            fed.append(tok)
            logits.append(lg.clone())
            records.append(rec.read(1))
            if hybrid:
                states.append((fm.model.linear.state.clone(), fm.model.linear.conv.clone()))
            tok = int(lg.argmax())
        return fed, logits, records, states

    with torch.inference_mode():
        fm.reset()
        rec.active = False
        lg, _ = fm.prefill(prompt)
        for _ in range(args.offset):  # decode steps before the compared ones
            lg, _ = fm.decode(int(lg.argmax()))
        first = int(lg.argmax())
        snap = fm.snapshot()
        rec.active = True
        plain_run(T)  # capture the decode graphs first, as the engine's warm-up does
        fed, step_logits, step_records, step_states = plain_run(T)
        order = [k for k in step_records[0]]  # forward order of the decode step's calls (dict keeps insertion)
        fm.restore(snap)
        block_logits, _ = fm.verify(fed)
        sync()
        block_records = rec.read(T)
        block_order = list(block_records)
        order += [k for k in block_order if k not in order]
        replayed = [fm.model.linear.states_after(j + 1) for j in range(T)] if hybrid else None
        result_rows = []
        for j in range(T):
            row = {"row": j, "logits_equal": bool(torch.equal(step_logits[j], block_logits[j])),
                   "logits_max_abs": float((step_logits[j].float() - block_logits[j].float()).abs().max()),
                   "first_difference": first_difference(step_records[j], block_records, j, order)}
            if hybrid:
                st, cv = step_states[j]
                row["state_equal_layers"] = [bool(torch.equal(st[i], replayed[j][i])) for i in range(st.shape[0])]
                row["state_equal"] = all(row["state_equal_layers"])
            result_rows.append(row)
        fm.accept(T)

        sizes = {}
        for n in range(2, T + 1):  # blocks of every size against the decode steps: logits only
            fm.restore(snap)
            lg_n, _ = fm.verify(fed[:n])
            sizes[n] = sum(bool(torch.equal(lg_n[j], step_logits[j])) for j in range(n))
            fm.accept(n)

        # the hand-off: verify 8, keep 3, then decode from the 4th token on
        fm.restore(snap)
        fm.verify(fed[:8])
        fm.accept(3)
        handoff = []
        for j in range(3, T):
            lg, _ = fm.decode(fed[j])
            handoff.append(bool(torch.equal(lg, step_logits[j])))

        pair = engine_pair(hf, fm, prompt, fed, step_logits, args) if args.engine_pair else None

    calls = collections.Counter(k[0] for k in order)
    result = {"benchmark": "layer_diff", "what": "diagnostic: decode step vs verify row, per recorded call",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python bench/layer_diff.py " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__, "model": name,
              "invariant_steps": args.numerics.qwen.padded_rows,
              "llama_step_path": args.numerics.llama.step_path,
              "calls_per_forward": dict(calls), "rows": result_rows,
              "block_sizes_rows_equal": sizes, "handoff_verify8_keep3_equal": handoff, "engine_pair": pair}
    for r in result_rows:
        d = r["first_difference"]
        where = "identical" if d is None else f"{d['call']}#{d['occurrence']}.{d['output']} (|d| {d['max_abs']:.3g})"
        st = "" if "state_equal" not in r else f"  states {'=' if r['state_equal'] else '!='}"
        print(f"row {r['row']:2d}: logits {'=' if r['logits_equal'] else '!='}  first diff: {where}{st}")
    print("block sizes (rows equal):", sizes)
    print("hand-off (verify 8, keep 3, decode on):", handoff)
    if pair:
        print("engine pair (rows equal to the first model's decode steps):", pair)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", args.json)


if __name__ == "__main__":
    main()
