"""bench/step_budget.py's trace arithmetic on the CPU: kernels put in parts by name (with the names the H200 traces
hold), a forward's kernels cut into layers where each layer's experts end, and the per-layer medians. The profiling
itself needs a GPU (the script refuses without one)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import step_budget  # noqa: E402

# names as the 2026-12-03 H200 traces have them (bench/results/step_budget_*.json)
NAMES = {
    "_router_partial_kernel": "routing",  # once counted as attention: "_partial_kernel" is inside its name
    "_route_kernel": "routing",
    "_partial_kernel": "attention",
    "_combine_kernel": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x": "attention",
    "_gdn_recurrent_kernel": "recurrence",
    "_gdn_chunks_kernel": "recurrence",
    "void batch_trsm_left_kernel<float, 64, 4, 3, false, true, true>(cublas": "recurrence",
    "_gate_up_kernel": "experts",
    "_align_kernel": "experts",
    "_sum_slots_kernel": "experts",
    "nvjet_sm90_tst_128x16_64x11_4x1_v_bz_TNT": "projections",
    "_wide_kernel": "projections",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "glue",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel": "other",
    "memcpy32_post": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_kernels_go_to_their_parts(name):
    assert step_budget.part_of(name) == NAMES[name]


def kernels(*names):
    return [{"name": n, "ts": i, "us": 1.0 + i} for i, n in enumerate(names)]


def test_a_forward_is_cut_where_each_layer_s_experts_end():
    forward = kernels("embedding", "nvjet_in", "_partial_kernel", "_gate_up_kernel", "_down_kernel",
                      "nvjet_in", "_gdn_recurrent_kernel", "_gate_up_kernel", "_sum_slots_kernel",
                      "triton_red_norm", "nvjet_lm_head")
    layers = step_budget.split_layers(forward, 2)
    assert [[k["name"] for k in layer] for layer in layers] == [
        ["embedding", "nvjet_in", "_partial_kernel", "_gate_up_kernel", "_down_kernel"],
        ["nvjet_in", "_gdn_recurrent_kernel", "_gate_up_kernel", "_sum_slots_kernel"],
        ["triton_red_norm", "nvjet_lm_head"]]


def test_budget_takes_medians_per_layer_kind_and_counts_a_missing_part_as_zero():
    # two linear-attention layers: only the first has a recurrence kernel, only the second a projection, so each
    # part's median over the two is half its one value
    forward = [{"name": n, "ts": 0, "us": us} for n, us in [
        ("_partial_kernel", 10.0), ("_gate_up_kernel", 4.0),
        ("_gdn_recurrent_kernel", 6.0), ("_gate_up_kernel", 2.0),
        ("nvjet_in", 1.0), ("_gate_up_kernel", 8.0),
        ("nvjet_lm_head", 5.0)]]
    got = step_budget.budget([forward], ["full_attention", "linear_attention", "linear_attention"])
    assert got["full_attention"] == {"attention": 10.0, "experts": 4.0}
    assert got["linear_attention"] == {"recurrence": 3.0, "experts": 5.0, "projections": 0.5}
    assert got["head"] == {"projections": 5.0}


def test_a_forward_the_cut_does_not_fit_is_an_error_not_a_wrong_table():
    with pytest.raises(RuntimeError, match="cut 1 layers out of 2"):
        step_budget.budget([kernels("_partial_kernel", "_gate_up_kernel", "nvjet_lm_head")],
                           ["full_attention", "full_attention"])


@pytest.mark.parametrize("args", [[], ["--numerics", "one_token"]])
def test_without_a_gpu_the_script_says_so_in_one_line(args):
    pytest.importorskip("torch")
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_budget.py"), *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "needs a GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_a_numerics_it_does_not_know_is_refused_by_the_parser():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_budget.py"), "--numerics", "exact"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "invalid choice: 'exact'" in proc.stderr


def test_gemv_experts_with_the_one_token_numerics_is_one_clear_line():
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_budget.py"), "--numerics", "one_token",
                           "--experts", "gemv"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "--experts gemv chooses the invariant step's experts" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("layers", ["6", "44", "0"])
def test_a_layer_count_the_shape_cannot_have_is_one_clear_line(layers):
    """--layers keeps the shape's pattern (3 linear-attention layers, then 1 full): a multiple of 4 up to its 40."""
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_budget.py"), "--layers", layers],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and f"--layers {layers}: a multiple of 4" in proc.stderr
    assert "Traceback" not in proc.stderr


