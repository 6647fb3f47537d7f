"""A new name every call against the bare backend, in the same two processes (issue 28, deliverable 1)::

    .venv/bin/python benchmarks/new_names.py [--np 2] [--elements 1024] [--calls 2000] [--blocks 6] [--tcp]

Each rank alternates blocks of ``--calls`` calls of (a) the engine's backend's own ``allreduce`` of a float32 array
(the engine's round lock held meanwhile, so no engine round can run between them) and (b)
``spark_hvd.torch.allreduce_`` of a tensor of the same size under a name never used before (after two such rounds,
one collective each: ``spark_hvd.core.fresh``, run in the calling thread), with a barrier before each block. Per
call: wall time and the process's CPU time, medians over the blocks, and their ratios. Unlike
``allreduce.py --new-names`` (one process group per implementation), both run in the same processes, on the same
connections and shared memory, so the ratio is the engine's and the binding's own cost. ``--tcp``: no shared
memory (``SPARK_HVD_SHM=0``).
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
    tensor = torch.from_numpy(np.random.default_rng(hvd.rank()).standard_normal(elements).astype(np.float32))
    array = tensor.numpy().copy()
    names = itertools.count()

    def bare(n: int) -> None:
        with engine._round_lock:  # no engine round (a heartbeat) may run a collective between these
            for _ in range(n):
                backend.allreduce(array, ReduceOp.SUM)

    def api(n: int) -> None:
        for _ in range(n):
            hvd.allreduce_(tensor, name=f"new.{next(names)}", op=hvd.Sum)

    times: dict[str, list[tuple[float, float]]] = {"bare": [], "api": []}
    with np.errstate(over="ignore", invalid="ignore"):  # repeated sums overflow
        api(300)
        bare(300)
        for block in range(blocks):
            order = [("bare", bare), ("api", api)] if block % 2 == 0 else [("api", api), ("bare", bare)]
            for label, run in order:
                hvd.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                run(calls)
                times[label].append(((time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    if hvd.rank() == 0:
        (bw, bc), (aw, ac) = med["bare"], med["api"]
        print(f"N={hvd.size()} {elements} float32 over {backend.transport}, median of {blocks} blocks of {calls} "
              f"calls, load average {os.getloadavg()[0]:.1f}")
        print("| bare allreduce time | cpu | allreduce_ new name time | cpu | time ratio | cpu ratio |")
        print("|---|---|---|---|---|---|")
        print(f"| {bw * 1e3:.4f} ms | {bc * 1e3:.4f} ms | {aw * 1e3:.4f} ms | {ac * 1e3:.4f} ms | {aw / bw:.2f}x | "
              f"{ac / bc:.2f}x |", flush=True)
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
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if args.tcp:
        env["SPARK_HVD_SHM"] = "0"
    cmd = [sys.executable, "-m", "spark_hvd.runner", "-np", str(args.np), sys.executable,
           str(Path(__file__).resolve()), "--rank", "--elements", str(args.elements), "--calls", str(args.calls),
           "--blocks", str(args.blocks)]
    return subprocess.run(cmd, env=env, timeout=600).returncode


if __name__ == "__main__":
    sys.exit(main())
