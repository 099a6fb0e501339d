from tinystats.cli import main


def test_cli_mean(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("1\n2\n3\n")
    assert main([str(data), "--stat", "mean"]) == 0
    assert capsys.readouterr().out.strip() == "2.0"
