"""Trust: files never run code, never destroy inputs, and corrupted payloads are caught (issue 18)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import kvtool
from kvtool.cli import app
from kvtool.core import io
from tests.conftest import synthetic_cache

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def run_kvtool(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kvtool", *args], input=stdin, capture_output=True, text=True, env=env, timeout=300)


def custom_code_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A model folder whose config names its own Python (auto_map); importing it writes ``marker``."""
    folder = tmp_path / "evil-model"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import LlamaConfig, LlamaForCausalLM\n"
    code += "class EvilConfig(LlamaConfig):\n    model_type = 'evilllama'\n"
    code += "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    (folder / "evil.py").write_text(code)
    cfg = {"model_type": "evilllama", "architectures": ["EvilModel"],
           "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
           "vocab_size": 258, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, marker


def test_capture_naming_custom_code_model_never_runs_it(tmp_path):
    folder, marker = custom_code_folder(tmp_path)
    cache = synthetic_cache(layers=(0, 1))
    cache.facts = type(cache.facts)(**{**cache.facts.to_dict(), "name": str(folder), "source": "hf-folder"})
    cap = tmp_path / "evil.safetensors"
    io.save(cache, cap)
    res = run_kvtool("generate", str(cap), "-n", "1", stdin="y\ny\n")
    assert not marker.exists(), "the folder's code ran"
    assert res.returncode == 1, res.stderr
    assert f"loading model {folder}" in res.stderr
    assert "Traceback" not in res.stderr
    # the library entry point, asked directly, refuses the same way
    res = subprocess.run([sys.executable, "-c", f"from kvtool.hf import models; models.load({str(folder)!r})"],
                         input="y\ny\n", capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert not marker.exists()
    assert "BadDataError" in res.stderr


def test_model_path_from_metadata_must_be_plain_local_folder(tmp_path):
    from kvtool.core.errors import UsageError
    from kvtool.hf.cache import model_spec

    folder, _ = custom_code_folder(tmp_path)
    link = tmp_path / "link-model"
    link.symlink_to(folder)
    cache = synthetic_cache(layers=(0,))
    for name, ok in ((str(folder), True), (str(link), False), (str(tmp_path / "nope"), False), ("/dev/null", False)):
        cache.facts = type(cache.facts)(**{**cache.facts.to_dict(), "name": name, "source": "hf-folder"})
        if ok:
            assert model_spec(cache, tmp_path / "x") == name
        else:
            with pytest.raises(UsageError):
                model_spec(cache, tmp_path / "x")


# ----------------------------------------------------------------------------- inputs are never outputs


@pytest.fixture()
def capture_and_compressed(tmp_path):
    cap = tmp_path / "cap.safetensors"
    io.save(synthetic_cache(tokens=96), cap)
    comp = tmp_path / "cap.bitmap.safetensors"
    assert runner.invoke(app, ["compress", str(cap), "--format", "bitmap", "--heldout", "16", "-o", str(comp)]).exit_code == 0
    return cap, comp


def _commands(cap: Path, comp: Path, out: Path) -> list[list[str]]:
    return [
        ["compress", str(cap), "--format", "bitmap", "--heldout", "16", "-o", str(out), "--force"],
        ["prune", str(cap), "--sparsity", "0.5", "-o", str(out), "--force"],
        ["decompress", str(comp), "-o", str(out), "--force"],
        ["export", str(comp), "--to", "paged", "-o", str(out), "--force"],
    ]


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_output_that_is_an_input_is_refused_even_with_force(tmp_path, capture_and_compressed, how):
    cap, comp = capture_and_compressed
    for args in _commands(cap, comp, tmp_path / "placeholder"):
        source = Path(args[1])
        before = source.read_bytes()
        out = source if how == "same" else tmp_path / f"alias-{how}"
        if how == "symlink":
            out.symlink_to(source)
        elif how == "hardlink":
            os.link(source, out)
        args = [a if a != str(tmp_path / "placeholder") else str(out) for a in args]
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "is the input" in res.output
        assert source.read_bytes() == before, args
        if how != "same":
            out.unlink()


def test_library_functions_refuse_their_input(capture_and_compressed):
    from kvtool.core.errors import UsageError
    from kvtool.formats.files import compress_file, decompress_file
    from kvtool.methods.prune import prune_file

    cap, comp = capture_and_compressed
    with pytest.raises(UsageError):
        compress_file(cap, "bitmap", output=cap, heldout=16, force=True)
    with pytest.raises(UsageError):
        decompress_file(comp, comp, force=True)
    with pytest.raises(UsageError):
        prune_file(cap, output=cap, sparsity=0.5, force=True)


def test_non_regular_destination_is_refused(tmp_path, capture_and_compressed):
    cap, comp = capture_and_compressed
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for args in _commands(cap, comp, fifo):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "not a regular file" in res.output
        assert fifo.is_fifo()
    res = runner.invoke(app, ["decompress", str(comp), "-o", "/dev/null", "--force"])
    assert res.exit_code == 2


# ----------------------------------------------------------------------------- integrity


def flip_bit(path: Path, name: str, bit: int = 0) -> None:
    """Flip one bit of tensor ``name``'s payload (``bit`` counts from its first byte)."""
    meta, _ = io.read_header(path)
    n = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + n])
    start = 8 + n + header[name]["data_offsets"][0]
    data = bytearray(path.read_bytes())
    data[start + bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))


