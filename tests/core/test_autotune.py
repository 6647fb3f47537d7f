"""Autotune: the tuner's search on its own (a made-up throughput, a fake clock), then jobs with
``SPARK_HVD_AUTOTUNE=1`` whose every step is checked against numpy while the settings switch, with every rank
switching at the same fast round and rank 0 writing the log."""

from __future__ import annotations

import csv
import os

import helpers.engine_scenarios as sc
import numpy as np
import pytest
from helpers.ranks import run_ranks

import spark_hvd.core as core
from spark_hvd.core.autotune import (
    CONFIRM_SAMPLES,
    CYCLE_GRID_MS,
    FUSION_GRID,
    HALVING_DOUBLING_GRID,
    MIB,
    Point,
    Tuner,
)
from spark_hvd.core.settings import Settings

ReduceOp = core.ReduceOp
START = Point(64 * MIB, 1.0)


def _drive(tuner: Tuner, seconds_per_step, steps: int = 1000) -> int:
    """Feed ``tuner`` steps of two tensors (1000 bytes each step) taking ``seconds_per_step(point)`` under the
    setting every rank runs, switching as soon as it asks; returns the steps taken until it is done."""
    now, current = 0.0, tuner.current
    for step in range(steps):
        now += seconds_per_step(current) / 2
        tuner.observe(["a"], 500, now)
        now += seconds_per_step(current) / 2
        tuner.observe(["b"], 500, now)
        if tuner.pending is not None:
            current = tuner.pending
            tuner.applied(current, now)
        if tuner.done and tuner.pending is None:
            return step
    raise AssertionError("the tuner did not finish")


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _point(row: dict[str, str]) -> Point:
    return Point(int(float(row["tensor_fusion_threshold"]) * MIB), float(row["cycle_time_ms"]),
                 int(float(row["halving_doubling_threshold"]) * MIB))


def test_the_search_finds_the_fastest_setting_and_logs_every_sample(tmp_path):
    def seconds(point: Point) -> float:  # fastest at 2 ms and 16 MiB
        return 1e-3 * (1 + abs(np.log2(point.cycle_time_ms / 2.0)) + abs(np.log2(point.fusion_threshold / 16 / MIB)))

    log = tmp_path / "logs" / "autotune.csv"  # the folder is made
    tuner = Tuner(START, warmup_samples=2, steps_per_sample=3, log_path=str(log))
    _drive(tuner, seconds)
    assert tuner.best == Point(16 * MIB, 2.0) and tuner.current == tuner.best
    rows = _rows(log)
    assert list(rows[0]) == ["cycle_time_ms", "tensor_fusion_threshold", "halving_doubling_threshold", "score", "trial"]
    trials = [row["trial"] for row in rows]
    cycles, fusions = len(set(CYCLE_GRID_MS) | {1.0}), len(set(FUSION_GRID) | {64 * MIB})
    assert trials == ["cycle"] * cycles + ["fusion"] * (fusions - 1) + ["confirm"] * 2 * CONFIRM_SAMPLES + ["best"]
    # every score is the bytes per microsecond of its setting (no sample mixes two settings)
    for row in rows:
        assert float(row["score"]) == pytest.approx(1000 / (seconds(_point(row)) * 1e6), rel=1e-6), row
    assert _point(rows[-1]) == Point(16 * MIB, 2.0)


def test_among_three_tcp_ranks_the_halving_doubling_threshold_is_searched_too():
    def seconds(point: Point) -> float:  # fastest with halving-doubling from 1 MiB
        return 1e-3 * (2 - (point.halving_doubling_bytes == MIB) + point.cycle_time_ms / 100)

    tuner = Tuner(START, warmup_samples=1, steps_per_sample=2, tune_algorithm=True)
    _drive(tuner, seconds)
    assert tuner.best == Point(64 * MIB, 0.5, MIB) and tuner.current == tuner.best
    halvings = {p.halving_doubling_bytes for p in tuner._scores}
    assert halvings == set(HALVING_DOUBLING_GRID)


def test_a_setting_that_was_fast_only_while_searched_does_not_replace_the_starting_one():
    tuner = Tuner(START, warmup_samples=0, steps_per_sample=3)

    def seconds(point: Point) -> float:  # 10 ms looks fast during the search, then is slower than the start
        if point.cycle_time_ms == 10.0:
            return 0.5e-3 if tuner._phase != "confirm" else 2e-3
        return 1e-3

    _drive(tuner, seconds)
    assert tuner._candidate is not None and tuner._candidate.cycle_time_ms == 10.0  # it was confirmed, and lost
    assert tuner.best == START and tuner.current == START


def test_a_step_stretched_by_something_else_does_not_decide_a_sample():
    tuner = Tuner(START, warmup_samples=0, steps_per_sample=5)
    now = 0.0
    for step in range(100):  # until the first scored sample: 1 ms steps, one of them stretched to 20 ms
        now += 0.020 if step == 3 else 1e-3
        tuner.observe(["a"], 1000, now)
        if tuner.pending is not None:
            tuner.applied(tuner.pending, now)
        if tuner._scores:
            break
    assert list(tuner._scores.values()) == [[pytest.approx(1.0)]]  # 1000 bytes per ms: the median step's rate


