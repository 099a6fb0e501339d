"""reviewer_kernels/block_attention.py's tiles at the 35B-A3B shape: one tile set serves decode steps and verifies alike
(batch invariance), so each candidate is timed on both, and checked: every verify row must keep the decode step's bits.

    python bench/block_attention_tiles.py [--out bench/results]      (H200)
    python bench/block_attention_tiles.py --splits                    the shipped tiles at other slice counts

--splits: the shipped tile set with Tiles.max_splits 63, 127 (shipped), 255 and 511: more, shorter slices of the
cache per program (a 32k cache at head_dim 256: 544, 288, 160, 96 columns), the combine's tile growing with them.

16 query heads, 2 key heads, 256 dims, a 32k cache passed whole (as the CUDA graphs pass it), 3k and 30k cached
tokens; each call timed as a CUDA graph of 20 calls. `cross` rows: a decode step in one tile set against verifies in
another (whether they could differ by row count and keep the bits).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import reviewer_kernels.block_attention as ba  # noqa: E402
from tests.reviewer_kernels.test_block_attention import make_case  # noqa: E402


def launch(q, kn, vn, kc, vc, start, tiles):
    """block_attention over the whole cache (as the CUDA graphs call it) with tiles [rows, cols, warps, stages]."""
    return ba.block_attention(q, kn, vn, kc, vc, start, kc.shape[1], use_triton=True, tiles=ba.Tiles(*tiles))


def graph_us(fn, reps: int = 20) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / reps


def measure(step_tiles, verify_tiles, contexts) -> dict:
    row = {"decode_tiles": step_tiles, "verify_tiles": verify_tiles, "invariant": True}
    for start in contexts:
        q, kn, vn, kc, vc, pos = make_case(16, 2, 256, 16, start, max_context=32768, dtype=torch.bfloat16,
                                           device="cuda", seed=1)
        verify = launch(q, kn, vn, kc, vc, pos, verify_tiles)
        for t in (0, 5, 15):
            step = launch(q[:, t:t + 1], kn[:, t:t + 1], vn[:, t:t + 1], kc, vc, pos + t, step_tiles)
            row["invariant"] &= bool(torch.equal(step[0], verify[t]))
        ref = ba.block_attention_torch(q.clone(), kn, vn, kc.clone(), vc.clone(), pos, 32768)
        row[f"err_{start}"] = (verify.float() - ref.float()).abs().max().item()
        row[f"decode_us_{start}"] = graph_us(lambda: launch(q[:, :1], kn[:, :1], vn[:, :1], kc, vc, pos, step_tiles))
        row[f"verify16_us_{start}"] = graph_us(lambda: launch(q, kn, vn, kc, vc, pos, verify_tiles))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", action="store_true", help="the shipped tiles at max_splits 63..511 only")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("block_attention_tiles times Triton kernels on a GPU")
    contexts = (3000, 30000)
    rows, cross = [], []
    shipped = list(dataclasses.astuple(ba.default_tiles(256)))
    if args.splits:
        for max_splits in (63, 127, 255, 511):
            tiles = shipped[:4] + [max_splits]
            row = measure(tiles, tiles, contexts)
            rows.append(row)
            print(json.dumps(row), flush=True)
    else:
        for tiles in itertools.product([16, 64], [32, 64], [4, 8], [1, 2, 3]):
            row = measure(list(tiles), list(tiles), contexts)
            rows.append(row)
            print(json.dumps(row), flush=True)
        for verify_tiles in ([64, 32, 4, 3], [64, 64, 4, 3]):  # one-token steps in the shipped set, verifies in another
            row = measure(shipped, verify_tiles, contexts)
            cross.append(row)
            print("cross", json.dumps(row), flush=True)
    record = {"benchmark": "block_attention_tiles", "machine": {"gpu": torch.cuda.get_device_name()},
              "command": "python " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "shape": "16 query heads, 2 key heads, head_dim 256, 32k cache whole",
              "timing": "us per call, CUDA graph of 20 calls",
              "tiles": "[BLOCK_M, BLOCK_N, warps, stages, max_splits]",
              "shipped": shipped,
              "rows": rows, "cross": cross}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    label = "_splits" if args.splits else ""
    path = Path(args.out) / f"block_attention_tiles{label}_h200_{datetime.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