def test_every_written_file_carries_checksums(capture_and_compressed, tmp_path):
    cap, comp = capture_and_compressed
    paged = tmp_path / "p.safetensors"
    assert runner.invoke(app, ["export", str(comp), "--to", "paged", "-o", str(paged)]).exit_code == 0
    for path in (cap, comp, paged):
        meta, entries = io.read_header(path)
        table = json.loads(meta[io.CHECKSUM_KEY])
        assert table["algorithm"] == "crc32" and set(table["tensors"]) == set(entries)


def test_flipped_bit_in_any_payload_is_caught_naming_the_tensor(capture_and_compressed, tmp_path):
    cap, comp = capture_and_compressed
    _, entries = io.read_header(comp)
    for name in sorted(entries):
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(comp.read_bytes())
        flip_bit(bad, name, bit=3)
        for args in (["decompress", str(bad), "-o", str(tmp_path / "o.safetensors"), "--force"],
                     ["export", str(bad), "--to", "paged", "-o", str(tmp_path / "o.safetensors"), "--force"],
                     ["verify", str(bad), "--capture", str(cap), "--no-model"],
                     ["info", str(bad)]):
            res = runner.invoke(app, args)
            assert res.exit_code == 1, (name, args, res.output)
            assert f"'{name}' fails its checksum" in res.output, (name, args, res.output)
            assert "Traceback" not in res.output
    bad = tmp_path / "badcap.safetensors"
    bad.write_bytes(cap.read_bytes())
    flip_bit(bad, "layers.1.values", bit=77)
    for args in (["info", str(bad)], ["compress", str(bad), "--format", "quant", "-o", str(tmp_path / "q.safetensors"), "--force"], ["stats", str(bad)]):
        res = runner.invoke(app, args)
        assert res.exit_code == 1 and "'layers.1.values' fails its checksum" in res.output, (args, res.output)


def test_no_verify_checksums_and_old_files(capture_and_compressed, tmp_path):
    cap, comp = capture_and_compressed
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(cap.read_bytes())
    flip_bit(bad, "layers.0.keys", bit=1)  # a low mantissa bit: still a valid capture, just wrong
    assert runner.invoke(app, ["info", str(bad)]).exit_code == 1
    assert runner.invoke(app, ["--no-verify-checksums", "info", str(bad)]).exit_code == 0
    # files from before checksums (no kvtool.checksums key) still load
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(cap), "pt") as fh:
        meta = {k: v for k, v in fh.metadata().items() if k != io.CHECKSUM_KEY}
        tensors = {n: fh.get_tensor(n) for n in fh.keys()}
    old = tmp_path / "old.safetensors"
    save_file(tensors, str(old), metadata=meta)
    assert runner.invoke(app, ["info", str(old)]).exit_code == 0
    assert io.load(old).num_tokens == 96


