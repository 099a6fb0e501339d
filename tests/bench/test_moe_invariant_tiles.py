"""bench/moe_invariant_tiles.py's choice of the slot sum inside the down kernel, on the CPU: the curves are given
(the timing needs a GPU), the bitwise check runs through fused_moe (here its PyTorch fallback, where both settings are
one computation)."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import moe_invariant_tiles as tiles  # noqa: E402

from reviewer_kernels import SharedExpert  # noqa: E402

TOKENS = [1, 2, 4, 8, 16]


def curve(*us: float) -> dict:
    return {f"us_{m}": u for m, u in zip(TOKENS, us)}


def small_layer():
    g = torch.Generator().manual_seed(0)
    w = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    layer = {"gate_up": w(8, 32, 16), "down": w(8, 16, 16), "shared": SharedExpert(w(16, 16), w(16, 16), w(16, 16),
                                                                                    w(1, 16))}
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(16)])
    return layer, w(16, 16), (torch.softmax(w(16, 2), -1), ids)


CURVES = {"best_direct_traced": curve(25, 38, 53, 80, 125), "best_sorted_traced": curve(31, 42, 56, 75, 91)}
ENTRY = {"direct": True, "direct_tokens": 4, "BM": 16, "gate_up": {}, "down": {}}


def test_entry_us_takes_each_token_count_in_the_entry_s_mode():
    # direct up to 4 tokens (25 + 38 + 53), sorted above (75 + 91)
    assert tiles.entry_us(CURVES["best_direct_traced"], CURVES["best_sorted_traced"], 4, TOKENS) == 282


def test_the_summed_slots_are_kept_only_when_faster_over_the_entry_s_curve():
    layer, x, route = small_layer()
    faster = {"direct": curve(23, 36, 51, 79, 124), "sorted": curve(29, 40, 54, 73, 89)}
    keep, record = tiles.choose_sum_in_down(lambda mode: faster[mode], CURVES, 4, TOKENS, layer, x, route, ENTRY)
    assert keep and record["same_bits"] and record["summed_us"] == 23 + 36 + 51 + 73 + 89 < record["entry_us"]
    slower = {"direct": curve(26, 39, 54, 81, 126), "sorted": curve(32, 43, 57, 76, 92)}
    keep, record = tiles.choose_sum_in_down(lambda mode: slower[mode], CURVES, 4, TOKENS, layer, x, route, ENTRY)
    assert not keep and record["summed_us"] > record["entry_us"]


def test_a_summed_variant_that_did_not_build_is_not_taken():
    layer, x, route = small_layer()
    broken = {"direct": {"error": "OutOfResources: shared memory"}, "sorted": curve(1, 1, 1, 1, 1)}
    keep, record = tiles.choose_sum_in_down(lambda mode: broken[mode], CURVES, 4, TOKENS, layer, x, route, ENTRY)
    assert not keep and "entry_us" not in record
