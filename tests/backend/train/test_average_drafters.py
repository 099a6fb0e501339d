"""bench/average_drafters.py: the element-wise mean of drafters of one lineage, refusing drafters that differ in
shape or draft vocabulary (one line, nothing written)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import average_drafters as avg  # noqa: E402


def drafter_dir(path: Path, scale: float, d2t=(0, 1, 5)) -> Path:
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_file({"fc.weight": (scale * torch.randn(4, 6, generator=g)).to(torch.bfloat16),
               "norm.weight": torch.full((4,), scale, dtype=torch.bfloat16),
               "d2t": torch.tensor(d2t, dtype=torch.int64)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    return path


def test_the_mean_of_two_drafters(tmp_path):
    a, b = drafter_dir(tmp_path / "a", 1.0), drafter_dir(tmp_path / "b", 3.0)
    assert avg.main([str(a), str(b), "--out", str(tmp_path / "s")]) == 0
    s, ta, tb = (load_file(str(p / "model.safetensors")) for p in (tmp_path / "s", a, b))
    for k in ("fc.weight", "norm.weight"):
        assert s[k].dtype == torch.bfloat16
        assert torch.equal(s[k], ((ta[k].float() + tb[k].float()) / 2).to(torch.bfloat16))
    assert torch.equal(s["norm.weight"], torch.full((4,), 2.0, dtype=torch.bfloat16))
    assert torch.equal(s["d2t"], ta["d2t"])
    assert json.loads((tmp_path / "s" / "config.json").read_text()) == {"hidden_size": 4}
    assert json.loads((tmp_path / "s" / "provenance.json").read_text())["weights"] == [0.5, 0.5]
    # other weights
    assert avg.main([str(a), str(b), "--out", str(tmp_path / "w"), "--weights", "0.75,0.25"]) == 0
    w = load_file(str(tmp_path / "w" / "model.safetensors"))
    assert torch.equal(w["norm.weight"], torch.full((4,), 1.5, dtype=torch.bfloat16))


@pytest.mark.parametrize("case,message", [
    ("vocab", "differs (a different draft vocabulary?)"),
    ("one", "give at least two drafters"),
    ("missing", "no config.json + model.safetensors"),
    ("weights", "--weights: one per drafter"),
])
def test_mismatches_are_refused_in_one_line(tmp_path, capsys, case, message):
    a = drafter_dir(tmp_path / "a", 1.0)
    b = drafter_dir(tmp_path / "b", 2.0, d2t=(0, 2, 5) if case == "vocab" else (0, 1, 5))
    argv = {"vocab": [a, b], "one": [a], "missing": [a, tmp_path / "nothing"], "weights": [a, b, "--weights", "0.5"]}
    with pytest.raises(SystemExit) as exc:
        avg.main([str(x) for x in argv[case]] + ["--out", str(tmp_path / "s")])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