def test_a_log_that_cannot_be_written_names_the_setting(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="SPARK_HVD_AUTOTUNE_LOG=.*cannot write the autotune log"):
        Tuner(START, log_path=str(tmp_path / "file" / "autotune.csv"))


def test_names_that_never_come_back_still_make_samples():
    tuner = Tuner(START, warmup_samples=0, steps_per_sample=1)
    for i in range(40 * 64):
        tuner.observe([f"noname.{i}"], 8, i * 1e-3)
        if tuner.pending is not None:
            tuner.applied(tuner.pending, i * 1e-3)
    assert tuner.done


def test_the_fast_round_slots_carry_a_setting_exactly():
    for point in (START, Point(0, 0.0), Point(3 * MIB + 7, 0.25, 256 * 1024), Point(1 << 40, 2.5, 1 << 40)):
        got = Point.decode(point.encode())
        assert got == Point(min(point.fusion_threshold, 2**31 - 2), point.cycle_time_ms,
                            min(point.halving_doubling_bytes, 2**31 - 2))
    assert Point.decode((0, 0, 0)) is None


def test_settings_read_horovods_names_and_reject_nonsense():
    got = Settings.from_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/x.csv",
                             "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0", "SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE": "4"})
    assert (got.autotune, got.autotune_log, got.autotune_warmup_samples, got.autotune_steps_per_sample) == (
        True, "/tmp/x.csv", 0, 4)
    assert Settings.from_env({}).autotune is False
    with pytest.raises(ValueError, match="SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE"):
        Settings.from_env({"SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE": "0"})


# ---------------------------------------------------------------------------------------------- on ranks

def _tuned_job(seed: int, shapes: list[tuple[int, ...]]) -> dict:
    """Steps of asynchronous allreduces of ``shapes`` and a blocking one of a small 'loss', each checked against
    numpy, until rank 0's tuner is done (its flag rides in the loss) and four steps more; returns the switches this
    rank made and its final settings."""
    core.init()
    try:
        n, r = core.size(), core.rank()
        engine = core.get_engine()
        after = 4
        for step in range(400):
            datas = [[sc._data(seed + 100 * step + k, q, shape, np.float32) for q in range(n)]
                     for k, shape in enumerate(shapes)]
            bufs = [d[r].copy() for d in datas]
            handles = [core.allreduce_async(buf, name=f"grad{k}", op=ReduceOp.AVERAGE) for k, buf in enumerate(bufs)]
            losses = [sc._data(seed + 100 * step + 99, q, (5,), np.float32) for q in range(n)]
            loss = losses[r].copy()
            tuner = engine._tuner
            loss[4] = float(tuner is not None and tuner.done and tuner.pending is None)
            core.allreduce(loss, name="loss", op=ReduceOp.SUM)
            for handle in handles:
                handle.wait()
            for k, buf in enumerate(bufs):
                sc._check(buf, (sum(d.astype(np.float64) for d in datas[k]) / n).astype(np.float32),
                          f"step {step} grad{k}")
            sc._check(loss[:4], sum(x[:4].astype(np.float64) for x in losses).astype(np.float32), f"step {step} loss")
            if loss[4] == 1.0:
                after -= 1
                if not after:
                    break
        return {"history": engine.autotune_history, "steps": step + 1,
                "settings": Point(engine.settings.fusion_threshold, engine.settings.cycle_time_ms,
                                  engine.backend.settings.halving_doubling_bytes),
                "done": tuner.done if tuner is not None else None, "stats": dict(engine.stats)}
    finally:
        core.shutdown()


@pytest.mark.parametrize(("n", "env", "shapes"), [
    # over TCP, a round large enough that the thresholds tried change how it is fused (1 MiB: two collectives) and
    # which algorithm reduces it (halving-doubling from 256 KiB or 1 MiB, recursive doubling or the ring otherwise)
    (3, {"SPARK_HVD_SHM": "0"}, [(150_000,), (150_000,), (3, 5)]),
    # small tensors only: every steady round is speculative, and a switch makes rank 0's speculation miss
    (2, {}, [(64,), (7, 3)]),
])
def test_autotune_switches_every_rank_at_the_same_round_and_results_stay_right(tmp_path, n, env, shapes):
    log = tmp_path / "autotune.csv"
    env = {**env, "SPARK_HVD_AUTOTUNE": "1", "SPARK_HVD_AUTOTUNE_LOG": str(log),
           "SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES": "1", "SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
           "SPARK_HVD_TIMEOUT": "60"}
    results = run_ranks(_tuned_job, n, env=env, args=(7 * n, shapes), timeout=240)
    history = results[0]["history"]
    assert len(history) >= 5, results[0]["stats"]  # it switched, several times
    for res in results[1:]:  # every rank switched at the same fast round to the same setting, and stopped together
        assert res["history"] == history and res["settings"] == results[0]["settings"]
        assert res["steps"] == results[0]["steps"] < 400
    assert results[0]["done"] and all(res["done"] is None for res in results[1:])
    rows = _rows(log)
    assert rows and rows[-1]["trial"] == "best" and all(float(row["score"]) > 0 for row in rows)
    assert results[0]["settings"] == _point(rows[-1])
    searched = {row["trial"] for row in rows}
    assert ("algorithm" in searched) == (n >= 3), searched  # halving-doubling is tried where it applies
    assert not [name for name in os.listdir(tmp_path) if name != "autotune.csv"]  # rank 0 alone writes
