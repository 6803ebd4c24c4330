"""kvtool.plots: valid images of the expected size, heatmap pixels that follow a planted channel,
plot sets with index.html, and `kvtool plot`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import kvtool
from kvtool.analysis import plots as P
from kvtool.cli import app
from kvtool.core.errors import BadDataError, OutputExistsError, UsageError
from kvtool.analysis.stats import StatsSettings, layer_attention

from .conftest import synthetic_cache

runner = CliRunner()
SIZE = (int(P.FIGSIZE[0] * P.DPI), int(P.FIGSIZE[1] * P.DPI))


def small_cache(queries: bool = True):
    """2 layers, 4 query heads over 2 KV heads, 40 tokens, head_dim 16, key channel 3 planted x8."""
    return synthetic_cache(tokens=40, head_dim=16, layers=(0, 1), queries=queries)


def luminance(path: Path) -> np.ndarray:
    """``[height, width]`` float luminance (0..255) of an image file."""
    return np.asarray(Image.open(path).convert("L"), dtype=np.float64)


def test_heatmap_pixels_follow_the_planted_channel(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    x[:, 11] *= 8
    facts = small_cache().facts
    fig = P.heatmap_figure(x, facts, 0, 1, "keys")
    fig.canvas.draw()
    box = fig.axes[0].get_window_extent()  # display pixels, origin bottom-left
    path = P.save_figure(fig, tmp_path / "h.png", "png")
    img = Image.open(path)
    assert img.format == "PNG" and img.size == SIZE
    lum = luminance(path)
    height = lum.shape[0]
    x0, x1 = int(np.ceil(box.x0)) + 2, int(np.floor(box.x1)) - 2
    y0, y1 = height - int(np.floor(box.y1)) + 2, height - int(np.ceil(box.y0)) - 2
    region = lum[y0:y1, x0:x1]
    cols = np.arange(x0, x1)
    channel = ((cols - box.x0) / box.width * 16).astype(int)
    per_channel = np.array([region[:, channel == c].mean() for c in range(16)])
    assert int(per_channel.argmax()) == 11
    others = np.delete(per_channel, 11)
    assert per_channel[11] > 2 * others.max()
    # brighter pixels where |x| is larger: per-channel brightness follows per-channel mean |x|
    assert np.corrcoef(per_channel, x.abs().mean(0).numpy())[0, 1] > 0.9


@pytest.fixture(scope="module")
def plot_set(tmp_path_factory):
    """Every kind for layer 1, KV heads 0 and 1 of :func:`small_cache`: (cache, folder, files)."""
    cache = small_cache()
    folder = tmp_path_factory.mktemp("set")
    files = P.write_plot_set(cache, P.plan_plots([1], [0, 1], P.KINDS), folder, "png", StatsSettings(max_queries=8))
    return cache, folder, files


def test_each_figure_is_a_titled_image_of_the_expected_size(plot_set):
    _, _, files = plot_set
    assert len(files) == 1 + 2 * 3 + 3  # outlier map; per head 2 heatmaps + profile; per layer 3
    for f in files:
        img = Image.open(f["path"])
        img.verify()
        assert Image.open(f["path"]).size == SIZE
        assert f["title"].startswith("synthetic")
        if f["layer"] is not None:
            assert f"layer {f['layer']}" in f["title"]
    kinds = {f["kind"] for f in files}
    assert kinds == set(P.KINDS)
    heat = [f for f in files if f["kind"] == "heatmap"][0]
    assert "KV head 0" in heat["title"] and "|keys|" in heat["title"]


def test_figures_carry_labels_and_colour_bars():
    cache = small_cache()
    facts = cache.facts
    k = cache.layers[0].keys[0, 0].float()
    v = cache.layers[0].values[0, 0].float()
    heat = P.heatmap_figure(k, facts, 0, 0, "keys")
    assert heat.axes[0].get_xlabel() == "channel" and heat.axes[0].get_ylabel() == "token"
    assert len(heat.axes) == 2 and heat.axes[1].get_ylabel() == "|K|"  # the colour bar
    prof = P.profile_figure(k, v, facts, 0, 0, 4.0)
    assert prof.axes[0].get_title() == "keys: 1 outlier channel(s)"
    assert prof.axes[1].get_title() == "values: 0 outlier channel(s)"
    ratios = {p: {(0, 0): torch.ones(16)} for p in ("keys", "values")}
    ratios["keys"][(0, 0)][3] = 9.0
    omap = P.outlier_map_figure(ratios, facts, 4.0)
    assert omap.axes[0].get_title() == "keys: 1 outlier cells"
    assert "median channel" in omap.axes[-1].get_ylabel()
    att = layer_attention(cache.layers[0], facts, StatsSettings(max_queries=8))
    conc = P.concentration_figure(att, facts, 0)
    assert len(conc.axes[0].get_lines()) == 4 + 2  # one curve per query head + the 90%/99% lines
    heads = P.head_importance_figure(att, facts, 0)
    assert "heads per query" in " ".join(t.get_text() for t in heads.legends[0].get_texts())


@pytest.mark.parametrize("fmt, magic", [("svg", b"<svg"), ("pdf", b"%PDF")])
def test_vector_formats(tmp_path, fmt, magic):
    cache = small_cache()
    files = P.write_plot_set(cache, P.plan_plots([1], [0], ("heatmap",)), tmp_path, fmt)
    assert [Path(f["path"]).suffix for f in files] == [f".{fmt}"] * 2
    head = Path(files[0]["path"]).read_bytes()[:400]
    assert magic in head


def test_existing_files_are_not_overwritten_without_force(tmp_path):
    cache = small_cache()
    specs = P.plan_plots([0], [0], ("profile", "histogram"))
    P.write_plot_set(cache, specs, tmp_path, "png")
    target = tmp_path / "histogram-L00.png"
    before = target.read_bytes()
    (tmp_path / "profile-L00-H0.png").unlink()
    with pytest.raises(OutputExistsError):
        P.write_plot_set(cache, specs, tmp_path, "png")
    assert not (tmp_path / "profile-L00-H0.png").exists()  # nothing written before the refusal
    assert target.read_bytes() == before
    P.write_plot_set(cache, specs, tmp_path, "png", force=True)
    assert (tmp_path / "profile-L00-H0.png").exists()


def test_failed_set_leaves_nothing_behind(tmp_path, monkeypatch):
    cache = small_cache()
    out = tmp_path / "new"
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(P, "histogram_figure", failing)
    with pytest.raises(RuntimeError):
        P.write_plot_set(cache, P.plan_plots([0], [0], ("heatmap", "histogram")), out, "png")
    assert calls and not out.exists()


def test_attention_plots_need_queries(tmp_path):
    with pytest.raises(BadDataError, match="--no-queries"):
        P.write_plot_set(small_cache(queries=False), P.plan_plots([0], [0], ("heads",)), tmp_path, "png")
    with pytest.raises(UsageError):
        P.write_plot_set(small_cache(), [], tmp_path, "gif")


def test_index_shows_every_file(plot_set):
    cache, folder, files = plot_set
    index = P.write_index(folder, files, cache.facts, Path("cap.safetensors"), "png")
    text = index.read_text()
    assert text.startswith("<!doctype html>")
    for f in files:
        assert f'src="{Path(f["path"]).name}"' in text
    assert text.count("<figure>") == len(files)
    assert text.index("outlier-map.png") < text.index("heatmap-keys-L01-H0.png")
    with pytest.raises(OutputExistsError):
        P.write_index(folder, files, cache.facts, Path("cap.safetensors"), "png")


# ----------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plotcaps")
    kvtool.save(small_cache(), folder / "cap.safetensors")
    kvtool.save(small_cache(queries=False), folder / "noq.safetensors")
    return folder


def test_cli_plot_all_writes_set_and_index(captures, tmp_path):
    out = tmp_path / "plots"
    res = runner.invoke(app, ["plot", str(captures / "cap.safetensors"), "--all", "--heads", "1", "--out", str(out), "--queries", "8", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["index"] == str(out / "index.html") and (out / "index.html").exists()
    names = sorted(Path(f["path"]).name for f in data["files"])
    assert names == sorted(p.name for p in out.glob("*.png"))
    assert "heatmap-keys-L01-H1.png" in names and "heatmap-keys-L01-H0.png" not in names
    res = runner.invoke(app, ["plot", str(captures / "cap.safetensors"), "--all", "--out", str(out)])
    assert res.exit_code == 2 and "--force" in res.output


def test_cli_plot_single_layer_and_head(captures, tmp_path):
    res = runner.invoke(app, ["plot", str(captures / "cap.safetensors"), "--layer", "0", "--head", "1", "--what", "heatmap,profile", "--out", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["heatmap-keys-L00-H1.png", "heatmap-values-L00-H1.png", "profile-L00-H1.png"]


def test_cli_plot_without_queries(captures, tmp_path):
    res = runner.invoke(app, ["plot", str(captures / "noq.safetensors"), "--what", "concentration", "--out", str(tmp_path / "a")])
    assert res.exit_code == 1 and "recapture without --no-queries" in res.output
    assert not (tmp_path / "a").exists()
    res = runner.invoke(app, ["plot", str(captures / "noq.safetensors"), "--what", "profile,heads,histogram", "--out", str(tmp_path / "b")])
    assert res.exit_code == 1
    res = runner.invoke(app, ["plot", str(captures / "noq.safetensors"), "--out", str(tmp_path / "c"), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert {s["kind"] for s in data["skipped"]} == {"concentration", "heads"}
    assert {f["kind"] for f in data["files"]} == {"outliers", "heatmap", "profile", "histogram"}


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["--layer", "5"], 2, "layer 5 is not in"),
        (["--head", "2"], 2, "KV head 2 is out of range"),
        (["--all", "--layer", "0"], 2, "with --all use --layers"),
        (["--heads", "0"], 2, "--heads selects heads for --all"),
        (["--what", "pie"], 2, "unknown plot kind 'pie'"),
        (["--format", "gif"], 2, "unknown --format 'gif'"),
        (["--out", "{missing}/x/y"], 2, "does not exist"),
        (["--out", "{file}"], 2, "is a file, not a folder"),
    ],
)
def test_cli_plot_bad_usage(captures, tmp_path, args, code, text):
    (tmp_path / "afile").write_text("x")
    args = [a.format(missing=tmp_path / "nope", file=tmp_path / "afile") for a in args]
    res = runner.invoke(app, ["plot", str(captures / "cap.safetensors"), *args])
    assert res.exit_code == code, res.output
    assert text in res.output and "Traceback" not in res.output


def test_cli_plot_real_sample_heatmap(sample_capture, tmp_path):
    res = runner.invoke(app, ["plot", str(sample_capture), "--layer", "15", "--head", "1", "--what", "heatmap,outliers", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert Image.open(tmp_path / "heatmap-keys-L15-H1.png").size == SIZE
    assert Image.open(tmp_path / "outlier-map.png").size == SIZE


def _clipped_texts(fig) -> list[str]:
    """What of ``fig`` sticks out of the image (a label cut off at its edge): every axes with its tick
    labels, axis labels, titles and legends as drawn, and the figure's own titles and legends."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    parts = [(f"axes {i}", ax.get_tightbbox(renderer)) for i, ax in enumerate(fig.axes)]
    parts += [("legend", leg.get_window_extent(renderer)) for leg in fig.legends]
    parts += [(t.get_text(), t.get_window_extent(renderer)) for t in fig.texts if t.get_visible() and t.get_text().strip()]
    bad = [name for name, e in parts if e is not None and (e.x0 < box.x0 - 1 or e.y0 < box.y0 - 1 or e.x1 > box.x1 + 1 or e.y1 > box.y1 + 1)]
    for ax in fig.axes:  # a label on a bar or point stays inside the plot area (not on the title, not off the frame)
        inner = ax.get_window_extent(renderer)
        for t in ax.texts:
            e = t.get_window_extent(renderer)
            if e.x0 < inner.x0 - 1 or e.y0 < inner.y0 - 1 or e.x1 > inner.x1 + 1 or e.y1 > inner.y1 + 1:
                bad.append(t.get_text())
    return bad


