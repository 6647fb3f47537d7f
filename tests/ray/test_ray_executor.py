"""``spark_hvd.ray.RayExecutor`` on a local Ray cluster: ranks and the launch contract, collectives against numpy,
a stateful ``execute`` loop, a 2-worker torch training equal to one process on the combined batches, a killed
worker named on the driver, and ``shutdown()`` leaving no actor, process or shared-memory segment behind.

One 2-worker executor serves the tests that leave it healthy (its start costs two Ray worker processes); the
failure, shutdown and elastic tests start their own. Also: ``callbacks``, Ray Tune trials, a stolen secret claim,
and an elastic job shrunk by a killed worker and grown back."""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SIZE = 2


@pytest.fixture(scope="module")
def executor(ray_cluster):
    from spark_hvd.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=SIZE, cpus_per_worker=1)
    executor.start()
    yield executor
    executor.shutdown()


# -- what the workers run (module-level functions, pickled by value) ------------------------------------------------
def _contract() -> dict:
    import spark_hvd.torch as hvd
    from spark_hvd.core.jobenv import JobEnv

    hvd.init()  # already joined by start(): harmless, as in Horovod's examples
    job = JobEnv.from_env()
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "SPARK_HVD_IFACE_ADDR", "SPARK_HVD_HOST_ID")
    return {"hvd": (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()),
            "job": (job.rank, job.size, job.local_rank, job.local_size, job.cross_rank, job.cross_size, job.job_id,
                    job.rendezvous, job.secret is not None),
            "env": {n: os.environ.get(n) for n in names}}


def _data(rank: int) -> dict:
    rng = np.random.default_rng(1234 + rank)
    return {"x": rng.standard_normal((5, 7)).astype(np.float32),
            "ints": rng.integers(-1000, 1000, size=(33,), dtype=np.int64),
            "rows": rng.standard_normal((3 + 2 * rank, 4)).astype(np.float64),
            "root": rng.standard_normal((17,)).astype(np.float32)}


def _collectives() -> dict:
    import spark_hvd.core as core

    mine = _data(core.rank())
    return {"sum": core.allreduce(mine["x"].copy(), op=core.Sum, name="x.sum"),
            "avg": core.allreduce(mine["x"].copy(), op=core.Average, name="x.avg"),
            "max": core.allreduce(mine["ints"].copy(), op=core.Max, name="ints.max"),
            "gather": core.allgather(mine["rows"], name="rows"),
            "bcast": core.broadcast(mine["root"].copy(), root_rank=1, name="root")}


class Counter:
    """A stateful executable: a count kept across ``execute`` calls, allreduced over the ranks each step."""

    def __init__(self, start: int) -> None:
        import spark_hvd.core as core

        core.init()
        self.rank = core.rank()
        self.count = start
        self.history: list[float] = []

    def step(self) -> float:
        import spark_hvd.core as core

        self.count += self.rank + 1
        total = float(core.allreduce(np.array([self.count], np.float64), op=core.Sum, name="count")[0])
        self.history.append(total)
        return total


def _make_batches(steps: int, per_rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((steps, SIZE * per_rank, 6)).astype(np.float32)
    y = (x @ rng.standard_normal((6, 1)).astype(np.float32) + 0.1).astype(np.float32)
    return x, y


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _train(steps: int, per_rank: int) -> dict:
    """Rank r trains on its rows of each step's combined batch, with spark_hvd.torch's DistributedOptimizer."""
    import torch

    import spark_hvd.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = _make_batches(steps, per_rank)
    rows = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
    for step in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(torch.from_numpy(x[step, rows])), torch.from_numpy(y[step, rows]))
        loss.backward()
        optimizer.step()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _one_process(steps: int, per_rank: int) -> dict:
    """``_train``'s model trained in one process on each step's combined batch: what every rank must end with."""
    import torch

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _make_batches(steps, per_rank)
    for step in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.from_numpy(x[step])), torch.from_numpy(y[step])).backward()
        optimizer.step()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


# -- the tests -------------------------------------------------------------------------------------------------------

