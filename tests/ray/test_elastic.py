"""Elastic ``RayExecutor`` (``min_workers``/``max_workers``) on a local Ray cluster of 4 CPUs: a worker killed
mid-training while Ray can place only one worker (another actor takes the freed CPUs) shrinks the job to one rank,
which resumes from the last commit; once those CPUs are free again the job grows back to two at the next commit.
The state is Horovod's ``ObjectState`` through ``hvd.elastic.run`` (``spark_hvd.core.elastic``), the code Spark's
``run_elastic`` runs."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HOG = "spark_hvd_test_hog"
STEPS = 20
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
        while state.step < STEPS:
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


def test_a_lost_worker_shrinks_the_job_and_freed_cpus_grow_it_back(ray_cluster, tmp_path):
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
    sizes = [2] * SHRINK_AT + [1] * (GROW_AT + 1 - SHRINK_AT) + [2] * (STEPS - GROW_AT - 1)
    assert len(results) == 2
    for got in results:
        assert got["step"] == STEPS and got["size"] == 2 and got["attempt"] == 2
        assert got["sizes"] == sizes
        assert got["total"] == float(sum(sizes))
    assert took < 120