def test_no_figure_cuts_a_label_off():
    """Every kind of figure, on a cache whose outliers sit on the first and last channel and on the
    tallest bar (the labels most likely to be cut), keeps every text inside the image."""
    cache = small_cache()
    layer = cache.layers[0]
    keys = layer.keys.clone()
    keys[..., 0] *= 10
    keys[..., 15] *= 12
    from kvtool.core.cache import LayerKV

    cache.layers[0] = LayerKV(keys, layer.values, layer.queries)
    facts, settings = cache.facts, StatsSettings(max_queries=8)
    rows = {p: P.head_rows(getattr(cache.layers[0], p), None) for p in ("keys", "values")}
    att = layer_attention(cache.layers[0], facts, settings)
    ratios = {p: {(l, h): P.outlier_ratios(P.channel_mean_abs(r)) for l in (0, 1) for h, r in enumerate(P.head_rows(getattr(cache.layers[l], p), None))}
              for p in ("keys", "values")}
    figures = {
        "heatmap": P.heatmap_figure(rows["keys"][0], facts, 0, 0, "keys", vmax=50.0),
        "profile": P.profile_figure(rows["keys"][0], rows["values"][0], facts, 0, 0, 4.0),
        "histogram": P.histogram_figure(rows["keys"], rows["values"], facts, 0, "all KV heads"),
        "outliers": P.outlier_map_figure(ratios, facts, 4.0),
        "concentration": P.concentration_figure(att, facts, 0),
        "heads": P.head_importance_figure(att, facts, 0),
    }
    for kind, fig in figures.items():
        assert _clipped_texts(fig) == [], kind


def test_heatmaps_of_a_layer_share_one_colour_scale(tmp_path):
    cache = small_cache()
    cache.layers[0].values.mul_(0.01)  # a layer of small values (as layer 0 often is) keeps a scale of its own, not black
    specs = P.plan_plots([0, 1], [0, 1], ("heatmap",))
    files = P.write_plot_set(cache, specs, tmp_path / "p")
    tops = {(f["layer"], f["part"], f["summary"]["vmax"]) for f in files}
    want = {(l, p): max(float(P.head_rows(getattr(cache.layers[l], p), None)[h].float().abs().max()) for h in (0, 1))
            for l in (0, 1) for p in ("keys", "values")}
    assert tops == {(l, p, v) for (l, p), v in want.items()}
    assert want[(0, "values")] < 0.1 * want[(1, "values")]
    index = P.write_index(tmp_path / "p", files, cache.facts, Path("c.safetensors"), "png")
    text = index.read_text()
    assert '<nav><h2 id="contents">Contents</h2>' in text and text.count('<p class="reading">') == 1
    assert f"0 to {want[(0, 'keys')]:.3g}" in text and '<h3 id="heatmap-L1">' in text