# (the elastic test first: it needs the cluster's 4 CPUs, before the module's executor takes 2)
HOG = "spark_hvd_test_hog"
ELASTIC_STEPS = 20
SHRINK_AT = 6  # rank 1 of 2 dies after this step's commit
GROW_AT = 14  # rank 0 of 1 frees the CPUs after this step's commit


class Hog:
    """An actor that holds CPUs, so that Ray can place fewer workers."""

    def ping(self) -> bool:
        return True


def _elastic_train(marks: str) -> dict:
    import signal

    import ray

    import spark_hvd.core as core
    from spark_hvd.core.elastic import ObjectState, run_fn

    state = ObjectState(step=0, sizes=[], total=0.0)

    @run_fn
    def train(state: ObjectState) -> dict:
        while state.step < ELASTIC_STEPS:
            state.total += float(core.allreduce(np.ones(1), op=core.Sum, name="ones")[0])
            state.sizes = state.sizes + [core.size()]
            state.step += 1
            state.commit()
            shrink, grow = os.path.join(marks, "shrink"), os.path.join(marks, "grow")
            if state.step == SHRINK_AT and core.size() == 2 and core.rank() == 1 and not os.path.exists(shrink):
                open(shrink, "w").close()
                # 3 of the cluster's 4 CPUs, placed once this job's workers are gone: the relaunch fits one worker
                ray.remote(Hog).options(name=HOG, lifetime="detached", num_cpus=3).remote()
                ray.get_actor(HOG)
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step == GROW_AT and core.size() == 1 and not os.path.exists(grow):
                open(grow, "w").close()
                ray.kill(ray.get_actor(HOG))
                deadline = time.monotonic() + 30  # until Ray counts its CPUs free: the next commit sees them
                while ray.available_resources().get("CPU", 0) < 3 and time.monotonic() < deadline:
                    time.sleep(0.05)
            time.sleep(0.05)
        return {"step": state.step, "sizes": list(state.sizes), "total": state.total, "size": core.size(),
                "attempt": int(os.environ["SPARK_HVD_RUN_ATTEMPT"])}

    return train(state)


def test_elastic_a_lost_worker_shrinks_the_job_and_freed_cpus_grow_it_back(ray_cluster, tmp_path):
    """Elastic (``min_workers``/``max_workers``) on the 4 CPUs of this module's cluster, first in the module (before
    the shared executor holds 2 of them): a worker killed mid-training while Ray can place only one worker (another
    actor takes the freed CPUs) shrinks the job to one rank, which resumes from the last commit; once those CPUs
    are free again the job grows back to two at the next commit. The state is Horovod's ``ObjectState`` through
    ``hvd.elastic.run`` (``spark_hvd.core.elastic``), the code Spark's ``run_elastic`` runs."""
    from spark_hvd.ray import RayExecutor

    ray = ray_cluster
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=1, max_workers=2,
                           cpus_per_worker=1, elastic_timeout=60, cooldown_range=[2, 10], reset_limit=4)
    try:
        executor.start()
        started = time.monotonic()
        results = executor.run(_elastic_train, args=[str(tmp_path)])
        took = time.monotonic() - started
    finally:
        executor.shutdown()
        try:
            ray.kill(ray.get_actor(HOG))
        except ValueError:  # gone already
            pass
    assert (tmp_path / "shrink").exists() and (tmp_path / "grow").exists()
    # steps 1-6 at two ranks; the death after step 6's commit: resumed there with one rank (steps 7-15: the
    # growth is noticed at the commit after the CPUs were freed, step 15, which is kept); steps 16-20 at two again
    sizes = [2] * SHRINK_AT + [1] * (GROW_AT + 1 - SHRINK_AT) + [2] * (ELASTIC_STEPS - GROW_AT - 1)
    assert len(results) == 2
    for got in results:
        assert got["step"] == ELASTIC_STEPS and got["size"] == 2 and got["attempt"] == 2
        assert got["sizes"] == sizes
        assert got["total"] == float(sum(sizes))
    assert took < 120


