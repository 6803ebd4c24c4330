"""The one progress style: plain lines with done/total, rate and time left; callbacks; sinks chosen
from what a caller asks; progress inside a model's forward passes."""

from __future__ import annotations

import io
import re
import time

import torch

from kvtool.core.progress import SILENT, CallbackProgress, LineProgress, StageClock, make_sink


def test_line_has_done_total_rate_and_time_left(monkeypatch):
    clock = StageClock()
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    clock.start = clock.stage_start = 100.0
    clock.begin("dense pass", 10)
    assert clock.line("verify") == "kvtool verify: dense pass 0/10 (0%), 0 s"
    now[0] = 104.0
    clock.done = 2
    line = clock.line("verify")
    # 2 units in 4 s: 0.5/s is "2 s each", 8 units left: about 16 s
    assert line == "kvtool verify: dense pass 2/10 (20%), 4 s, 2 s each, about 16 s left", line
    clock.done = 10
    assert "left" not in clock.line("verify")


def test_line_progress_writes_a_line_per_stage_and_a_last_line():
    stream = io.StringIO()
    sink = LineProgress("stats", stream=stream, heartbeat=100)
    sink.stage("layers", 2)
    sink.advance()
    sink.advance()
    sink.note("something finished")
    sink.close()
    lines = stream.getvalue().splitlines()
    assert re.fullmatch(r"kvtool stats: layers 0/2 \(0%\), \d+ s", lines[0])
    assert lines[1] == "kvtool stats: something finished" and lines[-1].startswith("kvtool stats: done in")


def test_callback_and_sink_choice():
    events = []
    sink = make_sink(lambda *e: events.append(e), "x")
    assert isinstance(sink, CallbackProgress)
    sink.stage("a", 2)
    sink.advance()
    sink.advance()
    assert events == [("a", 0, 2), ("a", 1, 2), ("a", 2, 2)]
    assert make_sink(False, "x") is SILENT and make_sink(None, "x") is SILENT
    assert isinstance(make_sink("auto", "x"), LineProgress)  # stderr is not a terminal under pytest


def test_layer_calls_count_every_attention_layer_of_every_forward():
    from tests.conftest import make_tiny_llama

    from kvtool.hf.passes import layer_calls

    model = make_tiny_llama(num_layers=3)
    events = []
    with layer_calls(model, CallbackProgress(lambda *e: events.append(e)), "pass", forwards=2), torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
        model(input_ids=torch.tensor([[4, 5]]))
    assert events[0] == ("pass, layer calls", 0, 6) and events[-1] == ("pass, layer calls", 6, 6)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1]]))  # the hooks are gone after the block
    assert len(events) == 7
