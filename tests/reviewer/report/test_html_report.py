"""The HTML report: self-contained, and really rendered by a headless Chromium (Debian's `chromium` package, which
`make system-deps` installs): a screenshot, and a layout check made inside the browser on a copy of the page."""

import json
import re
import shutil
import struct
import subprocess

import pytest
from typer.testing import CliRunner

from reviewer.cli import app
from reviewer.report.html_report import nice_ticks, svg_plot
from tests.report_data import REPO, fill

runner = CliRunner()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make system-deps installs it)")

# Runs inside the page after load: measures what the browser laid out and writes it into the DOM for --dump-dom.
LAYOUT_CHECK = """
<script>
addEventListener('load', () => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.width, r.height]; };
  const visible = e => { const r = e.getBoundingClientRect();
    return document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2 - scrollY) === e; };
  const out = {
    findings: [...document.querySelectorAll('.finding')].map(f => ({title: f.querySelector('.title').textContent,
                                                                    size: box(f)})),
    plots: [...document.querySelectorAll('svg.measurement')].map(s => ({
      label: s.getAttribute('aria-label'), size: box(s),
      line: s.querySelector('path') ? box(s.querySelector('path')) : null,
      points: s.querySelectorAll('circle').length,
      changedFill: [...s.querySelectorAll('.point.changed circle')].map(c => getComputedStyle(c).fill),
      firstPointVisible: (() => { const c = s.querySelector('circle'); window.scrollTo(0, 0);
        c.scrollIntoView({block: 'center'}); return visible(c); })()})),
  };
  document.getElementById('hide-unverified').click();
  out.unverifiedHidden = [...document.querySelectorAll('.finding.unverified')]
    .every(f => getComputedStyle(f).display === 'none');
  out.verifiedShown = [...document.querySelectorAll('.finding:not(.unverified)')]
    .every(f => getComputedStyle(f).display !== 'none');
  const pre = document.createElement('pre');
  pre.id = 'layout-check';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def chromium(*args, tmp_path):
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def html_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    db = str(tmp / "reviews.db")
    fill(db)
    out = tmp / "report.html"
    result = runner.invoke(app, ["report", "--db", db, "--format", "html", "--output", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_html_is_self_contained(html_file):
    html = html_file.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert "<script" not in html and "<link" not in html and "@import" not in html and "url(" not in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "&lt;b&gt;x&lt;/b&gt;" in html  # finding text is escaped, never markup
    assert html.count('<svg class="measurement"') == 2  # import_seconds and install_seconds of the repository
    assert html.count('class="point changed"') == 1  # only the 30% slow-down


def test_plot_marks_only_changes():
    series = {"repo": REPO, "persona": "p", "name": "t", "unit": "s", "points": [
        {"run_id": 1, "commit": "aaaaaaaa", "n": 3, "median": 1.0, "min": 0.9, "max": 1.1, "change": None},
        {"run_id": 2, "commit": "bbbbbbbb", "n": 3, "median": 2.0, "min": 1.9, "max": 2.1,
         "change": {"changed": True, "p": 0.01, "ratio": 2.0, "method": "mann-whitney"}},
    ]}
    svg = svg_plot(series)
    assert svg.count("<circle") == 2 and svg.count('class="whisker"') == 2 and "+100%" in svg
    assert ">aaaaaaa<" in svg and ">bbbbbbb<" in svg
    assert nice_ticks(0.93, 2.17) == [1.0, 1.5, 2.0]
    assert nice_ticks(0, 10) == [0, 2.5, 5.0, 7.5, 10.0]


@needs_chromium
def test_chromium_renders_findings_and_plots(html_file, tmp_path):
    checked = tmp_path / "checked.html"
    checked.write_text(html_file.read_text().replace("</body>", LAYOUT_CHECK + "</body>"))
    proc = chromium("--window-size=1280,2000", "--virtual-time-budget=5000", "--dump-dom", checked.as_uri(),
                    tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r'<pre id="layout-check">(.*?)</pre>', proc.stdout, re.S)
    assert found, proc.stdout[-2000:]
    layout = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                        .replace("&gt;", ">"))
    titles = {f["title"] for f in layout["findings"]}
    assert titles == {"2 tests failed", "README claims moving_average is linear"}  # the latest run of REPO
    assert all(w > 300 and h > 20 for w, h in (f["size"] for f in layout["findings"]))
    plots = {p["label"]: p for p in layout["plots"]}
    assert set(plots) == {"performance / import_seconds (s)", "smoke / install_seconds (s)"}
    for p in plots.values():
        assert p["size"][0] >= 500 and p["size"][1] >= 200
        assert p["line"][0] > 300  # the line across the four commits was laid out
        assert p["points"] == 4 and p["firstPointVisible"]
    assert plots["performance / import_seconds (s)"]["changedFill"] == ["rgb(207, 34, 46)"]
    assert plots["smoke / install_seconds (s)"]["changedFill"] == []
    assert layout["unverifiedHidden"] and layout["verifiedShown"]


@needs_chromium
def test_chromium_screenshot(html_file, tmp_path):
    png = tmp_path / "report.png"
    proc = chromium(f"--screenshot={png}", "--window-size=1280,2000", html_file.as_uri(), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1280, 2000)
    # A blank 1280x2000 page compresses to a few kB; text, badges and plots do not.
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    blank_png = tmp_path / "blank.png"
    chromium(f"--screenshot={blank_png}", "--window-size=1280,2000", blank.as_uri(), tmp_path=tmp_path)
    assert len(data) > 5 * len(blank_png.read_bytes())
