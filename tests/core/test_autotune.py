"""Autotune: the tuner's decision on its own (made-up throughputs, a fake clock, seeded noise and drift: no
timing), its log and its carry-over across elastic resets, then jobs with ``SPARK_HVD_AUTOTUNE=1`` whose every step
is checked against numpy while the settings switch, with every rank switching at the same fast round and rank 0
writing the log."""

from __future__ import annotations

import csv
import os
import random

import helpers.engine_scenarios as sc
import numpy as np
import pytest
from helpers.ranks import run_ranks

import spark_hvd.core as core
import spark_hvd.core.engine.autotune as at
from spark_hvd.core.engine.autotune import (
    CONFIRM_PAIRS,
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


class Job:
    """A fake training job: steps of two tensors (1000 bytes a step) whose time comes from ``seconds(point, now)``
    under the setting every rank runs, switching as soon as the tuner asks."""

    def __init__(self, tuner: Tuner, seconds) -> None:
        self.tuner, self.seconds, self.now, self.steps = tuner, seconds, 1000.0, 0  # (perf_counter's origin is not 0)

    def run(self, steps: int = 5000, stop_after: int | None = None) -> int:
        tuner = self.tuner
        for _ in range(steps):
            if stop_after is not None and self.steps >= stop_after:
                return self.steps
            for name in ("a", "b"):
                self.now += self.seconds(tuner.current, self.now) / 2
                tuner.observe([name], 500, self.now)
            self.steps += 1
            if tuner.pending is not None:
                tuner.applied(tuner.pending, self.now)
            if tuner.done and tuner.pending is None:
                return self.steps
        raise AssertionError("the tuner did not finish")


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _point(row: dict[str, str]) -> Point:
    return Point(int(float(row["tensor_fusion_threshold"]) * MIB), float(row["cycle_time_ms"]),
                 int(float(row["halving_doubling_threshold"]) * MIB))


def _fastest_at_2ms_16mib(point: Point, now: float = 0.0) -> float:
    return 1e-3 * (1 + abs(np.log2(point.cycle_time_ms / 2.0)) + abs(np.log2(point.fusion_threshold / 16 / MIB)))


def test_the_search_finds_the_fastest_setting_confirms_it_and_logs_every_window(tmp_path):
    log = tmp_path / "logs" / "autotune.csv"  # the folder is made
    tuner = Tuner(START, warmup_samples=2, steps_per_sample=3, log_path=str(log))
    Job(tuner, _fastest_at_2ms_16mib).run()
    assert tuner.best == Point(16 * MIB, 2.0) and tuner.current == tuner.best
    rows = _rows(log)
    assert list(rows[0]) == list(at.HEADER)
    trials = [row["trial"] for row in rows]
    cycles, fusions = len(set(CYCLE_GRID_MS) | {1.0}), len(set(FUSION_GRID) | {64 * MIB})
    # every trial window sits between two windows of the start
    assert trials == (["warmup"] * 2 + ["baseline"] + ["cycle", "baseline"] * (cycles - 1)
                      + ["fusion", "baseline"] * (fusions - 1) + ["confirm", "baseline"] * CONFIRM_PAIRS + ["best"])
    start_score = 1000 / (_fastest_at_2ms_16mib(START) * 1e6)
    for row in rows[:-1]:  # the score is the bytes per microsecond of its setting: no window mixes two settings
        assert float(row["score"]) == pytest.approx(1000 / (_fastest_at_2ms_16mib(_point(row)) * 1e6), rel=1e-6)
        if row["trial"] in ("warmup", "baseline"):
            assert _point(row) == START and row["ratio"] == ""
        else:
            assert float(row["ratio"]) == pytest.approx(float(row["score"]) / start_score, rel=1e-3), row
    assert _point(rows[-1]) == Point(16 * MIB, 2.0) and float(rows[-1]["ratio"]) == pytest.approx(4.0, rel=1e-3)
    assert rows[-1]["score"] == ""


def test_steady_drift_in_the_load_cancels_in_the_paired_ratios():
    def seconds(point: Point, now: float) -> float:  # every setting alike; the machine speeds up 2x a minute
        return 1e-2 * 2.0 ** (-now / 60.0)

    tuner = Tuner(START, warmup_samples=1, steps_per_sample=5)
    Job(tuner, seconds).run()
    ratios = [r for trial in tuner.ratios.values() for rs in trial.values() for r in rs]
    assert ratios and max(abs(r - 1.0) for r in ratios) < 0.01, ratios  # raw scores rose ~2x during the search
    assert tuner.best == START


def test_a_setting_fast_only_while_screened_loses_its_confirmation_at_the_first_pair(tmp_path):
    log = tmp_path / "autotune.csv"
    tuner = Tuner(START, warmup_samples=0, steps_per_sample=3, log_path=str(log))

    def seconds(point: Point, now: float) -> float:  # 10 ms looks fast during the search, then is slower
        if point.cycle_time_ms == 10.0:
            return 0.5e-3 if tuner._phase < len(at._TRIALS) else 2e-3
        return 1e-3

    Job(tuner, seconds).run()
    [(confirmed, ratios)] = tuner.ratios["confirm"].items()  # one pair only: it lost, so the test could not pass
    assert confirmed.cycle_time_ms == 10.0 and ratios == [pytest.approx(0.5)]
    assert tuner.best == START and tuner.current == START
    assert [row["trial"] for row in _rows(log)][-3:] == ["confirm", "baseline", "best"]


def _adoptions(noise: float, gain: dict[float, float], seeds: range) -> list[Point]:
    """The setting kept by jobs whose every step is slower or faster by a random factor (log-uniform in
    [1/(1+noise), 1+noise], seeded), a cycle time's true speed-up from ``gain``; one step per window."""
    kept = []
    for seed in seeds:
        rng = random.Random(seed)

        def seconds(point: Point, now: float, rng=rng) -> float:
            return 1e-3 * (1 + noise) ** rng.uniform(-1, 1) / gain.get(point.cycle_time_ms, 1.0)

        tuner = Tuner(START, warmup_samples=0, steps_per_sample=1, fusion_grid=(), halving_grid=())
        Job(tuner, seconds).run()
        kept.append(tuner.best)
    return kept


def test_under_noise_larger_than_the_differences_the_start_is_kept():
    # +-30% per window, every setting alike or slower: a setting is adopted in at most ~1/32 of the jobs (sign test)
    kept = _adoptions(0.3, {0.5: 1.0, 2.0: 0.95, 5.0: 0.9, 10.0: 0.8}, range(300))
    assert sum(p != START for p in kept) <= 300 / 32, [p for p in kept if p != START]
    assert not [p for p in kept if p.cycle_time_ms in (5.0, 10.0)]  # never a setting 10-20% slower


def test_a_real_gain_larger_than_the_noise_is_adopted():
    kept = _adoptions(0.05, {0.5: 1.25}, range(50))  # 0.5 ms is 25% faster; +-5% noise per window
    assert sum(p == START._replace(cycle_time_ms=0.5) for p in kept) >= 45, kept


def test_among_three_tcp_ranks_the_halving_doubling_threshold_is_searched_too():
    def seconds(point: Point, now: float) -> float:  # fastest with halving-doubling from 1 MiB
        return 1e-3 * (2 - (point.halving_doubling_bytes == MIB) + point.cycle_time_ms / 100)

    tuner = Tuner(START, warmup_samples=1, steps_per_sample=2, tune_algorithm=True)
    Job(tuner, seconds).run()
    best = tuner.best  # (every fusion threshold is as fast)
    assert (best.cycle_time_ms, best.halving_doubling_bytes) == (0.5, MIB) and tuner.current == best
    assert {p.halving_doubling_bytes for p in tuner.ratios["algorithm"]} | {0} == set(HALVING_DOUBLING_GRID)


# ---------------------------------------------------------------------------------------------- elastic resets

def test_a_reset_during_the_search_goes_on_where_it_was_and_appends_to_the_log(tmp_path, monkeypatch):
    monkeypatch.setattr(at, "_tuners", {})
    log = str(tmp_path / "autotune.csv")
    tuner = at.tuner_for(START, 1, 3, log, tune_algorithm=False, job_id="job1")
    job = Job(tuner, _fastest_at_2ms_16mib)
    job.run(stop_after=20)  # mid-search, a window of a trial setting under way
    assert not tuner.done
    screened = {p: list(r) for p, r in tuner.ratios["cycle"].items()}
    tuner.close()  # the engine shuts down; a new one starts from the start setting
    again = at.tuner_for(START, 1, 3, log, tune_algorithm=False, job_id="job1")
    assert again is tuner and again.current == START
    job.run()
    assert again.best == Point(16 * MIB, 2.0) and again.current == again.best
    for point, ratios in screened.items():  # what was screened before the reset was kept, not measured again
        assert again.ratios["cycle"][point] == ratios
    rows = _rows(log)
    trials = [row["trial"] for row in rows]
    assert trials.count("reset") == 1 and trials[-1] == "best" and trials.count("warmup") == 2
    with open(log) as f:
        assert f.read().count("cycle_time_ms") == 1  # one header: appended, not rewritten
    # another job (or another log, or other starting settings) starts afresh
    assert at.tuner_for(START, 1, 3, None, tune_algorithm=False, job_id="job2") is not tuner


def test_a_finished_tuning_survives_a_reset_and_a_relaunched_attempt(tmp_path, monkeypatch):
    monkeypatch.setattr(at, "_tuners", {})
    log = str(tmp_path / "autotune.csv")
    tuner = at.tuner_for(START, 0, 2, log, tune_algorithm=False, job_id="job1")
    Job(tuner, _fastest_at_2ms_16mib).run()
    tuner.close()
    # an in-process reset: the new engine starts from START; every rank switches to the result at once
    again = at.tuner_for(START, 0, 2, log, tune_algorithm=False, job_id="job1")
    assert again is tuner and again.done and again.pending == Point(16 * MIB, 2.0)
    again.applied(again.pending, 0.0)
    again.observe(["a"], 8, 1.0)
    assert again.pending is None and again.current == Point(16 * MIB, 2.0)
    again.close()
    # a relaunched attempt (new processes, a new job id) reads the best line the earlier attempt logged
    monkeypatch.setattr(at, "_tuners", {})
    relaunched = at.tuner_for(START, 0, 2, log, tune_algorithm=False, job_id="job1-attempt1", attempt=1)
    assert relaunched.done and relaunched.pending == Point(16 * MIB, 2.0)
    trials = [row["trial"] for row in _rows(log)]
    assert trials[-2:] == ["reset", "reset"] and trials.count("best") == 1
    # a first attempt never reads an old log: it tunes afresh and rewrites it
    monkeypatch.setattr(at, "_tuners", {})
    fresh = at.tuner_for(START, 0, 2, log, tune_algorithm=False, job_id="job3")
    assert not fresh.done and [row["trial"] for row in _rows(log)] == []
    fresh.close()


def test_a_reset_engine_on_one_rank_takes_the_tuner_over(monkeypatch, tmp_path):
    monkeypatch.setattr(at, "_tuners", {})
    settings = Settings(autotune=True, autotune_log=str(tmp_path / "autotune.csv"))
    core.init(backend="local", settings=settings)
    try:
        first = core.get_engine()._tuner
    finally:
        core.shutdown()
    core.init(backend="local", settings=settings)
    try:
        assert first is not None and core.get_engine()._tuner is first
    finally:
        core.shutdown()


# ---------------------------------------------------------------------------------------------- small parts

def test_a_step_stretched_by_something_else_does_not_decide_a_sample():
    tuner = Tuner(START, warmup_samples=0, steps_per_sample=5)
    now = 0.0
    for step in range(100):  # until the first scored sample: 1 ms steps, one of them stretched to 20 ms
        now += 0.020 if step == 3 else 1e-3
        tuner.observe(["a"], 1000, now)
        if tuner.pending is not None:
            tuner.applied(tuner.pending, now)
        if tuner._base is not None:  # the first scored window (the start's baseline)
            break
    assert tuner._base == pytest.approx(1.0)  # 1000 bytes per ms: the median step's rate


def test_a_log_that_cannot_be_written_names_the_setting(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="SPARK_HVD_AUTOTUNE_LOG=.*cannot write the autotune log"):
        Tuner(START, log_path=str(tmp_path / "file" / "autotune.csv"))


def test_names_that_never_come_back_still_make_windows():
    tuner = Tuner(START, warmup_samples=0, steps_per_sample=1)
    for i in range(60 * 64):
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
           "SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES": "1", "SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE": "1",
           "SPARK_HVD_TIMEOUT": "60"}
    results = run_ranks(_tuned_job, n, env=env, args=(7 * n, shapes), timeout=240)
    history = results[0]["history"]
    assert len(history) >= 5, results[0]["stats"]  # it switched, several times
    for res in results[1:]:  # every rank switched at the same fast round to the same setting, and stopped together
        assert res["history"] == history and res["settings"] == results[0]["settings"]
        assert res["steps"] == results[0]["steps"] < 400
    assert results[0]["done"] and all(res["done"] is None for res in results[1:])
    rows = _rows(log)
    assert rows and rows[-1]["trial"] == "best" and all(float(row["score"]) > 0 for row in rows[:-1])
    assert results[0]["settings"] == _point(rows[-1])
    searched = {row["trial"] for row in rows}
    assert ("algorithm" in searched) == (n >= 3), searched  # halving-doubling is tried where it applies
    assert not [name for name in os.listdir(tmp_path) if name != "autotune.csv"]  # rank 0 alone writes


def test_a_relaunched_attempt_switches_every_rank_to_the_logged_result_at_once(tmp_path):
    log = tmp_path / "autotune.csv"  # what rank 0 of the earlier attempt wrote
    log.write_text(",".join(at.HEADER) + "\n1,64,0,10.5,baseline,\n2.5,4,0,,best,1.2000\n")
    env = {"SPARK_HVD_AUTOTUNE": "1", "SPARK_HVD_AUTOTUNE_LOG": str(log), "SPARK_HVD_RUN_ATTEMPT": "1",
           "SPARK_HVD_TIMEOUT": "60"}
    results = run_ranks(_tuned_job, 2, env=env, args=(5, [(64,), (7, 3)]), timeout=240)
    kept = Point(4 * MIB, 2.5)
    for res in results:  # one switch, at the same fast round on every rank, then the steps went on (checked)
        assert res["settings"] == kept and res["history"] == results[0]["history"]
        assert [(fusion, cycle) for _, fusion, cycle, _ in res["history"]] == [(4 * MIB, 2.5)]
    assert [row["trial"] for row in _rows(log)] == ["baseline", "best", "reset"]  # appended, nothing tuned again
