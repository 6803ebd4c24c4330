"""kvtool report: the HTML is self-contained (no external URLs), every section is present with its
reading, and every inlined image decodes as a PNG."""

from __future__ import annotations

import base64
import io
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
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
    # the first screen comes first, and names the same best uniform setting as the frontier section
    assert text.index('id="answer"') < text.index('id="model"')
    frontier = text.split('<section id="frontier">')[1].split("</section>")[0]
    import html as _html
    import re

    first = text.split('<section id="answer">')[1].split("</section>")[0]
    from kvtool.analysis.answer import capture_arg
    assert re.findall(r'<tr class="plan"><td><b>([^<]+)</b>', first) == ["15%", "40%"]
    uniforms = [_html.unescape(u) for u in re.findall(r'<tr class="uniform"><td>uniform</td><td class="words" title="([^"]+)"', first)]
    assert len(uniforms) == 2
    for budget, spec in zip(("15", "40"), uniforms):
        assert f"kvtool compress {capture_arg(sample_capture)} --plan plan-{budget}.json" in first
        assert f'download="plan-{budget}.json" href="data:application/json;base64,' in first
        assert spec in frontier  # one best uniform per budget, the same in the frontier section
    res = CliRunner().invoke(app, ["report", str(sample_capture), "--no-model", "-o", str(out)])
    assert res.exit_code == 2 and "exists" in res.output
    res = CliRunner().invoke(app, ["report", str(sample_capture), "--no-model", "--eval", str(tmp_path / "none"), "-o", str(tmp_path / "r2.html")])
    assert res.exit_code == 2 and "eval.json" in res.output


def _label_points(ax):
    """(own point in pixels, label box in pixels, every marker in pixels) of each annotation."""
    import numpy as np

    renderer = ax.figure.canvas.get_renderer()
    markers = np.concatenate([ax.transData.transform(c.get_offsets()) for c in ax.collections if len(c.get_offsets())])
    out = []
    for ann in ax.texts:
        if not hasattr(ann, "xy"):
            continue
        own = ax.transData.transform(ann.xy)
        ext = ann.get_window_extent(renderer)
        out.append((own, (ext.x0, ext.y0, ext.x1, ext.y1), markers))
    return out


def _nearest(box, markers):
    import numpy as np

    dx = np.maximum(np.maximum(box[0] - markers[:, 0], 0), markers[:, 0] - box[2])
    dy = np.maximum(np.maximum(box[1] - markers[:, 1], 0), markers[:, 1] - box[3])
    return markers[int(np.argmin(np.hypot(dx, dy)))]


def crowded_rows():
    """A sweep whose points crowd each other: 5 formats x 6 settings at nearby bytes and errors."""
    import random

    rnd = random.Random(3)
    rows = []
    for f in ("bitmap", "quant", "signvq", "snapstream", "pagestat"):
        for k in range(6):
            x = 0.15 + 0.05 * k + rnd.uniform(-0.02, 0.02)
            rows.append({"format": f, "params_text": f"p={k}", "storage_ratio": x, "rel_l2": 0.4 * (1.2 - x) + rnd.uniform(-0.03, 0.03)})
    return rows


