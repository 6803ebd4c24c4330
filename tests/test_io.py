"""Capture files: round trip, validation of every bad file, atomic writes."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

import kvtool
from kvtool.core import io
from kvtool.core.errors import BadDataError, OutputExistsError, UsageError

from .conftest import synthetic_cache


def test_round_trip_exact(tmp_path):
    cache = synthetic_cache()
    path = kvtool.save(cache, tmp_path / "c.safetensors")
    back = kvtool.load(path)
    assert back.facts == cache.facts
    assert back.layer_indices == [0, 1]
    for i in (0, 1):
        for part in ("keys", "values", "queries"):
            assert torch.equal(getattr(back.layers[i], part), getattr(cache.layers[i], part))
    assert torch.equal(back.token_ids, cache.token_ids)
    assert back.info == cache.info


def test_load_subset_of_layers_and_parts(tmp_path):
    path = kvtool.save(synthetic_cache(), tmp_path / "c.safetensors")
    back = kvtool.load(path, layers=[1], parts=("keys", "values"))
    assert back.layer_indices == [1] and back.layers[1].queries is None
    with pytest.raises(UsageError, match="layer 5 is not in"):
        kvtool.load(path, layers=[5])


def test_no_silent_overwrite(tmp_path):
    path = kvtool.save(synthetic_cache(), tmp_path / "c.safetensors")
    before = path.read_bytes()
    with pytest.raises(OutputExistsError):
        kvtool.save(synthetic_cache(seed=1), path)
    assert path.read_bytes() == before
    kvtool.save(synthetic_cache(seed=1), path, force=True)
    assert path.read_bytes() != before


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "x.bin"
    with pytest.raises(RuntimeError):
        with io.atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_inconsistent_cache(tmp_path):
    cache = synthetic_cache()
    cache.layers[0].keys = cache.layers[0].keys[:, :, :10]
    with pytest.raises(BadDataError, match="layers.0.keys has shape"):
        kvtool.save(cache, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


def _write_raw(path, tensors, meta):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)


def _good_parts(tmp_path):
    cache = synthetic_cache()
    return io.capture_tensors(cache), io.capture_metadata(cache)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t, m: m.pop("kvtool.schema"), "not a kvtool file"),
        (lambda t, m: m.__setitem__("kvtool.schema_version", "99"), "schema version"),
        (lambda t, m: m.__setitem__("kvtool.model", "{not json"), "not valid JSON"),
        (lambda t, m: m.__setitem__("kvtool.model", json.dumps({"name": "x"})), "lacks"),
        (lambda t, m: t.__setitem__("layers.0.keys", t["layers.0.keys"][:, :, :5]), "has shape"),
        (lambda t, m: t.__setitem__("layers.0.values", t["layers.0.values"].float()), "metadata says float16"),
        (lambda t, m: t.pop("layers.1.values"), "is missing"),
        (lambda t, m: t.__setitem__("layers.7.keys", t["layers.0.keys"].clone()), "unexpected tensor"),
        (lambda t, m: t.pop("token_ids"), "token_ids"),
        (lambda t, m: m.__setitem__("kvtool.layers", json.dumps([0, 1, 2])), "more layers than the model.s 2"),
        (lambda t, m: m.__setitem__("kvtool.layers", json.dumps([1, 1])), "lists layer 1 twice"),
    ],
)
def test_loader_rejects_bad_files(tmp_path, mutate, message):
    tensors, meta = _good_parts(tmp_path)
    mutate(tensors, meta)
    path = tmp_path / "bad.safetensors"
    _write_raw(path, tensors, meta)
    with pytest.raises(BadDataError, match=message) as err:
        kvtool.load(path)
    assert str(path) in str(err.value)


def test_loader_rejects_truncated_and_foreign_files(tmp_path):
    good = kvtool.save(synthetic_cache(), tmp_path / "good.safetensors")
    data = good.read_bytes()
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(data[: len(data) - 100])
    with pytest.raises(BadDataError, match="truncated"):
        kvtool.load(trunc)
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a tensor file at all")
    with pytest.raises(BadDataError, match="not a safetensors file"):
        kvtool.load(text)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 10) + b"\xff" * 10)
    with pytest.raises(BadDataError, match="not a safetensors file"):
        kvtool.load(garbage)
    with pytest.raises(BadDataError, match="no such file"):
        kvtool.load(tmp_path / "missing.safetensors")
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(BadDataError, match="not a kvtool file"):
        kvtool.load(plain)


def test_load_never_modifies_input(tmp_path):
    path = kvtool.save(synthetic_cache(), tmp_path / "c.safetensors")
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    cache = kvtool.load(path)
    cache.layers[0].keys.zero_() if cache.layers[0].keys.is_contiguous() else None
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


def test_parse_indices():
    from kvtool.core.cache import format_indices, parse_indices

    assert parse_indices("0,5,10-12", 30) == [0, 5, 10, 11, 12]
    with pytest.raises(UsageError, match="negative"):
        parse_indices("-1", 30)
    assert format_indices([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(UsageError, match="out of range"):
        parse_indices("30", 30)
    with pytest.raises(UsageError, match="not a number"):
        parse_indices("a-b", 30)
