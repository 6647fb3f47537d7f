"""run_elastic on the shared local[2] session: a rank killed mid-epoch (the job resumes from the last commit with the
slots that are free), growth when a slot frees up, and the errors (too few slots, an exception of fn's own).

The training function is full-batch gradient descent with momentum, accumulated batch by batch over an
``ElasticSampler`` and committed after every batch; whatever the resets, the final model must equal the same
descent run in one process, and every sample must be counted exactly once per epoch in the committed state.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time

import cloudpickle
import numpy as np
import pytest

from spark_hvd.runner import ElasticError, RankFailedError, run_elastic

torch = pytest.importorskip("torch")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module

N, BATCH, EPOCHS, LR, MOMENTUM = 24, 2, 2, 0.01, 0.5


def _data() -> tuple:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + 0.1
    return x, y


def _model() -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _train(marker_dir: str, kill_at: int | None, slow_at_size1: float) -> dict:
    """One rank: on the first attempt, rank 1 dies (os._exit) after batch ``kill_at``'s allreduce, before its commit."""
    import spark_hvd.torch as hvd

    hvd.init()
    x, y = _data()
    model, optimizer = _model()
    sampler = hvd.elastic.ElasticSampler(range(N), shuffle=True, seed=1)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, seen=torch.zeros(N, dtype=torch.float64),
                                   acc=[torch.zeros_like(p) for p in model.parameters()])
    attempt = int(os.environ["SPARK_HVD_RUN_ATTEMPT"])
    resumed = {}
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def loop(state):
        resumed.setdefault("at", (state.epoch, len(sampler.processed_indices)))
        while state.epoch < EPOCHS:
            for b in range((len(sampler) + BATCH - 1) // BATCH):
                idx = sampler.get_indices(b, BATCH, drop_padding=True)
                model.zero_grad()
                loss = ((model(x[idx]) - y[idx]) ** 2).sum()  # 0 (and zero gradients) on an empty batch
                loss.backward()
                counts = torch.zeros(N, dtype=torch.float64)
                counts[idx] += 1
                sums = [hvd.allreduce(t, op=hvd.Sum, name=f"g{j}")
                        for j, t in enumerate([counts] + [p.grad for p in model.parameters()])]
                state.seen += sums[0]
                for acc, grad in zip(state.acc, sums[1:], strict=True):
                    acc += grad
                sampler.record_batch(b, BATCH)
                if attempt == 0 and hvd.rank() == 1 and b == kill_at:
                    os._exit(3)
                if hvd.size() == 1:
                    open(os.path.join(marker_dir, "release"), "w").close()  # the growth test's blocker may go
                    time.sleep(slow_at_size1)
                state.commit()
            for p, acc in zip(model.parameters(), state.acc, strict=True):
                p.grad = acc.clone()
                acc.zero_()
            optimizer.step()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()

    loop(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "attempt": attempt, "resumed": resumed["at"],
            "resets": resets, "seen": state.seen.numpy(), "weights": [p.detach().numpy() for p in model.parameters()]}


def _single_process() -> list:
    x, y = _data()
    model, optimizer = _model()
    for _ in range(EPOCHS):
        optimizer.zero_grad()
        ((model(x) - y) ** 2).sum().backward()
        optimizer.step()
    return [p.detach().numpy() for p in model.parameters()]


def _check_final(results: list, size: int) -> None:
    assert [r["rank"] for r in results] == list(range(size)) and {r["size"] for r in results} == {size}
    expected = _single_process()
    for r in results:
        np.testing.assert_array_equal(r["seen"], np.full(N, EPOCHS), err_msg=f"rank {r['rank']}: samples counted")
        for got, want in zip(r["weights"], expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_mid_epoch_resumes_from_the_last_commit(spark, tmp_path):
    results = run_elastic(_train, args=(str(tmp_path), 2, 0.0), num_proc=2, min_num_proc=1, max_num_proc=2,
                          elastic_timeout=60, reset_limit=2, verbose=0)
    _check_final(results, 2)
    for r in results:
        assert r["attempt"] == 1
        # batches 0 and 1 of epoch 0 were committed (2 ranks x 2 samples each), batch 2 was lost with rank 1
        assert r["resumed"] == (0, 2 * 2 * 2)
        assert r["resets"] == [2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_over_spark_connect_a_killed_rank_resumes_too(spark_connect, tmp_path):
    """Connect cannot tell free slots: the relaunch takes the local[2] master's total."""
    results = run_elastic(_train, args=(str(tmp_path), 1, 0.0), num_proc=2, min_num_proc=1, max_num_proc=2,
                          elastic_timeout=60, reset_limit=2, verbose=0, spark=spark_connect)
    _check_final(results, 2)
    assert all(r["attempt"] == 1 and r["resumed"] == (0, 2 * 2 * 1) for r in results)


def _horovod_style(marker_dir: str) -> dict:
    """docs/elastic.md's loop: DistributedOptimizer, a DataLoader over the ElasticSampler, commit every batch."""
    import spark_hvd.torch as hvd

    hvd.init()
    x, y = _data()
    dataset = torch.utils.data.TensorDataset(x, y)
    model, optimizer = _model()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    marker = os.path.join(marker_dir, "killed")
    starts = []

    @hvd.elastic.run
    def loop(state):
        starts.append((state.epoch, len(sampler.processed_indices)))
        while state.epoch < EPOCHS:
            loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
            for batch_idx, (xb, yb) in enumerate(loader):
                optimizer.zero_grad()
                ((model(xb) - yb) ** 2).mean().backward()
                optimizer.step()
                sampler.record_batch(batch_idx, BATCH)
                if hvd.rank() == 1 and state.epoch == 1 and batch_idx == 3 and not os.path.exists(marker):
                    open(marker, "w").close()
                    os._exit(4)
                state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()

    loop(state)
    return {"starts": starts, "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).numpy(),
            "momentum": [v["momentum_buffer"].numpy() for v in optimizer.state_dict()["state"].values()]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_documented_horovod_style_loop_survives_a_lost_rank(spark, tmp_path):
    results = run_elastic(_horovod_style, args=(str(tmp_path),), num_proc=2, min_num_proc=1, max_num_proc=2,
                          reset_limit=1, verbose=0)
    assert os.path.exists(tmp_path / "killed")
    # epoch 1 resumed after its 3 committed batches (2 ranks x 2 samples each)
    assert [r["starts"] for r in results] == [[(1, 3 * 2 * 2)]] * 2
    np.testing.assert_array_equal(results[0]["weights"], results[1]["weights"])
    for a, b in zip(results[0]["momentum"], results[1]["momentum"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(results[0]["weights"]).all()


def _hold_a_slot(spark, release: str) -> threading.Thread:
    """A one-task job that holds a slot until the file ``release`` exists (at most 120 s), started before this
    returns. Released by the job itself, not after a fixed time: a loaded machine cannot make it expire early."""
    def hold(_) -> None:
        deadline = time.monotonic() + 120
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)

    def job() -> None:
        spark.sparkContext.parallelize([0], 1).foreach(hold)

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    from spark_hvd.runner.slots import slots

    deadline = time.monotonic() + 60
    while slots(spark.sparkContext)[0] > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    return thread


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_job_grows_when_a_slot_frees_up(spark, tmp_path):
    blocker = _hold_a_slot(spark, str(tmp_path / "release"))  # the job starts with 1 rank, which releases it
    try:
        results = run_elastic(_train, args=(str(tmp_path), None, 0.4), num_proc=2, min_num_proc=1, max_num_proc=2,
                              elastic_timeout=60, reset_limit=3, verbose=0)
    finally:
        blocker.join(60)
    _check_final(results, 2)
    for r in results:
        assert r["attempt"] >= 1 and r["resets"] == [2]
        epoch, processed = r["resumed"]
        assert (epoch, processed) != (0, 0), "the grown job did not start from the 1-rank job's commit"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_over_spark_connect_the_job_grows_when_a_slot_frees_up(spark, spark_connect, tmp_path):
    """Connect cannot tell free slots: a one-task probe job that runs proves one (``runner/probe.py``). The job
    starts on 1 rank of the Connect session while a classic job holds the other slot of the shared local[2]; once
    the rank has released it, a probe runs and the job grows to 2 from its last commit."""
    blocker = _hold_a_slot(spark, str(tmp_path / "release"))
    try:
        results = run_elastic(_train, args=(str(tmp_path), None, 1.0), num_proc=1, min_num_proc=1, max_num_proc=2,
                              elastic_timeout=60, reset_limit=3, verbose=0, spark=spark_connect)
    finally:
        (tmp_path / "release").touch()
        blocker.join(60)
    _check_final(results, 2)
    for r in results:
        assert r["attempt"] >= 1 and r["resets"] == [2]
        assert r["resumed"] != (0, 0), "the grown job did not start from the 1-rank job's commit"


def test_too_few_slots_within_elastic_timeout_names_what_is_missing(spark):
    with pytest.raises(ElasticError, match=r"min_num_proc=3 free task slots.*only 2.*\(1 missing\)"):
        run_elastic(_train, num_proc=3, min_num_proc=3, max_num_proc=3, elastic_timeout=0.5, verbose=0)


def _raises() -> None:
    print("a line before the bug", flush=True)
    raise ValueError("a bug in fn, not a lost rank")


@pytest.mark.timeout(120)
def test_on_local_n_an_exception_of_fn_fails_the_run_without_a_relaunch(spark):
    # local[2]: Spark lets a task fail once (local[N,F] or spark.task.maxFailures allow more: the test below)
    out = io.StringIO()  # Horovod's stdout keyword and min_np name (its deprecated min_num_proc)
    with pytest.raises(RankFailedError, match="a bug in fn") as info:
        run_elastic(_raises, num_proc=2, min_np=1, max_num_proc=2, reset_limit=5, verbose=0, stdout=out)
    assert info.value.remote_type == "ValueError"
    assert "]<stdout>:a line before the bug\n" in out.getvalue()


def _raises_once(marker_dir: str) -> dict:
    """Horovod's test_happy_run_elastic_fault_tolerant in small (the core's API: no framework to import): rank 1
    raises (once, a marker file) at step 2."""
    import spark_hvd.core as hvd
    from spark_hvd.core.backend import ReduceOp
    from spark_hvd.core.elastic import ObjectState, run_fn

    state = ObjectState(step=0, rendezvous=0, total=0.0)

    @run_fn
    def loop(state):
        state.rendezvous += 1
        while state.step < 4:
            marker = os.path.join(marker_dir, f"rank_{hvd.rank()}_step_{state.step}_fail")
            if os.path.exists(marker):
                os.unlink(marker)
                raise ValueError(f"training failed at step {state.step}, restart the task")
            summed = np.array([state.step + 1.0])
            hvd.allreduce(summed, op=ReduceOp.SUM)
            state.total += float(summed[0])
            state.step += 1
            state.commit()

    loop(state)
    return {"step": state.step, "rendezvous": state.rendezvous, "total": state.total,
            "attempt": int(os.environ["SPARK_HVD_RUN_ATTEMPT"])}


@pytest.mark.timeout(180)
def test_an_exception_of_fn_relaunches_from_the_last_commit_where_spark_retries_tasks(spark, tmp_path, monkeypatch,
                                                                                       caplog):
    import logging

    from spark_hvd.runner import cluster

    monkeypatch.setattr(cluster, "task_max_failures", lambda spark: 2)  # as on local[2,2] or a cluster's default
    (tmp_path / "rank_1_step_2_fail").touch()
    with caplog.at_level(logging.WARNING, logger="spark_hvd.runner.elastic"):
        results = run_elastic(_raises_once, args=(str(tmp_path),), num_proc=2, verbose=0)
    # steps 0 and 1 committed before the failure; the relaunch resumed at step 2: each step summed once (2 ranks)
    assert results == [{"step": 4, "rendezvous": 2, "total": 2.0 * (1 + 2 + 3 + 4), "attempt": 1}] * 2
    logged = caplog.text
    assert "rank 1 on host " in logged and "raised ValueError: training failed at step 2" in logged
    assert "relaunching from the last commit" in logged and "in loop" in logged  # the rank's traceback


def _rank_1_dies() -> None:
    import spark_hvd.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        os._exit(3)
    hvd.barrier()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_reset_limit_bounds_the_relaunches(spark):
    with pytest.raises(ElasticError, match=r"reset_limit=0 reached; the last reset was needed after rank \d failed"):
        run_elastic(_rank_1_dies, num_proc=2, min_num_proc=1, max_num_proc=2, reset_limit=0, verbose=0)


BIG_ROWS, BIG_COLS, BIG_STEPS = 4096, 4096, 3  # 64 MiB of float32 weights + 64 MiB of momentum: 128 MiB committed


def _big_descent(steps_done: int, model, optimizer) -> None:
    """Step ``steps_done + 1`` of the big-state job: a gradient every rank computes alike, one SGD-momentum step."""
    model.weight.grad = torch.full_like(model.weight, float(steps_done + 1)) * model.weight.detach().sign()
    optimizer.step()


def _big_model() -> tuple:
    model = torch.nn.Linear(BIG_COLS, BIG_ROWS, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.linspace(-1, 1, BIG_ROWS * BIG_COLS).reshape(BIG_ROWS, BIG_COLS))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _digest(model, optimizer) -> str:
    import hashlib

    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"]
    return hashlib.sha256(model.weight.detach().numpy().tobytes() + momentum.numpy().tobytes()).hexdigest()


def _big_state_job() -> dict:
    """Rank 1 dies right after the commit of step 2 (of 3); the relaunch must restore all 128 MiB exactly."""
    import spark_hvd.torch as hvd

    hvd.init()
    model, optimizer = _big_model()
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    attempt = int(os.environ["SPARK_HVD_RUN_ATTEMPT"])

    @hvd.elastic.run
    def loop(state):
        start = state.step
        while state.step < BIG_STEPS:
            hvd.allreduce(torch.ones(1), name=f"step{state.step}")  # fails on rank 0 once rank 1 is gone
            _big_descent(state.step, model, optimizer)
            state.step += 1
            state.commit()
            if attempt == 0 and hvd.rank() == 1 and state.step == 2:
                os._exit(3)
        return start

    start = loop(state)
    return {"attempt": attempt, "start": start, "digest": _digest(model, optimizer)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_state_above_the_old_60_mib_cap_is_committed_and_restored_after_a_lost_rank(spark):
    results = run_elastic(_big_state_job, num_proc=2, min_num_proc=1, max_num_proc=2, elastic_timeout=60,
                          reset_limit=1, verbose=0)
    model, optimizer = _big_model()
    for step in range(BIG_STEPS):
        _big_descent(step, model, optimizer)
    want = _digest(model, optimizer)
    assert [(r["attempt"], r["start"], r["digest"]) for r in results] == [(1, 2, want)] * 2