def test_flipped_metadata_is_caught(capture_and_compressed, tmp_path):
    _, comp = capture_and_compressed
    data = comp.read_bytes()
    old = b'prefix_tokens\\": 80'
    at = data.index(old)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[:at] + old.replace(b"80", b"81") + data[at + len(old):])
    res = runner.invoke(app, ["info", str(bad)])
    assert res.exit_code == 1 and "metadata fails its checksum" in res.output


def test_bitmap_popcount_change_hidden_by_padding_is_caught(tmp_path):
    """One bitmap bit flipped with the file's checksums recomputed: the per-element check sees it."""
    from kvtool.core.errors import BadDataError
    from kvtool.formats.base import load_compressed

    cap = tmp_path / "cap.safetensors"
    io.save(synthetic_cache(tokens=150, head_dim=64), cap)
    comp = tmp_path / "c.safetensors"
    assert runner.invoke(app, ["compress", str(cap), "--format", "bitmap", "--heldout", "16", "-o", str(comp)]).exit_code == 0
    meta, _ = io.read_header(comp)
    tensors = io.read_tensors(comp)
    bm = tensors["layers.0.keys.bitmaps"]
    caught = 0
    for word in range(0, 64, 7):
        t = dict(tensors)
        flat = bm.clone().reshape(-1)
        flat[word] ^= 1 << 5
        t["layers.0.keys.bitmaps"] = flat.reshape(bm.shape)
        out = tmp_path / f"flip{word}.safetensors"
        io.write_safetensors(out, t, {k: v for k, v in meta.items() if k != io.CHECKSUM_KEY})
        with pytest.raises(BadDataError, match="keys"):
            load_compressed(out)
        caught += 1
    assert caught == 10


def test_quant_negative_scale_is_refused(tmp_path):
    from kvtool.core.errors import BadDataError
    from kvtool.formats.base import load_compressed

    cap = tmp_path / "cap.safetensors"
    io.save(synthetic_cache(tokens=96), cap)
    comp = tmp_path / "q.safetensors"
    assert runner.invoke(app, ["compress", str(cap), "--format", "quant", "--heldout", "16", "-o", str(comp)]).exit_code == 0
    meta, _ = io.read_header(comp)
    tensors = io.read_tensors(comp)
    tensors["layers.0.scales.keys"] = -tensors["layers.0.scales.keys"].abs() - 0.5
    io.write_safetensors(comp, tensors, {k: v for k, v in meta.items() if k != io.CHECKSUM_KEY}, force=True)
    with pytest.raises(BadDataError, match="negative scales"):
        load_compressed(comp)


# ----------------------------------------------------------------------------- finite data


@pytest.mark.parametrize("fmt", ["bitmap", "quant", "signvq", "pagestat"])
def test_nonfinite_capture_is_refused_unless_allowed(tmp_path, fmt):
    cache = synthetic_cache(tokens=96, head_dim=16)
    cache.layers[1].keys[0, 0, 5, :3] = float("nan")
    cache.layers[1].keys[0, 1, 7, 0] = float("inf")
    cap = tmp_path / "nan.safetensors"
    io.save(cache, cap)
    out = tmp_path / "out.safetensors"
    res = runner.invoke(app, ["compress", str(cap), "--format", fmt, "--heldout", "16", "-o", str(out)])
    assert res.exit_code == 1, res.output
    assert "'layers.1.keys' holds 4 NaN or infinite values" in res.output
    assert not out.exists()
    assert runner.invoke(app, ["info", str(cap)]).exit_code == 1
    assert runner.invoke(app, ["--allow-nonfinite", "info", str(cap)]).exit_code == 0
    assert io.load(cap, allow_nonfinite=True).num_tokens == 96


