"""The driver's progress display (a tqdm bar on terminals and notebooks, plain epoch lines elsewhere) and rank 0's
throttled batch reports that feed it."""

from __future__ import annotations

import io
import re
import sys

import cloudpickle
import pytest

from spark_hvd.runner import Event, ProgressDisplay, StepReporter, run

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _epoch(epoch: int, steps: int, losses: list[float]) -> list[Event]:
    events = [Event(0, epoch, s + 1, {"steps": steps, "epochs": 3, "loss": loss}) for s, loss in enumerate(losses)]
    events.append(Event(0, epoch, None, {"loss": sum(losses) / len(losses), "val_loss": 0.25}))
    return events


def _shown(display: ProgressDisplay, events: list[Event]) -> str:
    for event in events:
        display.show(event)
    display.close()
    return display.stream.getvalue()


def test_bar_shows_epoch_batches_loss_and_eta():
    out = _shown(ProgressDisplay(1, io.StringIO(), interactive=True),
                 _epoch(0, 4, [0.9, 0.8, 0.7, 0.6]) + [Event(1, 0, 2, {"steps": 4, "loss": 5.0})]
                 + _epoch(1, 4, [0.5, 0.4]))
    assert "epoch 1/3" in out and "epoch 2/3" in out
    assert "4/4" in out and "2/4" in out          # batches done of the epoch
    assert "loss=0.6" in out and "loss=0.4" in out  # the last loss
    assert re.search(r"<\d\d:\d\d", out)            # tqdm's ETA
    assert "val_loss=0.25" in out                   # the epoch's averaged metrics on its last line
    assert "loss=5" not in out                      # only rank 0 drives the bar


def test_plain_lines_when_not_interactive_and_nothing_with_verbose_0():
    events = _epoch(0, 2, [0.9, 0.7]) + _epoch(1, 2, [0.5, 0.3])
    out = _shown(ProgressDisplay(1, io.StringIO(), interactive=False), events)
    assert out.splitlines() == ["[spark_hvd] rank 0 epoch 1/3: loss=0.8, val_loss=0.25",  # 1-based on screen
                                "[spark_hvd] rank 0 epoch 2/3: loss=0.4, val_loss=0.25"]
    assert _shown(ProgressDisplay(0, io.StringIO(), interactive=True), events) == ""
    every = _shown(ProgressDisplay(2, io.StringIO(), interactive=False), events).splitlines()
    assert len(every) == len(events) and every[0] == "[spark_hvd] rank 0 epoch 1/3 step 1: loss=0.9"


def test_epoch_summary_shows_every_metric_within_80_columns_and_a_sane_first_rate():
    metrics = {"loss": 0.11234, "accuracy": 0.97221, "val_loss": 0.13456, "val_accuracy": 0.96012,
               "top5_accuracy": 0.99901, "val_top5_accuracy": 0.99812, "lr": 0.001}
    events = [Event(0, 4, 1, {"steps": 2000, "epochs": 10, "loss": 0.2}),  # the bar opens at a report of step 1
              Event(0, 4, 2000, {"steps": 2000, "epochs": 10, "loss": 0.1}), Event(0, 4, None, metrics)]
    out = _shown(ProgressDisplay(1, io.StringIO(), interactive=True), events)
    summary = out[out.rindex("epoch 5/10: loss="):].splitlines()
    assert all(len(line) <= 80 for line in summary), summary
    text = " ".join(summary)
    for name, value in metrics.items():
        assert f"{name}={value:.4g}" in text
    first = [f for f in re.split(r"[\r\n]", out) if "1/2000" in f]
    assert first and "?batch/s" in first[0], first  # no rate yet, not the 646119.94batch/s of counting 0 -> 1 at once


def test_output_lines_do_not_break_the_bar():
    display = ProgressDisplay(1, io.StringIO(), interactive=True)
    display.show(Event(0, 0, 1, {"steps": 3, "loss": 1.0}))
    display.write("[1] a line of rank 1\n")
    display.close()
    assert "[1] a line of rank 1\n" in display.stream.getvalue()


def _steps(steps: int) -> None:
    import spark_hvd.core as hvd

    reporter = StepReporter(steps, epochs=1, interval_s=3600.0)  # only the first and the last batch get through
    if hvd.rank() == 0:
        for step in range(1, steps + 1):
            reporter(0, step, loss=float(step))


@pytest.mark.spark
def test_rank_0_batch_reports_are_throttled_and_reach_the_driver(spark):
    seen: list[Event] = []
    run(_steps, args=(50,), num_proc=2, on_event=seen.append, verbose=0)
    assert [(e.rank, e.epoch, e.step, e.metrics) for e in seen] == [
        (0, 0, 1, {"steps": 50, "epochs": 1, "loss": 1.0}), (0, 0, 50, {"steps": 50, "epochs": 1, "loss": 50.0})]


def test_a_bar_that_cannot_be_drawn_falls_back_to_lines(monkeypatch):
    from spark_hvd.runner import progress

    def no_widget(*_args, **_kwargs):
        raise ImportError("IProgress not found. Please update jupyter and ipywidgets.")

    # whichever bar class is chosen (the choice depends on what this process imported before), it cannot draw
    monkeypatch.setattr(progress, "_tqdm_class", lambda: no_widget)
    out = _shown(ProgressDisplay(1, io.StringIO(), interactive=True), _epoch(0, 2, [0.9, 0.7]))
    assert out.splitlines() == ["[spark_hvd] rank 0 epoch 1/3: loss=0.8, val_loss=0.25"]


def test_a_notebook_without_ipywidgets_gets_the_text_bar(monkeypatch):
    """tqdm.auto would warn (TqdmWarning: IProgress not found) and draw nothing; the text bar is used instead."""
    import importlib.util

    from spark_hvd.runner import progress

    monkeypatch.setitem(sys.modules, "ipykernel", sys)  # a notebook kernel is loaded
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ipywidgets" else real(name, *a))
    import tqdm.std

    assert progress._tqdm_class() is tqdm.std.tqdm