def record(gpu: str, numerics: str, kernels: dict[str, tuple[float, float]], wall: float, layers: int = 40) -> dict:
    """A step_budget record of one context, its decode step's top kernels {name: (us, launches)}."""
    top = [{"kernel": n, "us_per_call": us, "launches_per_call": c, "part": step_budget.part_of(n)}
           for n, (us, c) in kernels.items()]
    parts = {"experts": {"us": 30.0}, "glue": {"us": 8.0}}
    return {"benchmark": "step_budget", "machine": {"gpu": gpu}, "numerics": numerics, "date": "2026-12-07",
            "layers": layers, "contexts": [{"context": 3000, "decode": {
                "kernel_us": sum(us for us, _ in kernels.values()), "launches": sum(c for _, c in kernels.values()),
                "wall_us": wall, "top_kernels": top, "per_layer": {"linear_attention": {"parts": parts}}}}]}


def test_compare_sets_two_records_kernel_by_kernel():
    a = record("NVIDIA H100 80GB HBM3", "one-token", {"_gate_up_kernel": (300.0, 20), "_gemv_kernel": (160.0, 20)},
               2270.0)
    b = record("NVIDIA H100 80GB HBM3", "invariant", {"_gate_up_kernel": (460.0, 20), "_align_kernel": (100.0, 20)},
               2550.0)
    out = step_budget.compare(a, b)
    assert "machines differ" not in out
    assert "kernels 460 -> 560 us (B/A 1.217), launches 40 -> 40, wall 2270 -> 2550 us" in out
    gate_up = next(line for line in out.splitlines() if line.endswith("_gate_up_kernel"))
    assert gate_up.split()[:3] == ["300.0", "460.0", "+160.0"]
    align = next(line for line in out.splitlines() if line.endswith("_align_kernel"))
    assert align.split()[:2] == ["-", "100.0"]  # only in B
    assert "linear_attention (us a layer): experts 30.0 -> 30.0, glue 8.0 -> 8.0" in out


def test_compare_says_when_two_records_are_no_side_by_side_pair():
    a = record("NVIDIA H100 80GB HBM3", "invariant", {"_gate_up_kernel": (300.0, 20)}, 2300.0, layers=20)
    b = record("NVIDIA H200", "invariant", {"_gate_up_kernel": (600.0, 40)}, 3400.0)
    out = step_budget.compare(a, b)
    assert "machines differ: A NVIDIA H100 80GB HBM3, B NVIDIA H200" in out
    assert "layer counts differ: A 20, B 40" in out


def test_compare_from_the_command_line_needs_no_gpu_and_refuses_other_records(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(record("H", "x", {"_down_kernel": (10.0, 1)}, 20.0)))
    other = tmp_path / "other.json"
    other.write_text('{"benchmark": "serve_replay"}')
    script = [sys.executable, str(ROOT / "bench" / "step_budget.py"), "--compare"]
    ok = subprocess.run(script + [str(a), str(a)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ok.returncode == 0 and "_down_kernel" in ok.stdout
    bad = subprocess.run(script + [str(a), str(other)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "not a step_budget record" in bad.stderr and "Traceback" not in bad.stderr
    missing = subprocess.run(script + [str(a), str(tmp_path / "none.json")], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
    assert missing.returncode != 0 and "none.json" in missing.stderr and "Traceback" not in missing.stderr
