"""plots/index.html and the report as a reader sees them: rendered in headless Chromium at 1400 px
(skipped where Chromium is not installed: ``apt-get install chromium``). A script appended to a copy
of each page reports, through the page title, whether every image decoded, whether anything is wider
than the window, and how the document is organised; a screenshot is kept for a person to look at."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs headless Chromium (apt-get install chromium)")
WIDTH = 1400

PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const wide = [...document.querySelectorAll("body *")].filter(e => e.getBoundingClientRect().right > window.innerWidth + 1).map(e => e.tagName);
  document.title = "PROBE" + JSON.stringify({
    images: imgs.length, broken: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).length,
    scroll: document.documentElement.scrollWidth, inner: window.innerWidth, wide: wide.slice(0, 5),
    sections: [...document.querySelectorAll("section")].map(s => s.id),
    readings: document.querySelectorAll("p.reading").length,
    contents: [...document.querySelectorAll("nav a")].map(a => a.getAttribute("href")),
  });
});
</script>"""


def render(page: Path, shot: Path) -> dict:
    """Load a copy of ``page`` with the probe in Chromium; the probe's findings, and a screenshot."""
    probe = page.with_name(page.stem + ".probe.html")
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    args = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--allow-file-access-from-files",
            f"--window-size={WIDTH},1800", "--virtual-time-budget=10000"]
    dom = subprocess.run(args + ["--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120).stdout
    subprocess.run(args + [f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120)
    found = re.search(r"<title>PROBE(.*?)</title>", dom, re.S)
    assert found, dom[-2000:]
    return json.loads(found.group(1).replace("&quot;", '"'))


def test_plot_index_in_chromium(tmp_path):
    out = tmp_path / "plots"
    res = CliRunner().invoke(app, ["plot", "sample:", "--all", "--layers", "7,15", "--heads", "0", "--what", "outliers,heatmap,profile,concentration",
                                   "--queries", "16", "--out-dir", str(out), "-q"])
    assert res.exit_code == 0, res.output
    shot = tmp_path / "index.png"
    seen = render(out / "index.html", shot)
    assert seen["images"] == 1 + 2 * 2 + 2 + 2 and seen["broken"] == 0
    assert seen["scroll"] <= seen["inner"] and not seen["wide"], seen  # nothing wider than 1400 px
    assert seen["sections"] == ["outliers", "heatmap", "profile", "concentration"]
    assert seen["readings"] == len(seen["sections"])  # a short reading per section
    assert [h for h in seen["contents"] if h != "#contents"] == [f"#{s}" for s in seen["sections"]]
    from PIL import Image

    img = Image.open(shot)
    assert img.size[0] == WIDTH and sum(1 for n in img.convert("L").histogram() if n) > 50  # a rendered page, not a blank one


def test_report_in_chromium(tiny_capture, tmp_path):
    out = tmp_path / "report.html"
    res = CliRunner().invoke(app, ["report", str(tiny_capture), "--budgets", "40%", "--heldout", "16", "--no-model", "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    seen = render(out, tmp_path / "report.png")
    assert seen["images"] >= 5 and seen["broken"] == 0
    assert seen["scroll"] <= seen["inner"] and not seen["wide"], seen
    assert seen["readings"] == len(seen["sections"]) == 6  # statistics..., recommend, tasks (a hint without --tasks)