def test_ranks_sizes_and_launch_contract(executor):
    got = executor.run(_contract)
    assert [g["hvd"] for g in got] == [(r, SIZE, r, SIZE, 0, 1) for r in range(SIZE)]
    job_ids = {g["job"][6] for g in got}
    assert job_ids == {executor.job_id}
    for rank, g in enumerate(got):
        assert g["job"][:6] == (rank, SIZE, rank, SIZE, 0, 1)
        assert g["job"][7].startswith("127.0.0.1:") and g["job"][8]  # the driver's KV rendezvous; secret claimed
        env = g["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == \
            (str(rank), str(SIZE), str(rank), str(SIZE), "0")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == got[0]["env"]["MASTER_PORT"]
        assert env["TORCHELASTIC_RUN_ID"] == executor.job_id
        assert env["SPARK_HVD_IFACE_ADDR"] == "127.0.0.1" and "/ray-node:" in env["SPARK_HVD_HOST_ID"]
    assert [n.rank for n in executor.nodes] == list(range(SIZE))
    assert len({n.node_id for n in executor.nodes}) == 1 and len({n.pid for n in executor.nodes}) == SIZE


def test_collectives_against_numpy(executor):
    got = executor.run(_collectives)
    data = [_data(r) for r in range(SIZE)]
    for rank in range(SIZE):
        np.testing.assert_allclose(got[rank]["sum"], sum(d["x"] for d in data), rtol=1e-6)
        np.testing.assert_allclose(got[rank]["avg"], sum(d["x"] for d in data) / SIZE, rtol=1e-6)
        np.testing.assert_array_equal(got[rank]["max"], np.maximum(*(d["ints"] for d in data)))
        np.testing.assert_array_equal(got[rank]["gather"], np.concatenate([d["rows"] for d in data]))
        np.testing.assert_array_equal(got[rank]["bcast"], data[1]["root"])


def test_run_remote_gives_object_refs(executor, ray_cluster):
    refs = executor.run_remote(lambda a, b=0: a * 10 + b, args=[4], kwargs={"b": 2})
    assert ray_cluster.get(refs, timeout=60) == [42] * SIZE


def test_stateful_execute_loop(ray_cluster):
    from spark_hvd.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=1, num_workers_per_host=SIZE)
    try:
        executor.start(executable_cls=Counter, executable_args=[100])
        totals = [executor.execute(lambda counter: counter.step()) for _ in range(3)]
        # step k: rank r holds 100 + k * (r + 1); the sum over ranks 0 and 1 is 200 + 3k
        assert totals == [[203.0] * SIZE, [206.0] * SIZE, [209.0] * SIZE]
        assert executor.execute_single(lambda counter: (counter.rank, counter.history)) == (0, [203.0, 206.0, 209.0])
        assert executor.execute(lambda counter: counter.count) == [103, 106]
    finally:
        executor.shutdown()


def test_torch_training_equals_one_process_on_the_combined_batches(executor):
    pytest.importorskip("torch")
    steps, per_rank = 5, 8
    got = executor.run(_train, kwargs={"steps": steps, "per_rank": per_rank})
    want = _one_process(steps, per_rank)
    for rank in range(SIZE):
        for name, value in want.items():
            np.testing.assert_allclose(got[rank][name], value, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} {name}")


def _die_on_rank_1() -> None:
    import signal

    import spark_hvd.core as core

    core.allreduce(np.ones(4), name="before")
    if core.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for step in range(1000):  # rank 0 goes on until its peer's death reaches it
        core.allreduce(np.ones(4), name=f"after.{step}")
        time.sleep(0.01)


def test_a_killed_worker_is_named_on_the_driver(ray_cluster):
    from spark_hvd.ray import RayExecutor, RayWorkerFailedError

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=SIZE)
    try:
        executor.start()
        started = time.monotonic()
        with pytest.raises(RayWorkerFailedError) as info:
            executor.run(_die_on_rank_1)
        assert time.monotonic() - started < 30
        node = executor.nodes[1]
        assert info.value.rank == 1 and info.value.node == node
        text = str(info.value)
        assert "rank 1 failed" in text and "its actor died" in text and node.node_ip in text
        assert node.node_id[:12] in text and f"pid {node.pid}" in text
    finally:
        executor.shutdown()


