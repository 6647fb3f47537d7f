"""What the user's path adds to a collective: one process (no peers to wait for), per-call time of
``spark_hvd.torch.allreduce_``, ``spark_hvd.core.allreduce`` and the backend's own ``allreduce`` on one named
float32 tensor, after warm-up (so the engine is armed and a call is one collective)::

    .venv/bin/python benchmarks/api_overhead.py [--elements 1024] [--calls 20000] [--thread-cpu]

With one rank the backend does nothing, so the first two rows are the binding's and the engine's cost per call,
which an N-rank job pays on top of its collective. The rows after them: a name never used before on every call
(the engine's round of new names, ``spark_hvd.core.engine.fresh``), out of place (``hvd.allreduce``), and
osu_allreduce's loop (an allreduce, then a barrier). Best of 3 repeats, microseconds per call; ``--thread-cpu`` times
the calling thread's CPU instead of the wall clock (steadier on a loaded machine: a preempted call does not count).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
import timeit
from pathlib import Path

if os.environ.get("BENCH_USE_PYTHONPATH") != "1":  # =1: the spark_hvd that PYTHONPATH names (A/B against a base)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=1024)
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--thread-cpu", action="store_true", help="time the calling thread's CPU, not the wall clock")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    import spark_hvd.core as core
    import spark_hvd.torch as hvd
    from spark_hvd.core.backend import ReduceOp

    torch.set_num_threads(1)
    hvd.init()
    try:
        tensor = torch.zeros(args.elements)
        array = tensor.numpy()
        backend = core.get_engine().backend
        fresh = itertools.count()

        def osu() -> None:
            hvd.allreduce_(tensor, name="osu", op=hvd.Sum)
            hvd.barrier()

        calls = {
            "spark_hvd.torch.allreduce_": lambda: hvd.allreduce_(tensor, name="t", op=hvd.Sum),
            "spark_hvd.core.allreduce": lambda: core.allreduce(array, name="a", op=ReduceOp.SUM),
            "backend.allreduce": lambda: backend.allreduce(array, ReduceOp.SUM),
            "allreduce_, new name": lambda: hvd.allreduce_(tensor, name=f"n.{next(fresh)}", op=hvd.Sum),
            "core.allreduce, new name": lambda: core.allreduce(array, name=f"c.{next(fresh)}", op=ReduceOp.SUM),
            "allreduce, new name": lambda: hvd.allreduce(tensor, name=f"o.{next(fresh)}", op=hvd.Sum),
            "allreduce_ + barrier": osu,
        }
        for call in calls.values():
            for _ in range(50):
                call()
        print(f"{args.elements} float32, {core.backend_name()} backend, size {core.size()}, "
              f"{'calling thread CPU' if args.thread_cpu else 'wall clock'}, load average {os.getloadavg()[0]:.1f}")
        for label, call in calls.items():
            timer = time.thread_time if args.thread_cpu else time.perf_counter
            best = min(timeit.repeat(call, number=args.calls, repeat=3, timer=timer)) / args.calls
            print(f"{label:28s} {best * 1e6:8.2f} us per call")
    finally:
        hvd.shutdown()


if __name__ == "__main__":
    main()
