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


def render(page: Path, shot: Path, script: str = PROBE, height: int = 1800) -> dict:
    """Load a copy of ``page`` with the probe ``script`` in Chromium (a window ``WIDTH`` x ``height``);
    the probe's findings, and a screenshot of the page."""
    probe = page.with_name(page.stem + ".probe.html")
    probe.write_text(page.read_text().replace("</body>", script + "</body>"))
    args = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--allow-file-access-from-files",
            f"--window-size={WIDTH},{height}", "--virtual-time-budget=10000"]
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
    assert seen["readings"] == len(seen["sections"]) == 7  # answer, statistics..., recommend, tasks (a hint without --tasks)
    assert seen["sections"][0] == "answer"


FIRST_SCREEN = """<script>
window.addEventListener("load", () => {
  const table = document.querySelector("#answer table.answer");
  const box = e => e.getBoundingClientRect();
  document.title = "PROBE" + JSON.stringify({
    height: window.innerHeight, scroll: document.documentElement.scrollWidth, inner: window.innerWidth,
    table: table ? {top: box(table).top, bottom: box(table).bottom} : null,
    rows: table ? [...table.querySelectorAll("tr.plan")].map(r => ({bottom: box(r).bottom, cells: [...r.cells].map(c => c.innerText)})) : [],
    uniform: table ? [...table.querySelectorAll("tr.uniform")].map(r => [...r.cells].map(c => c.innerText)) : [],
    sentences: [...document.querySelectorAll("#answer ol.sentences li")].map(li => ({bottom: box(li).bottom, text: li.innerText})),
    heads: table ? [...table.querySelectorAll("th")].map(th => th.innerText) : [],
  });
});
</script>"""


def test_report_first_screen_answers_each_budget(tiny_capture, tmp_path):
    """At 1400 x 900, before any scrolling: one table row and one sentence per budget, each with
    the plan in words, GiB at the batch and context given, decode speed against dense from the bench
    JSON, fidelity and the command that applies it."""
    plan = tmp_path / "decode-plan-25.json"
    plan.write_text(json.dumps({"budget": {"text": "25%", "fraction": 0.25}}))
    rec = lambda p, tps, ratio: {"kernel": "decode", "provider": p, "device": "Card X", "batch": 8, "seq": 32768, "tokens_per_s": tps,  # noqa: E731
                                 "storage_ratio": ratio, "status": "ok", "median_us": 1e6 / tps}
    bench = tmp_path / "decode.json"
    bench.write_text(json.dumps({"kvtool_bench": 1, "subcommand": "decode", "date": "2026-11-27T00:00:00Z", "command": "kvtool bench decode",
                                 "env": {"device": "Card X"}, "shape": {"name": "llama3-8b"}, "primary_baselines": ["dense/sdpa"],
                                 "records": [rec("dense/sdpa", 400.0, 1.0), rec(str(plan), 600.0, 0.24)]}))
    out = tmp_path / "report.html"
    res = CliRunner().invoke(app, ["report", str(tiny_capture), "--budgets", "25%,40%", "--batch", "4", "--context", "16k", "--heldout", "16",
                                   "--no-model", "--bench", str(bench), "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    shot = tmp_path / "first-screen.png"
    seen = render(out, shot, FIRST_SCREEN, height=900)
    assert seen["scroll"] <= seen["inner"], seen
    assert seen["table"] and seen["table"]["bottom"] <= 900, seen["table"]  # the whole table on the first screen
    assert [r["cells"][0] for r in seen["rows"]] == ["25%", "40%"] and all(r["bottom"] <= 900 for r in seen["rows"])
    assert len(seen["sentences"]) == 2 and all(s["bottom"] <= 900 for s in seen["sentences"]), seen["sentences"]
    assert any("batch 4 x 16k" in h for h in seen["heads"]) and any("Card X" in h for h in seen["heads"])
    for (budget, words, stored, gib, speed, fidelity, command), sentence in zip((r["cells"] for r in seen["rows"]), seen["sentences"]):
        assert re.search(r"KV heads? whole|evict \d+% of the tokens", words), words  # the plan in words, not spec strings
        assert re.fullmatch(r"\d+\.\d%", stored) and re.fullmatch(r"\d+\.\d+ GiB", gib)
        assert fidelity and fidelity != "-"
        assert command.startswith(f"kvtool compress {tiny_capture} --plan plan-{budget[:-1]}.json -o ")
        assert sentence["text"].startswith(f"At {budget}: {words}") and gib in sentence["text"]
    assert seen["rows"][0]["cells"][4] == "600 (1.50x)" and seen["rows"][1]["cells"][4] == "not timed"  # 25% was timed, 40% not
    assert "1.50x dense) on Card X" in seen["sentences"][0]["text"]
    assert len(seen["uniform"]) == 2 and all(u[0] == "uniform" and u[6].startswith("--format ") for u in seen["uniform"])
    from PIL import Image

    img = Image.open(shot)
    assert img.size == (WIDTH, 900)
    top = img.convert("L").crop((0, 0, WIDTH, 900))
    assert sum(1 for n in top.histogram() if n) > 50  # the table is drawn, not a blank page
