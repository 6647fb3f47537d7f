"""A new name every call against the bare backend, in the same two processes (issue 28, deliverable 1)::

    .venv/bin/python benchmarks/new_names.py [--np 2] [--elements 1024] [--calls 2000] [--blocks 6] [--tcp]

Each rank alternates (rotating the order every block) blocks of ``--calls`` calls of:

- ``bare``: the engine's backend's own ``allreduce`` of a float32 array (the engine's round lock held meanwhile,
  so no engine round can run between them);
- ``free``: the same on a second backend of the same ranks that no engine uses (its own connections and shared
  memory, set up through the job's rendezvous under another job id): the engine-free ring, in the same processes
  and the same minutes, so a difference between ``bare`` and ``free`` is what an engine in the process costs the
  backend's call;
- ``api``: ``spark_hvd.torch.allreduce_`` of a tensor of the same size under a name never used before (after two
  such rounds, one collective each: ``spark_hvd.core.engine.fresh``, run in the calling thread),

with a barrier before each block. Per call: wall time, the process's CPU time (every thread) and the calling
thread's voluntary context switches (how often it slept waiting for the other rank), medians over the blocks, and
the ratios of ``api`` to ``bare`` and to ``free``. Unlike ``allreduce.py --new-names`` (one process group per
implementation, a few milliseconds per measurement), all three run in the same processes, so the ratios are the
engine's and the binding's own cost. ``--tcp``: no shared memory (``SPARK_HVD_SHM=0``).
``BENCH_USE_PYTHONPATH=1``: time the spark_hvd that ``PYTHONPATH`` names (another checkout, for before/after).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sleeps() -> int:
    """The calling thread's voluntary context switches so far (0 where /proc does not say)."""
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _free_backend(rank: int, size: int):  # noqa: ANN202 - a RingBackend (imported here, after the job's init)
    """A second ring of the same ranks, with no engine: the job's rendezvous under another job id."""
    from spark_hvd.core.backends.ring import RingBackend
    from spark_hvd.core.jobenv import JobEnv
    from spark_hvd.core.settings import Settings
    from spark_hvd.core.transport.rendezvous import KVRendezvous

    job = JobEnv.from_env()
    assert job is not None and job.rendezvous and job.secret is not None
    settings = Settings.from_env()
    job_id = f"{job.job_id}.engine-free"
    return RingBackend(rank, size, KVRendezvous(job.rendezvous, job.secret, job_id, settings.timeout_s), job.secret,
                       settings, job_id)


def _rank(elements: int, calls: int, blocks: int) -> None:
    import numpy as np
    import torch

    import spark_hvd.core as core
    import spark_hvd.torch as hvd
    from spark_hvd.core.backend import ReduceOp

    torch.set_num_threads(1)
    hvd.init()
    engine = core.get_engine()
    backend = engine.backend
    free = _free_backend(hvd.rank(), hvd.size())
    tensor = torch.from_numpy(np.random.default_rng(hvd.rank()).standard_normal(elements).astype(np.float32))
    array = tensor.numpy().copy()
    names = itertools.count()

    def bare(n: int) -> None:
        with engine._round_lock:  # no engine round (a heartbeat) may run a collective between these
            for _ in range(n):
                backend.allreduce(array, ReduceOp.SUM)

    def engine_free(n: int) -> None:
        for _ in range(n):
            free.allreduce(array, ReduceOp.SUM)

    def api(n: int) -> None:
        for _ in range(n):
            hvd.allreduce_(tensor, name=f"new.{next(names)}", op=hvd.Sum)

    kinds = [("bare", bare), ("free", engine_free), ("api", api)]
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k, _ in kinds}
    with np.errstate(over="ignore", invalid="ignore"):  # repeated sums overflow
        for _, run in kinds:
            run(300)
        for block in range(blocks):
            for label, run in kinds[block % 3:] + kinds[:block % 3]:
                hvd.barrier()
                run(3)  # after the barrier: the round of new names is expected again (a barrier disarms it)
                sleeps, wall, cpu = _sleeps(), time.perf_counter(), time.process_time()
                run(calls)
                times[label].append(((time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls,
                                     (_sleeps() - sleeps) / calls))
    med = {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in times.items()}
    if hvd.rank() == 0:
        print(f"N={hvd.size()} {elements} float32 over {backend.transport}, median of {blocks} blocks of {calls} "
              f"calls, load average {os.getloadavg()[0]:.1f}")
        print("| per call | bare (engine's backend) | free (engine-free backend) | api (new name) | api/bare | "
              "api/free |")
        print("|---|---|---|---|---|---|")
        (bw, bc, bs), (fw, fc, fs), (aw, ac, as_) = med["bare"], med["free"], med["api"]
        print(f"| time | {bw * 1e3:.4f} ms | {fw * 1e3:.4f} ms | {aw * 1e3:.4f} ms | {aw / bw:.2f}x | {aw / fw:.2f}x |")
        print(f"| cpu | {bc * 1e3:.4f} ms | {fc * 1e3:.4f} ms | {ac * 1e3:.4f} ms | {ac / bc:.2f}x | {ac / fc:.2f}x |")
        print(f"| sleeps | {bs:.2f} | {fs:.2f} | {as_:.2f} | | |", flush=True)
    hvd.barrier()
    free.close()
    hvd.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--elements", type=int, default=1024)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--tcp", action="store_true", help="no shared memory between the ranks (SPARK_HVD_SHM=0)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        _rank(args.elements, args.calls, args.blocks)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if os.environ.get("BENCH_USE_PYTHONPATH") != "1":  # =1: the spark_hvd that PYTHONPATH names (A/B against a base)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if args.tcp:
        env["SPARK_HVD_SHM"] = "0"
    cmd = [sys.executable, "-m", "spark_hvd.runner", "-np", str(args.np), sys.executable,
           str(Path(__file__).resolve()), "--rank", "--elements", str(args.elements), "--calls", str(args.calls),
           "--blocks", str(args.blocks)]
    return subprocess.run(cmd, env=env, timeout=600).returncode


if __name__ == "__main__":
    sys.exit(main())