def test_nonfinite_compressed_file_is_refused(capture_and_compressed, tmp_path):
    cap, comp = capture_and_compressed
    meta, _ = io.read_header(comp)
    tensors = io.read_tensors(comp)
    tensors["tails.0.values"][0, 0, 0, 0] = float("nan")
    io.write_safetensors(comp, tensors, {k: v for k, v in meta.items() if k != io.CHECKSUM_KEY}, force=True)
    res = runner.invoke(app, ["verify", str(comp), "--capture", str(cap), "--no-model"])
    assert res.exit_code == 1 and "'tails.0.values' holds 1 NaN" in res.output, res.output


# ----------------------------------------------------------------------------- bounded work


def test_source_path_naming_a_device_is_not_read(capture_and_compressed, tmp_path):
    cap, comp = capture_and_compressed
    meta, _ = io.read_header(comp)
    tensors = io.read_tensors(comp)
    info = json.loads(meta["kvtool.info"])
    info["source_path"] = "/dev/zero"
    meta = {**meta, "kvtool.info": json.dumps(info)}
    meta.pop(io.CHECKSUM_KEY)
    io.write_safetensors(comp, tensors, meta, force=True)
    res = run_kvtool("verify", str(comp), "--no-model")  # a subprocess: a hang would time out
    assert res.returncode == 1 and "--capture" in res.stderr, res.stderr
    res = runner.invoke(app, ["verify", str(comp), "--capture", "/dev/zero", "--no-model"])
    assert res.exit_code == 1 and "not a regular file" in res.output, res.output