def _leave_things_behind() -> dict:
    """A child in a session of its own (outside the actor's process group) and the ring's shared memory."""
    import spark_hvd.core as core

    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    core.allreduce(np.ones(1 << 16, np.float32), name="big")
    return {"child": child.pid, "actor": os.getpid()}


def _busy_with_a_child(directory: str) -> None:
    """Starts a child in a session of its own, says so, and stays busy: shutdown() finds the rank mid-function."""
    import spark_hvd.core as core

    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    with open(os.path.join(directory, f"busy-{core.rank()}"), "w") as f:
        f.write(f"{child.pid} {os.getpid()}")
    time.sleep(300)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_shutdown_leaves_no_actor_process_or_shared_memory(ray_cluster, tmp_path):
    from spark_hvd.ray import RayExecutor

    ray = ray_cluster
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=SIZE)
    executor.start()
    job_id, workers, group = executor.job_id, list(executor.workers), executor.placement_group
    left = executor.run(_leave_things_behind)
    pids = [p for got in left for p in (got["child"], got["actor"])]
    executor.run_remote(_busy_with_a_child, args=[str(tmp_path)])  # then the ranks are not idle at shutdown
    busy = [tmp_path / f"busy-{r}" for r in range(SIZE)]
    deadline = time.monotonic() + 30
    while not all(b.exists() and b.read_text() for b in busy) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids += [int(p) for b in busy for p in b.read_text().split()]
    assert all(_alive(p) for p in pids) and len(set(pids)) == 3 * SIZE
    started = time.monotonic()
    executor.shutdown()
    print(f"shutdown took {time.monotonic() - started:.1f} s")
    executor.shutdown()  # twice is harmless
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []
    assert [n for n in os.listdir("/dev/shm") if job_id in n] == []
    for worker in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.__ray_ready__.remote(), timeout=30)
    from ray.util import placement_group_table

    assert placement_group_table(group)["state"] == "REMOVED"


def _secret_in_env() -> bool:
    return bool(os.environ.get("SPARK_HVD_SECRET"))


def test_the_secret_is_in_no_ray_argument_log_or_file(executor, ray_cluster):
    """The actors hold the secret (they joined the ring), but it is neither in what the executor handed to Ray
    (the actors' claims, the JobEnv of ``setup``) nor anywhere under the Ray session's directory (logs, spilled
    objects), raw or in hex."""
    import pickle

    from spark_hvd.core.jobenv import JobEnv

    secret = executor._kv.secret  # the driver's copy (private: only the driver's services hold it)
    assert executor.run(_secret_in_env) == [True] * SIZE
    executor.run(print, args=["a line in the workers' logs"])
    assert executor._handout is None  # every claim was used and the handout closed at the end of start()
    assert JobEnv(rank=0, size=1).secret is None
    needles = (secret, secret.hex().encode(), secret.hex().upper().encode(), pickle.dumps(secret))
    found = []
    for root, _, files in os.walk(ray_cluster.spark_hvd_temp_dir):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:  # sockets, files gone meanwhile
                continue
            found += [path for needle in needles if needle in data]
    assert found == []


def test_a_stolen_claim_stops_the_job_at_start(ray_cluster, monkeypatch):
    """Someone who read worker 1's claim from Ray's GCS presents it before the actor does: the actor gets nothing,
    and ``start()`` raises naming the stolen claim (and stops everything it started)."""
    from spark_hvd.ray import RayExecutor, RayExecutorError
    from spark_hvd.ray.secret import SecretHandout, fetch_secret

    stolen = []
    claim = SecretHandout.claim

    def claim_and_steal(self, label):
        made = claim(self, label)
        if label == "worker 1":
            stolen.append(fetch_secret(made, timeout_s=10))  # the thief is first
        return made

    monkeypatch.setattr(SecretHandout, "claim", claim_and_steal)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=SIZE)
    with pytest.raises(RayExecutorError, match="secret claim of worker 1 was presented twice"):
        executor.start()
    assert len(stolen) == 1 and executor.workers == [] and executor.placement_group is None
    executor.shutdown()


def _reporting(n: int) -> int:
    import spark_hvd.core as core
    from spark_hvd.runner import report

    for i in range(n):
        report(step=i, value=i * 10 + core.rank())
    return core.rank()


