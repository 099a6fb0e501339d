"""bench/moe_invariant_tiles.py's choice of the slot sum inside the down kernel, on the CPU: the curves and the
bitwise check's answer are given (both need a GPU; the check itself runs in tests/reviewer_kernels/test_fused_moe.py's
cases)."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import moe_invariant_tiles as tiles  # noqa: E402

TOKENS = [1, 2, 4, 8, 16]


def curve(*us: float) -> dict:
    return {f"us_{m}": u for m, u in zip(TOKENS, us)}


CURVES = {"best_direct_traced": curve(25, 38, 53, 80, 125), "best_sorted_traced": curve(31, 42, 56, 75, 91)}
FASTER = {"direct": curve(23, 36, 51, 79, 124), "sorted": curve(29, 40, 54, 73, 89)}


def test_entry_us_takes_each_token_count_in_the_entry_s_mode():
    # direct up to 4 tokens (25 + 38 + 53), sorted above (75 + 91)
    assert tiles.entry_us(CURVES["best_direct_traced"], CURVES["best_sorted_traced"], 4, TOKENS) == 282


def test_the_summed_slots_are_kept_only_when_bitwise_the_slot_sum_and_faster():
    keep, record = tiles.choose_sum_in_down(FASTER, True, CURVES, 4, TOKENS)
    assert keep and record["summed_us"] == 23 + 36 + 51 + 73 + 89 < record["entry_us"] == 282
    assert not tiles.choose_sum_in_down(FASTER, False, CURVES, 4, TOKENS)[0]  # faster, other bits: refused
    slower = {"direct": curve(26, 39, 54, 81, 126), "sorted": curve(32, 43, 57, 76, 92)}
    keep, record = tiles.choose_sum_in_down(slower, True, CURVES, 4, TOKENS)
    assert not keep and record["summed_us"] > record["entry_us"]


def test_a_summed_variant_that_did_not_build_is_not_taken():
    broken = {"direct": {"error": "OutOfResources: shared memory"}, "sorted": curve(1, 1, 1, 1, 1)}
    keep, record = tiles.choose_sum_in_down(broken, True, CURVES, 4, TOKENS)
    assert not keep and "entry_us" not in record