def test_snapstream_budget_above_tokens_is_clamped(tmp_path):
    cap = tmp_path / "cap.safetensors"
    io.save(synthetic_cache(tokens=96), cap)
    out = tmp_path / "s.safetensors"
    res = runner.invoke(app, ["compress", str(cap), "--format", "snapstream", "--budget", "100000", "--heldout", "16", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    details = json.loads(res.stdout)["details"]
    assert details["budget"] == 80 and details["budget_clamped_from"] == 100000
    assert out.stat().st_size < 2 * cap.stat().st_size
    assert runner.invoke(app, ["verify", str(out), "--capture", str(cap), "--no-model"]).exit_code == 0


# ----------------------------------------------------------------------------- bad data, one line


PY_ERRORS = ("Traceback", "TypeError", "AttributeError", "RecursionError", "KeyError", "ValueError", "IndexError", "RuntimeError")


def assert_one_line(res, code: int) -> None:
    assert res.exit_code == code, res.output
    lines = [l for l in res.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert not any(e in res.output for e in PY_ERRORS), res.output


def rewrite(src: Path, dst: Path, meta_edit=None, tensor_edit=None) -> Path:
    meta, _ = io.read_header(src)
    meta = {k: v for k, v in meta.items() if k != io.CHECKSUM_KEY}
    tensors = io.read_tensors(src)
    if meta_edit:
        meta_edit(meta)
    if tensor_edit:
        tensor_edit(tensors)
    io.write_safetensors(dst, tensors, meta, force=True)
    return dst


def raw_header_edit(src: Path, dst: Path, edit) -> Path:
    data = src.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    dst.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    return dst


def test_wrong_typed_metadata_is_one_line(capture_and_compressed, tmp_path):
    cap, comp = capture_and_compressed
    cases = {
        "model-string": lambda m: m.__setitem__("kvtool.model", json.dumps("llama")),
        "model-list": lambda m: m.__setitem__("kvtool.model", json.dumps([1, 2])),
        "heads-string": lambda m: m.__setitem__("kvtool.model", json.dumps({**json.loads(m["kvtool.model"]), "num_heads": "4"})),
        "deep-info": lambda m: m.__setitem__("kvtool.info", "[" * 100_000 + "]" * 100_000),
        "layers-string": lambda m: m.__setitem__("kvtool.layers", json.dumps("0,1")),
    }
    for label, edit in cases.items():
        for src in (cap, comp):
            bad = rewrite(src, tmp_path / f"{label}.safetensors", meta_edit=edit)
            for args in (["info", str(bad)], ["decompress", str(bad), "-o", str(tmp_path / "o.safetensors"), "--force"] if src == comp else ["stats", str(bad)]):
                assert_one_line(runner.invoke(app, args), 1)
    deep = tmp_path / "deep.safetensors"
    body = b"[" * 100_000 + b"]" * 100_000
    deep.write_bytes(len(body).to_bytes(8, "little") + body)
    assert_one_line(runner.invoke(app, ["-q", "info", str(deep)]), 1)


def test_inconsistent_compressed_files_are_one_line(capture_and_compressed, tmp_path):
    cap, comp = capture_and_compressed

    def info_edit(key, value):
        def edit(m):
            info = json.loads(m["kvtool.info"])
            info[key] = value
            m["kvtool.info"] = json.dumps(info)
        return edit

    bad = [
        rewrite(comp, tmp_path / "prefix.safetensors", meta_edit=info_edit("prefix_tokens", 70)),
        rewrite(comp, tmp_path / "heldout.safetensors", meta_edit=info_edit("heldout", "16")),
        rewrite(comp, tmp_path / "tail.safetensors", tensor_edit=lambda t: t.__setitem__("tails.0.keys", t["tails.0.keys"][:, :, :5].contiguous())),
        rewrite(comp, tmp_path / "notail.safetensors", tensor_edit=lambda t: t.pop("tails.1.values")),
        rewrite(comp, tmp_path / "lmeta.safetensors", meta_edit=lambda m: m.__setitem__("kvtool.layer_meta", json.dumps({"0": "x", "1": []}))),
    ]
    for path in bad:
        for args in (["info", str(path)], ["verify", str(path), "--capture", str(cap), "--no-model"]):
            assert_one_line(runner.invoke(app, args), 1)


def test_bad_captures_are_one_line(tmp_path):
    cap = tmp_path / "cap.safetensors"
    io.save(synthetic_cache(tokens=32), cap)
    int8 = rewrite(cap, tmp_path / "int8.safetensors", tensor_edit=lambda t: t.__setitem__("layers.0.keys", t["layers.0.keys"].to(torch.int8)))
    novalues = rewrite(cap, tmp_path / "nov.safetensors", tensor_edit=lambda t: t.pop("layers.1.values"))

    def empty(t):
        for name in list(t):
            t[name] = t[name][..., :0, :].contiguous() if name.startswith("layers.") else t[name][:, :0].contiguous()

    zero = rewrite(cap, tmp_path / "zero.safetensors", tensor_edit=empty)
    huge = raw_header_edit(cap, tmp_path / "huge.safetensors", lambda h: h["layers.0.keys"].__setitem__("shape", [1, 2, 1 << 40, 16]))
    for path in (int8, novalues, zero, huge):
        for cmd in ("info", "stats"):
            assert_one_line(runner.invoke(app, ["-q", cmd, str(path)]), 1)
    assert_one_line(runner.invoke(app, ["-q", "stats", str(cap), "--layers", "-1"]), 2)
    assert_one_line(runner.invoke(app, ["-q", "compress", str(cap), "--format", "bitmap", "--layers", "-1", "-o", str(tmp_path / "x.safetensors")]), 2)


# ----------------------------------------------------------------------------- clean up


def test_sigterm_mid_write_leaves_no_temp_file(tmp_path):
    import signal
    import time

    dest = tmp_path / "out.safetensors"
    script = (
        "import sys, time\nfrom kvtool.core import io\n"
        f"with io.atomic_path({str(dest)!r}) as tmp:\n"
        "    tmp.write_bytes(b'x' * 1000)\n    print('writing', flush=True)\n    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline().strip() == "writing"
    assert list(tmp_path.glob(".out.safetensors.*.tmp"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert not list(tmp_path.glob(".out.safetensors.*.tmp"))
    assert not dest.exists()


def test_stale_temp_files_are_removed_on_the_next_write(tmp_path):
    import time

    dest = tmp_path / "out.safetensors"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    stale_pid = tmp_path / f".out.safetensors.{dead}.abc123.tmp"
    stale_old = tmp_path / ".out.safetensors.k2j3h4.tmp"
    live = tmp_path / f".out.safetensors.{os.getppid()}.zzz999.tmp"  # a writer that is still running
    other = tmp_path / ".other.safetensors.k2j3h4.tmp"
    for p in (stale_pid, stale_old, live, other):
        p.write_bytes(b"junk")
    past = time.time() - 3600
    for p in (stale_old, other):
        os.utime(p, (past, past))
    io.atomic_write_bytes(dest, b"data")
    assert dest.read_bytes() == b"data"
    assert not stale_pid.exists() and not stale_old.exists()
    assert live.exists() and other.exists()


def test_full_disk_error_names_the_path(tmp_path, monkeypatch):
    import errno

    from kvtool.core.errors import BadDataError

    dest = tmp_path / "out.safetensors"

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(BadDataError, match=f"cannot write {dest}: No space left on device"):
        io.atomic_write_bytes(dest, b"data")
    monkeypatch.undo()
    assert not list(tmp_path.glob(".out.safetensors.*.tmp"))


# ----------------------------------------------------------------------------- memory


def _spy_reads(monkeypatch):
    """Record every tensor name read in full (read_tensors) and every tail read (read_tail)."""
    full: list[list[str]] = []
    tails: list[str] = []
    real_full, real_tail = io.read_tensors, io.read_tail

    def spy_full(path, names=None, **kw):
        out = real_full(path, names, **kw)
        full.append(sorted(out))
        return out

    def spy_tail(path, name, tokens, axis=2, **kw):
        tails.append(name)
        return real_tail(path, name, tokens, axis, **kw)

    monkeypatch.setattr(io, "read_tensors", spy_full)
    monkeypatch.setattr(io, "read_tail", spy_tail)
    return full, tails


def test_compress_reads_only_what_the_format_uses_one_layer_at_a_time(tmp_path, monkeypatch):
    cache = synthetic_cache(tokens=96, layers=(0, 1, 2))
    cache.layers[0].hidden = torch.zeros(1, 96, 64, dtype=torch.float16)
    cache.layers[1].hidden = torch.zeros(1, 96, 64, dtype=torch.float16)
    cache.layers[2].hidden = torch.zeros(1, 96, 64, dtype=torch.float16)
    cap = tmp_path / "cap.safetensors"
    io.save(cache, cap)
    full, _ = _spy_reads(monkeypatch)
    for fmt in ("bitmap", "quant"):
        full.clear()
        res = runner.invoke(app, ["compress", str(cap), "--format", fmt, "--heldout", "16", "-o", str(tmp_path / f"{fmt}.safetensors")])
        assert res.exit_code == 0, res.output
        # the capture opened once (token ids), then each layer's keys and values alone
        assert [names for names in full if "token_ids" in names] == [["token_ids"]]
        capture_reads = [names for names in full if any(n.startswith("layers.") for n in names)]
        assert len(capture_reads) == 3
        for names in capture_reads:
            layer_names = [n for n in names if n.startswith("layers.")]
            assert len({n.split(".")[1] for n in layer_names}) == 1  # one layer per read
            assert not any(n.endswith((".queries", ".hidden")) for n in layer_names)


def test_verify_reads_only_the_scored_queries(capture_and_compressed, monkeypatch):
    cap, comp = capture_and_compressed
    full, tails = _spy_reads(monkeypatch)
    res = runner.invoke(app, ["verify", str(comp), "--capture", str(cap), "--no-model", "--heldout", "8", "--json"])
    assert res.exit_code == 0, res.output
    assert not any(n.endswith((".queries", ".hidden")) for names in full for n in names)
    assert sorted(tails) == ["layers.0.queries", "layers.1.queries"]
    assert json.loads(res.stdout)["attention"]["heldout"] == 8