def test_callbacks_get_rank_0_reports_in_order_on_the_callers_thread(executor):
    import threading

    seen, threads = [], set()

    def callback(metrics: dict) -> None:
        seen.append(metrics)
        threads.add(threading.get_ident())

    assert executor.run(_reporting, args=[5], callbacks=[callback]) == [0, 1]
    assert seen == [{"value": i * 10, "step": i} for i in range(5)]
    assert threads == {threading.get_ident()}
    seen.clear()
    assert executor.execute(lambda _: _reporting(2), callbacks=[callback]) == [0, 1]
    assert seen == [{"value": 0, "step": 0}, {"value": 10, "step": 1}]


def _trial(config: dict) -> float:
    """4 steps of a running sum of allreduced values over the trial's ranks; rank 0 reports each step's state as a
    Tune checkpoint; both ranks fail once after each step of ``config["fail_after"]``; a restored trial goes on
    from its checkpoint."""
    import tempfile

    from ray import tune

    import spark_hvd.core as core
    from spark_hvd.ray import tune as hvd_tune

    resumed_from, total = 0, 0.0
    restored = hvd_tune.get_checkpoint()
    if restored is not None:
        with open(os.path.join(restored.path, "state.json")) as f:
            state = json.load(f)
        resumed_from, total = state["step"] + 1, state["total"]
    for step in range(resumed_from, 4):
        total += float(core.allreduce(np.array([config["x"] * (step + 1)]), op=core.Sum, name=f"s{step}")[0])
        with tempfile.TemporaryDirectory() as d:  # gone once report returned: Tune has its copy by then
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"step": step, "total": total}, f)
            hvd_tune.report({"step": step, "total": total, "size": core.size(), "resumed_from": resumed_from},
                            checkpoint=tune.Checkpoint.from_directory(d))
        mark = os.path.join(config["marks"], f"failed-after-{step}-{core.rank()}")
        if step in config["fail_after"] and not os.path.exists(mark):
            open(mark, "w").close()
            raise RuntimeError(f"a planned failure after step {step}")
    return total


def test_tune_trials_are_distributed_jobs_whose_checkpoints_go_through_tune(ray_cluster, tmp_path):
    """Two Tune trials, each a 2-rank job (0.5 CPU a worker: both fit beside the module's executor): Tune sees
    every report of each trial's rank 0, computed by allreduce over the trial's own two ranks, and rank 0's
    checkpoints are the trial's (``result.checkpoint``). (A trial restored from them: ``test_ray_tune_restore``.)"""
    tune = pytest.importorskip("ray.tune")
    from spark_hvd.ray.tune import DistributedTrainableCreator

    trainable = DistributedTrainableCreator(_trial, num_workers=2, cpus_per_worker=0.5, timeout_s=60)
    tuner = tune.Tuner(trainable, param_space={"x": tune.grid_search([1.0, 2.0]), "marks": str(tmp_path),
                                               "fail_after": []},
                       tune_config=tune.TuneConfig(metric="total", mode="max"),
                       run_config=tune.RunConfig(storage_path=str(tmp_path), name="trials", verbose=0))
    grid = tuner.fit()
    assert not grid.errors
    assert len(grid) == 2
    for result in grid:
        x = result.config["x"]
        rows = result.metrics_dataframe
        reported = rows[rows["total"].notna()]
        sums = [2 * x * (s + 1) for s in range(4)]  # x * (step + 1) summed over 2 ranks
        assert list(reported["step"]) == [0, 1, 2, 3] and list(reported["size"]) == [2, 2, 2, 2]
        assert list(reported["total"]) == [sum(sums[:s + 1]) for s in range(4)]
        assert list(reported["resumed_from"]) == [0, 0, 0, 0]
        with result.checkpoint.as_directory() as d, open(os.path.join(d, "state.json")) as f:
            assert json.load(f) == {"step": 3, "total": sum(sums)}