def test_frontier_labels_are_nearest_their_own_point_and_the_log_axis_is_readable():
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kvtool.analysis.frontier import plot_frontier

    fig = Figure(figsize=(8, 5.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    plot_frontier(crowded_rows(), Path("unused.png"), "rel_l2", ax=ax)
    labels = _label_points(ax)
    assert len(labels) >= 12  # most of the 30 points get a label
    for own, box, markers in labels:
        assert tuple(_nearest(box, markers)) == tuple(own), "a label sits nearer another point than its own"
    lo, hi = ax.get_ylim()
    shown = [t for t in ax.get_yticks() if lo <= t <= hi]
    assert len(shown) >= 3, shown  # 1-2-5 ticks, not just one decade mark
    texts = [ax.yaxis.get_major_formatter()(t, 0) for t in shown]
    assert all(t and "10^" not in t and "$" not in t for t in texts), texts


def test_report_attention_frontier_labels_are_nearest_their_own_point():
    from kvtool.analysis.html_report import attention_frontier_figure

    uniform = [{"spec": f"{f}:x={k}", "storage_ratio": 0.1 + 0.07 * k + 0.01 * n, "loss": (0.5 - 0.05 * k) ** 2 * 4}
               for n, f in enumerate(("quant", "bitmap", "signvq", "snapstream")) for k in range(6)]
    fig = attention_frontier_figure(uniform, [{"storage_ratio": 0.15, "loss": 0.2, "budget": "15%"}], n_layers=4)
    ax = fig.axes[0]
    labels = _label_points(ax)
    assert labels
    for own, box, markers in labels:
        assert tuple(_nearest(box, markers)) == tuple(own)


def test_report_nll_in_nats_noise_flag_and_reproduce_line(tiny_capture, tiny_llama_dir, tmp_path):
    from kvtool.analysis.html_report import _ci_text, nll_text

    assert nll_text(-0.0021) == "-0.0021* nats/token (negative: noise)" and nll_text(0.0123, words=False) == "+0.0123"
    assert _ci_text({"mean": -0.002, "lo": -0.004, "hi": 0.001, "n": 3}, nll=True) == "-0.0020* [-0.0040, +0.0010]"
    out = tmp_path / "r.html"
    res = CliRunner().invoke(app, ["report", str(tiny_capture), "--budgets", "40%", "--heldout", "16", "--model", str(tiny_llama_dir),
                                   "--no-texts", "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "NLL + (capture, nats/token)" in text and "mean [95%]" not in text and "cases)" not in text  # one case: no interval columns
    import re

    plan_row = re.search(r"<tr><td>plan @ 40%</td><td>[\d.]+%</td>(<td[^>]*>[^<]*</td>)", text).group(1)
    assert re.fullmatch(r'<td class="\w+">[+-]\d\.\d{4}\*?</td>', plan_row), plan_row  # signed nats/token, graded
    reproduce = text.split("Reproduce:")[1].split("Cases:")[0]
    for option in ("--budgets 40%", "--heldout 16", f"--model {tiny_llama_dir}", "--no-texts", "--budget 40%"):
        assert option in reproduce, option
    assert 'class="good"' in text or 'class="fair"' in text or 'class="poor"' in text  # graded cells


def test_model_cost_figure_ticks_in_nats():
    from kvtool.analysis.html_report import model_cost_figure

    def setting(ratio, nll):
        return {"cases": [{"storage_ratio": ratio, "nll_increase": nll}], "nll_increase": {"mean": nll, "lo": None, "hi": None, "n": 1}}

    budgets = [{"budget": "40%", "plan_label": "plan @ 40%",
                "check": {"plan @ 40%": setting(0.38, 0.0086), "quant:bits=2": setting(0.29, 0.0084), "signvq:bits=4": setting(0.41, -0.0056)}}]
    ax = model_cost_figure(budgets).axes[0]
    lo, hi = ax.get_ylim()
    labels = [ax.yaxis.get_major_formatter()(t, 0) for t in ax.get_yticks() if lo <= t <= hi]
    assert len(labels) >= 4 and "0" in labels and all("%" not in t for t in labels), labels
    assert "nats/token" in ax.get_ylabel()


def test_model_cost_marker_sits_at_the_centre_of_its_own_bar():
    from kvtool.analysis.html_report import model_cost_figure

    cases = [{"storage_ratio": 0.15, "nll_increase": v} for v in (0.05, 0.001, 0.002, 0.003)]  # the capture's case far from the mean
    iv = {"mean": 0.014, "lo": 0.0, "hi": 0.04, "n": 4}
    budgets = [{"budget": "15%", "plan_label": "plan @ 15%", "check": {"plan @ 15%": {"cases": cases, "nll_increase": iv}}}]
    ax = model_cost_figure(budgets).axes[0]
    from matplotlib.collections import LineCollection, PathCollection

    (x, y), = next(c for c in ax.collections if isinstance(c, PathCollection)).get_offsets()  # the marker
    bar = next(c for c in ax.collections if isinstance(c, LineCollection))
    (_, lo), (_, hi) = sorted(bar.get_segments()[0], key=lambda p: p[1])
    assert (x, y) == pytest.approx((15.0, 0.014)) and lo == pytest.approx(0.0) and hi == pytest.approx(0.04)
    assert "mean of 4 cases" in ax.get_ylabel()


def test_eval_points_of_another_capture_are_left_out(tmp_path):
    from kvtool.analysis.html_report import read_eval_of

    (tmp_path / "ev").mkdir()
    points = [{"format": "quant", "capture": "/x/other.safetensors", "storage_ratio": 0.3},
              {"format": "bitmap", "capture": str(tmp_path / "mine.safetensors"), "storage_ratio": 0.4}]
    (tmp_path / "ev" / "eval.json").write_text(json.dumps({"points": points}))
    mine, others = read_eval_of(tmp_path / "ev", tmp_path / "mine.safetensors")
    assert [p["format"] for p in mine] == ["bitmap"] and others == ["other.safetensors"]
