"""kvtool report: the HTML is self-contained (no external URLs), every section is present with its
reading, and every inlined image decodes as a PNG."""

from __future__ import annotations

import base64
import io
import json
from html.parser import HTMLParser
from pathlib import Path

from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.analysis.html_report import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
BENCH = {
    "kvtool_bench": 1, "subcommand": "attention", "date": "2026-11-22T07:38:52Z", "command": "kvtool bench attention",
    "env": {"device": "test GPU"}, "primary_baselines": ["cublas_qk+pv", "flashinfer_batch"],
    "records": [
        {"kernel": "bitmap_attention", "provider": p, "batch": 8, "seq": 4096, "sparsity": s, "median_us": us, "status": "ok"}
        for p, s, us in [("cublas_qk+pv", None, 60.0), ("flashinfer_batch", None, 55.0), ("bitmap_triton", 0.7, 40.0), ("bitmap_triton", 0.5, 50.0)]
    ],
}


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sections, self.images, self.urls, self.readings, self._in_reading = [], [], [], 0, False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.sections.append(a.get("id"))
        if tag == "img":
            self.images.append(a.get("src", ""))
        for key in ("src", "href"):
            v = a.get(key) or ""
            if v.startswith(("http:", "https:", "//")):
                self.urls.append(v)
        if tag == "script" or (tag == "link" and a.get("rel") == "stylesheet"):
            self.urls.append(tag)
        if tag == "p" and a.get("class") == "reading":
            self.readings += 1


def test_report_sections_and_images(sample_capture, tmp_path):
    from PIL import Image

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    out = tmp_path / "report.html"
    res = CliRunner().invoke(app, ["report", str(sample_capture), "--no-model", "--budgets", "15%,40%", "--bench", str(bench), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    p = _Collect()
    p.feed(out.read_text())
    assert p.sections == list(SECTIONS)
    assert p.readings == len(SECTIONS)
    assert not p.urls  # nothing fetched from elsewhere
    assert len(p.images) == summary["figures"] >= 7
    for src in p.images:
        assert src.startswith("data:image/png;base64,")
        img = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
        img.verify()
        assert img.size[0] > 300 and img.size[1] > 200
    text = out.read_text()
    assert "At 15% of the bytes" in text and "test GPU" in text and "bitmap_attention" in text
    res = CliRunner().invoke(app, ["report", str(sample_capture), "--no-model", "-o", str(out)])
    assert res.exit_code == 2 and "exists" in res.output
    res = CliRunner().invoke(app, ["report", str(sample_capture), "--no-model", "--eval", str(tmp_path / "none"), "-o", str(tmp_path / "r2.html")])
    assert res.exit_code == 2 and "eval.json" in res.output