@pytest.mark.raycluster  # ~1 min on 2 cores (four trials' jobs): `make ray-clusters`
def test_asha_stops_the_worse_distributed_trials_early(ray_cluster, tmp_path):
    """Tune's ASHA scheduler over four distributed trials (each a 2-rank job): it stops the trials whose running sum
    trails at its first rung, and those trials end without an error and with fewer reports; the best trial runs all
    four steps to the sum computed by hand; no trial's workers are left alive."""
    tune = pytest.importorskip("ray.tune")
    from ray.tune.schedulers import ASHAScheduler

    from spark_hvd.ray.tune import DistributedTrainableCreator

    cpus_before = ray_cluster.available_resources().get("CPU", 0)
    trainable = DistributedTrainableCreator(_trial, num_workers=2, cpus_per_worker=0.5, timeout_s=60)
    asha = ASHAScheduler(time_attr="training_iteration", max_t=4, grace_period=1, reduction_factor=2)
    tuner = tune.Tuner(trainable, param_space={"x": tune.grid_search([4.0, 2.0, 1.0, 0.5]), "marks": str(tmp_path),
                                               "fail_after": []},
                       tune_config=tune.TuneConfig(metric="total", mode="max", scheduler=asha,
                                                   max_concurrent_trials=1),
                       run_config=tune.RunConfig(storage_path=str(tmp_path), name="asha", verbose=0))
    grid = tuner.fit()
    assert not grid.errors
    steps = {result.config["x"]: list(result.metrics_dataframe["step"].dropna()) for result in grid}
    assert steps[4.0] == [0, 1, 2, 3]
    assert grid.get_best_result().config["x"] == 4.0
    assert grid.get_best_result().metrics["total"] == sum(2 * 4.0 * (s + 1) for s in range(4))
    stopped = [x for x, seen in steps.items() if len(seen) < 4]
    assert stopped and 4.0 not in stopped, steps  # ASHA cut the trailing trials at a rung
    deadline = time.monotonic() + 30  # every trial's workers gone: the CPUs they held are free again
    while ray_cluster.available_resources().get("CPU", 0) < cpus_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_cluster.available_resources().get("CPU", 0) == cpus_before


@pytest.mark.raycluster  # ~1 min on 2 cores (three starts of a trial's job): `make ray-clusters`
def test_ray_tune_restore_a_trial_resumes_from_its_checkpoint_on_every_rank(ray_cluster, tmp_path):
    """A trial that fails after step 1 is restarted by Tune (``FailureConfig(max_failures=1)``) and both ranks go
    on from step 1's checkpoint (``get_checkpoint()``); it fails again after step 2, and ``Tuner.restore(...,
    resume_errored=True)`` goes on from step 2's: the sum equals an uninterrupted run's."""
    tune = pytest.importorskip("ray.tune")
    from spark_hvd.ray.tune import DistributedTrainableCreator

    marks = tmp_path / "marks"
    marks.mkdir()
    trainable = DistributedTrainableCreator(_trial, num_workers=2, cpus_per_worker=0.5, timeout_s=60)
    tuner = tune.Tuner(trainable, param_space={"x": 3.0, "marks": str(marks), "fail_after": [1, 2]},
                       tune_config=tune.TuneConfig(metric="total", mode="max"),
                       run_config=tune.RunConfig(storage_path=str(tmp_path), name="restore", verbose=0,
                                                 failure_config=tune.FailureConfig(max_failures=1)))
    first = tuner.fit()
    assert len(first.errors) == 1 and "a planned failure after step 2" in str(first.errors[0])
    assert first[0].metrics["step"] == 2 and first[0].metrics["resumed_from"] == 2  # Tune's restart, from step 1
    grid = tune.Tuner.restore(str(tmp_path / "restore"), trainable, resume_errored=True).fit()
    assert not grid.errors
    assert sorted(os.listdir(marks)) == [f"failed-after-{s}-{r}" for s in (1, 2) for r in (0, 1)]
    result = grid[0]
    expected = sum(2 * 3.0 * (s + 1) for s in range(4))
    assert result.metrics["step"] == 3 and result.metrics["total"] == expected
    assert result.metrics["resumed_from"] == 3  # Tuner.restore, from step 2's checkpoint
    with result.checkpoint.as_directory() as d, open(os.path.join(d, "state.json")) as f:
        assert json.load(f) == {"step": 3, "total": expected}
