"""bench/drafter_window.py on the CPU with the tiny random target and a random drafter saved to a folder: the
variants' config.json carries the window (weights linked, not copied), the sweep replays real sessions through the
engine beside --drafter none, and the record counts identical replies and tau per window and context band."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import drafter_window  # noqa: E402

from backend.bench.run import load_target  # noqa: E402
from backend.dflash.checkpoint import load_drafter, random_drafter, save_drafter  # noqa: E402


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """A random two-layer drafter for tiny-moe in the z-lab layout (a sliding layer, then a full one)."""
    target = load_target("tiny-moe", "cpu", max_context=8192)[0]
    path = save_drafter(random_drafter(target, num_layers=2), tmp_path_factory.mktemp("drafter") / "d")
    raw = json.loads((path / "config.json").read_text())
    raw["layer_types"] = ["sliding_attention", "full_attention"]
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_a_variant_sets_the_window_and_links_the_weights(drafter_dir, tmp_path):
    folder = drafter_window.window_variant(drafter_dir, 64, tmp_path)
    cfg = load_drafter(folder).cfg
    assert cfg.sliding_window == 64 and cfg.layer_types == ["sliding_attention", "full_attention"]
    assert (folder / "model.safetensors").is_symlink()
    assert load_drafter(drafter_window.window_variant(drafter_dir, 0, tmp_path)).cfg.sliding_window is None
    assert load_drafter(drafter_dir).cfg.sliding_window is None  # the source folder is left as it was


def test_the_sweep_replays_sessions_beside_plain_decoding(drafter_dir, tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    for f in range(2):
        (repo / f"mod{f}.py").write_text("\n".join(f"value_{f}_{i} = {i} * {f + 1}  # line {i}" for i in range(80)))
    out = tmp_path / "w.json"
    code = drafter_window.main(["--model", "tiny-moe", "--drafter", str(drafter_dir), "--windows", "0,16",
                                "--repo", str(repo), "--sessions", "1", "--max-turns", "2", "--max-tokens", "6",
                                "--inputs", "test", "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "drafter_window" and record["inputs"] == "test"
    assert set(record["windows"]) == {"window 0", "window 16"}
    for w in record["windows"].values():
        assert w["replies"] == 2 == w["identical"] and w["turns"] == 2  # a drafter never changes a reply
        assert w["tau"] >= 1 and all(k.endswith("-" + str(int(k.split("-")[0]) + 2047)) for k in w["tau_by_context"])
    assert {r["config"] for r in record["turns"]} == {"none", "window 0", "window 16"}
    assert record["plain_wall_s"] > 0 and "window 16" in capsys.readouterr().out


def test_the_drafter_is_the_shipped_one_unless_given(drafter_dir, tmp_path):
    from backend.dflash.checkpoint import find_shipped_drafter

    assert drafter_window.drafter_folder("embedded", None) == find_shipped_drafter("SmolLM2-135M-Instruct")
    assert drafter_window.drafter_folder("tiny-moe", str(drafter_dir)) == drafter_dir
    with pytest.raises(drafter_window.ReplayError, match="no drafter folder for tiny-moe"):
        drafter_window.drafter_folder("tiny-moe", None)
    with pytest.raises(drafter_window.ReplayError, match="config.json"):
        drafter_window.drafter_folder("tiny-moe", str(tmp_path))


@pytest.mark.parametrize("windows, message", [("0,0", "distinct"), ("-5", ">= 0"), ("a", "not a number")])
def test_bad_windows_are_one_line(windows, message, capsys, tmp_path):
    assert drafter_window.main(["--windows", windows, "--out", str(tmp_path / "x.json")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "x.json").exists()
