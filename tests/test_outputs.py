"""Outputs: checksummed captures, one output check given every input, exclusive creates (issue 34)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.commands._common import OUTPUT_PARAMS
from kvtool.core import io, outputs
from kvtool.core.errors import OutputExistsError, UsageError
from kvtool.core.sample import SAMPLE_PATH
from tests.conftest import synthetic_cache
from tests.test_trust import flip_bit

runner = CliRunner()


def one_line(res, code: int, *needles: str) -> None:
    """Exit ``code`` with one ``error:`` line, the last one (report prints its stages before it)."""
    assert res.exit_code == code, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], res.output
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in res.output, (needle, res.output)


# ----------------------------------------------------------------------------- captures carry checksums


@pytest.fixture(scope="module")
def streamed(tiny_llama_dir, tmp_path_factory):
    """A capture written by `kvtool capture` (the streaming writer), with generated tokens, and a
    compressed file made from it."""
    folder = tmp_path_factory.mktemp("streamed")
    cap = folder / "cap.safetensors"
    res = runner.invoke(app, ["-q", "capture", "--model", str(tiny_llama_dir), "--prompt", "The lighthouse keeper " * 4, "--generate", "3", "--hidden", "-o", str(cap)])
    assert res.exit_code == 0, res.output
    comp = folder / "cap.quant.safetensors"
    assert runner.invoke(app, ["-q", "compress", str(cap), "--format", "quant", "--heldout", "16", "-o", str(comp)]).exit_code == 0
    return cap, comp


def test_capture_command_writes_checksums_of_every_tensor(streamed):
    cap, _ = streamed
    meta, entries = io.read_header(cap)
    table = json.loads(meta[io.CHECKSUM_KEY])
    assert table["algorithm"] == "crc32" and set(table["tensors"]) == set(entries)
    assert io.verify_checksums(cap)
    tensors = io.read_tensors(cap)
    assert all(table["tensors"][n] == f"{io.tensor_crc32(t):08x}" for n, t in tensors.items())


def test_capture_with_one_flipped_payload_bit_is_refused(streamed, tmp_path):
    """The issue's case: one bit of a key flipped (an exponent bit: -0.38 becomes huge) passed info,
    compress and verify; each now refuses the file, and compress writes nothing."""
    cap, comp = streamed
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(cap.read_bytes())
    flip_bit(bad, "layers.0.keys", bit=30)  # the top exponent bit of a float32: 0.38 becomes about 1e38
    out = tmp_path / "out.safetensors"
    one_line(runner.invoke(app, ["-q", "info", str(bad)]), 1, "'layers.0.keys' fails its checksum")
    one_line(runner.invoke(app, ["-q", "compress", str(bad), "--format", "quant", "--heldout", "16", "-o", str(out)]), 1, "fails its checksum")
    assert not out.exists()
    one_line(runner.invoke(app, ["-q", "verify", str(comp), "--capture", str(bad), "--no-model"]), 1)


def test_shipped_sample_carries_checksums_and_a_flip_is_refused(tmp_path):
    meta, entries = io.read_header(SAMPLE_PATH)
    assert set(json.loads(meta[io.CHECKSUM_KEY])["tensors"]) == set(entries)
    assert io.verify_checksums(SAMPLE_PATH)
    bad = tmp_path / "sample.safetensors"
    bad.write_bytes(SAMPLE_PATH.read_bytes())
    flip_bit(bad, "layers.7.keys", bit=6 + 8 * 1000)  # float16: an exponent bit
    one_line(runner.invoke(app, ["-q", "info", str(bad)]), 1, "'layers.7.keys' fails its checksum")
    out = tmp_path / "o.safetensors"
    one_line(runner.invoke(app, ["-q", "compress", str(bad), "--format", "bitmap", "-o", str(out)]), 1, "fails its checksum")
    assert not out.exists()


# ----------------------------------------------------------------------------- output = input, for every writer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("outputs")
    cap = folder / "cap.safetensors"
    io.save(synthetic_cache(tokens=160), cap)
    bench = folder / "bench.json"
    bench.write_text(json.dumps({"subcommand": "dense", "env": {"device": "cpu", "versions": {}}, "records": []}))
    prompt = folder / "prompt.txt"
    prompt.write_text("The lighthouse keeper climbed the stairs. " * 3)
    return {"cap": cap, "bench": bench, "prompt": prompt}


def writers(files, tiny_llama_dir) -> dict[str, tuple[list[str], Path]]:
    """Each command that the issue found overwriting its input: (arguments with OUT for the output, the input)."""
    cap, bench, prompt = files["cap"], files["bench"], files["prompt"]
    return {
        "report": (["report", str(cap), "--no-model", "--heldout", "16", "--budgets", "40%", "-o", "OUT"], cap),
        "recommend": (["recommend", str(cap), "--budget", "40%", "--no-model", "--heldout", "16", "--menu", "quant", "-o", "OUT"], cap),
        "capture": (["capture", "--model", str(tiny_llama_dir), "--prompt-file", str(prompt), "-o", "OUT"], prompt),
        "bench report": (["bench", "report", str(bench), "-o", "OUT"], bench),
        "report --bench": (["report", str(cap), "--no-model", "--heldout", "16", "--budgets", "40%", "--bench", str(bench), "-o", "OUT"], bench),
        "heads": (["heads", str(cap), "--plot-output", "OUT"], cap),
        "export --to json": (["export", str(bench), "--to", "json", "-o", "OUT"], bench),
    }


@pytest.mark.parametrize("how", ["same", "symlink"])
@pytest.mark.parametrize("which", ["report", "recommend", "capture", "bench report", "report --bench", "heads", "export --to json"])
def test_output_that_is_an_input_is_refused_by_every_writer(files, tiny_llama_dir, tmp_path, which, how):
    args, source = writers(files, tiny_llama_dir)[which]
    before = source.read_bytes()
    out = source
    if how == "symlink":
        out = tmp_path / "link"
        out.symlink_to(source)
    args = [str(out) if a == "OUT" else a for a in args] + ["--force"]
    one_line(runner.invoke(app, ["-q", *args]), 2, "is the input")
    assert source.read_bytes() == before
    assert how == "same" or out.is_symlink()


def test_an_input_read_after_the_check_is_still_never_overwritten(files, tmp_path):
    """report reads --eval FOLDER/eval.json long after its options were checked; the write itself
    refuses it (the check at rename time knows every file the command read)."""
    evald = tmp_path / "ev"
    evald.mkdir()
    (evald / "eval.json").write_text(json.dumps({"schema": "kvtool.eval", "points": []}))
    before = (evald / "eval.json").read_bytes()
    res = runner.invoke(app, ["-q", "report", str(files["cap"]), "--no-model", "--heldout", "16", "--budgets", "40%", "--eval", str(evald), "-o", str(evald / "eval.json"), "--force"])
    one_line(res, 2, "is the input")
    assert (evald / "eval.json").read_bytes() == before


@pytest.mark.parametrize("args", [
    ["compress", "sample:", "--format", "quant", "-o", "sample:", "--force"],
    ["capture", "--prompt", "x", "-o", "sample:", "--force"],
    ["report", "sample:", "--no-model", "-o", "sample:", "--force"],
    ["export", "sample:", "--to", "paged", "-o", "sample:", "--force"],
])
def test_output_sample_is_refused(args):
    before = SAMPLE_PATH.stat()
    one_line(runner.invoke(app, ["-q", *args]), 2, "'sample:' names the bundled sample")
    assert SAMPLE_PATH.stat().st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize("args, name", [
    (["compress", "sample:", "--format", "quant"], "smollm2-sample.quant.safetensors"),
    (["prune", "sample:", "--sparsity", "0.5"], "smollm2-sample.pruned.safetensors"),
    (["export", "sample:", "--to", "paged"], "smollm2-sample.paged.safetensors"),
])
def test_default_outputs_of_the_sample_go_to_the_current_folder(args, name, tmp_path, monkeypatch):
    package_data = sorted(p.name for p in SAMPLE_PATH.parent.iterdir())
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["-q", *args])
    assert res.exit_code == 0, res.output
    assert (tmp_path / name).is_file()
    assert sorted(p.name for p in SAMPLE_PATH.parent.iterdir()) == package_data


def test_every_output_option_is_known_to_the_output_check():
    """Path options that name something the command writes are in OUTPUT_PARAMS (so they are never
    recorded as inputs); everything else a command takes is an input."""
    group = typer.main.get_group(app)
    ctx = click.Context(group)

    def walk(cmd: click.Command):
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                yield from walk(cmd.get_command(ctx, name))
        else:
            yield cmd

    seen = 0
    for cmd in walk(group):
        for param in cmd.params:
            writes = any(o in ("-o", "--output", "--plot-output", "--plot", "--out-dir", "--out", "--router-out") for o in param.opts)
            if writes:
                seen += 1
                assert param.name in OUTPUT_PARAMS, (cmd.name, param.name)
    assert seen >= 15


# ----------------------------------------------------------------------------- two writers, one output


def test_second_writer_fails_instead_of_replacing_the_first(tmp_path):
    dest = tmp_path / "out.bin"
    with pytest.raises(OutputExistsError, match="created by another writer"):
        with io.atomic_path(dest) as tmp:
            tmp.write_bytes(b"second")
            dest.write_bytes(b"first")  # the other writer finishes while this one runs
    assert dest.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]
    with io.atomic_path(dest, force=True) as tmp:  # --force replaces
        tmp.write_bytes(b"forced")
    assert dest.read_bytes() == b"forced"


@pytest.mark.parametrize("fallback", ["link", "check"])
def test_exclusive_create_fallbacks(tmp_path, monkeypatch, fallback):
    """Without renameat2 a hard link makes the exclusive create; without hard links too, a check just
    before the rename (a file system such as FAT)."""
    monkeypatch.setattr(outputs, "_renameat2_noreplace", lambda src, dst: False)
    if fallback == "check":
        def no_links(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(outputs.os, "link", no_links)
    dest = tmp_path / "out.bin"
    with io.atomic_path(dest) as tmp:
        tmp.write_bytes(b"one")
    assert dest.read_bytes() == b"one"
    with pytest.raises(OutputExistsError):
        with io.atomic_path(dest) as tmp:
            tmp.write_bytes(b"two")
    assert dest.read_bytes() == b"one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_two_compress_commands_to_one_output(files, tmp_path, monkeypatch):
    """The second `kvtool compress` without --force, whose output appears after its check (another
    command finished first), exits 2 and leaves the first one's file."""
    out = tmp_path / "o.safetensors"
    real = outputs.remove_stale_temps

    def first_writer_finishes(path):
        if Path(path) == out and not out.exists():
            out.write_bytes(b"the first writer's file")
        return real(path)

    monkeypatch.setattr(outputs, "remove_stale_temps", first_writer_finishes)
    res = runner.invoke(app, ["-q", "compress", str(files["cap"]), "--format", "quant", "--heldout", "16", "-o", str(out)])
    one_line(res, 2, "created by another writer")
    assert out.read_bytes() == b"the first writer's file"


def test_library_check_knows_the_inputs_of_the_running_command(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("input")
    with outputs.command_inputs():
        outputs.note_input(src)
        with pytest.raises(UsageError, match="is the input"):
            io.check_output(src, force=True)
        link = tmp_path / "hard"
        os.link(src, link)
        with pytest.raises(UsageError, match="is the input"):
            io.atomic_write_text(link, "x", force=True)
    io.atomic_write_text(src, "rewritten", force=True)  # outside that command it is just a file
    assert src.read_text() == "rewritten"
