"""CPU and wall time per allreduce of the bare ``RingBackend``, for A/B runs of two versions of the code.

On a machine shared with other work, wall times swing with the load while the CPU time a rank spends per
allreduce stays comparable; so this script times the bare backend (float32 SUM, N ranks on this host) once per
source tree given, alternating the trees every round, and prints each tree's CPU (mean per rank) and wall
(slowest rank) per allreduce, median over rounds, and the CPU of the thread that calls the collective (the rest
is the sender thread's: what would run on another core if one were idle). A tree is a
checkout of this repository (for example ``git worktree add /tmp/base main``); each is imported from its own
directory::

    .venv/bin/python benchmarks/ring_cpu.py --trees /tmp/base,. --np 2 --sizes 4K,1M,16M,64M --rounds 3
    .venv/bin/python benchmarks/ring_cpu.py --trees . --np 4 --hier           # 2 simulated hosts of N/2 ranks
    .venv/bin/python benchmarks/ring_cpu.py --np 2 --envs "SPARK_HVD_COMPILED_RING=1;SPARK_HVD_COMPILED_RING=0"

``--dtype`` and ``--op`` reduce another dtype (``bfloat16``: a uint16 view) or op than float32 SUM; with a tree from
before the compiled loop took them, A/B against it compares the compiled loop with the Python loop::

    .venv/bin/python benchmarks/ring_cpu.py --trees /tmp/base,. --np 2 --sizes 16M --dtype float16 --op max

``--envs`` compares settings instead of (or as well as) trees: each ``;``-separated list of ``VAR=VALUE,...``
is one variant, run in every tree, alternated with the others every round.

``--spin`` starts a thread in every rank that runs Python without pause during the timed allreduces (a training
loop's Python beside the collectives: the GIL is then handed over only every switch interval, 5 ms); read the wall
times (the CPU includes the spinning thread's)::

    .venv/bin/python benchmarks/ring_cpu.py --np 2 --sizes 16M --spin \
        --envs "SPARK_HVD_COMPILED_RING=1;SPARK_HVD_COMPILED_RING=0"

``--hier`` runs the hierarchical path (``SPARK_HVD_HOST_ID``: ranks 0..N/2-1 on one "host", the rest on
another); ``--shm`` shared memory among all N ranks (at N=2 from ``SPARK_HVD_SHM_CMA`` bytes: cross-memory attach);
otherwise the TCP ring (``SPARK_HVD_SHM=0``). ``--profile K`` also runs cProfile with a CPU clock on every
rank over the timed allreduces and prints rank 0's top K functions by own time (per tree, last round; the profiler
adds its own cost to every call, so read shares, not the timings). Figures from a loaded machine are indicative
only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def _spin(stop: threading.Event) -> None:
    """Run Python until ``stop`` is set (``--spin``)."""
    count = 0
    while not stop.is_set():
        count += 1


def _rank(sizes: list[int], profile: int, spin: bool = False, dtype: str = "float32", op: str = "SUM") -> dict:
    """One rank: time every size (warm-up, barrier, then a fixed byte budget of allreduces)."""
    import cProfile
    import io
    import pstats

    import numpy as np
    try:
        from helpers.ranks import backend_from_env
    except ImportError:  # a tree from before tests/helpers
        from ringutil import backend_from_env

    from spark_hvd.core.backend import ReduceOp

    backend = backend_from_env()
    bfloat16 = dtype == "bfloat16"
    reduce_op = ReduceOp[op]
    out: dict = {}
    stop = threading.Event()
    if spin:
        threading.Thread(target=_spin, args=(stop,), daemon=True).start()
    profiler = cProfile.Profile(time.thread_time) if profile else None  # the calling thread's CPU only
    try:
        for nbytes in sizes:
            kind = np.dtype(np.uint16 if bfloat16 else dtype)
            buf = np.ones(nbytes // kind.itemsize, kind)  # ones: products and sums of floats stay finite for a while
            iters = max(5, min(300, (256 << 20) // nbytes))
            for _ in range(2):
                backend.allreduce(buf, reduce_op, bfloat16=bfloat16)
            backend.barrier()
            if profiler is not None:
                profiler.enable()
            wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(iters):
                backend.allreduce(buf, reduce_op, bfloat16=bfloat16)
            out[nbytes] = ((time.perf_counter() - wall) / iters, (time.process_time() - cpu) / iters,
                           (time.thread_time() - main) / iters)
            if profiler is not None:
                profiler.disable()
        backend.barrier()
    finally:
        stop.set()
        backend.close()
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile)
        out["profile"] = text.getvalue()
    return out


def _worker(n: int, sizes: list[int], hier: bool, shm: bool, profile: int, spin: bool, dtype: str = "float32",
            op: str = "SUM") -> None:
    """Run in a tree (cwd): spawn the ranks, print rank 0's profile (if any), then
    {size: [wall of the slowest rank, mean cpu, mean cpu of the calling thread]} as JSON."""
    sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests"), os.path.join(os.getcwd(), "tests", "core")]
    try:
        from helpers.ranks import run_ranks
    except ImportError:  # a tree from before tests/helpers (the "before" of a comparison)
        from ringutil import run_ranks

    env = (lambda r: {"SPARK_HVD_HOST_ID": f"host{2 * r // n}"}) if hier else {"SPARK_HVD_SHM": "1" if shm else "0"}
    results = run_ranks(_rank, n, env=env, args=(sizes, profile, spin, dtype, op), timeout=900)
    if profile:
        print(results[0]["profile"])
    print(json.dumps({s: [max(r[s][0] for r in results), sum(r[s][1] for r in results) / n,
                          sum(r[s][2] for r in results) / n] for s in sizes}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default=".", help="comma-separated repository checkouts to compare")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--sizes", default="4K,1M,16M,64M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hier", action="store_true", help="two simulated hosts (the hierarchical path)")
    parser.add_argument("--shm", action="store_true", help="shared memory among the N ranks of this host")
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="cProfile every rank (CPU clock); print rank 0's top K functions per tree")
    parser.add_argument("--spin", action="store_true", help="a thread running Python in every rank meanwhile")
    parser.add_argument("--dtype", default="float32", help="float16/32/64, bfloat16, int8..uint64 (default float32)")
    parser.add_argument("--op", default="SUM", type=str.upper, help="SUM, AVERAGE, MIN, MAX or PRODUCT (default SUM)")
    parser.add_argument("--envs", default="", help="';'-separated variants of 'VAR=VALUE,...' to alternate")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # sizes in bytes: run in a tree, print JSON
    args = parser.parse_args(argv)
    if args.worker:  # imports nothing of this tree's spark_hvd: the tree's own is imported from its directory
        _worker(args.np, [int(s) for s in args.worker.split(",")], args.hier, args.shm, args.profile, args.spin,
                args.dtype, args.op)
        return 0
    sys.path.insert(0, str(HERE.parents[1]))
    from benchmarks.allreduce import human, parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    variants = [dict(kv.split("=", 1) for kv in v.split(",") if kv) for v in args.envs.split(";")] or [{}]
    trees = [(str(Path(t).resolve()), env) for t in args.trees.split(",") for env in variants]
    def name(tree: tuple[str, dict[str, str]]) -> str:
        return tree[0] + "".join(f" {k}={v}" for k, v in tree[1].items())

    runs: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    profiles: dict[str, str] = {}
    for rnd in range(args.rounds):
        for tree, extra in trees[rnd % len(trees):] + trees[:rnd % len(trees)]:
            cmd = [sys.executable, "-W", "ignore", str(HERE), "--worker", ",".join(map(str, sizes)), "--np",
                   str(args.np), "--profile", str(args.profile)] + (["--hier"] if args.hier else []) + \
                (["--shm"] if args.shm else []) + (["--spin"] if args.spin else []) + \
                ["--dtype", args.dtype, "--op", args.op]
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", **extra}
            done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode:
                raise RuntimeError(f"{tree}: {done.stderr[-3000:]}")
            *profile, last = done.stdout.strip().splitlines()
            profiles[name((tree, extra))] = "\n".join(profile)
            for size, (wall, cpu, main) in json.loads(last).items():
                runs.setdefault((name((tree, extra)), int(size)), []).append((wall, cpu, main))
    for tree, text in profiles.items():
        if text.strip():
            print(f"# rank 0 of {tree}, cProfile (CPU clock), sizes {args.sizes} together, last round\n{text}")
    path = "hierarchical" if args.hier else "shared memory" if args.shm else "TCP ring"
    spinning = ", a thread running Python in every rank (CPU includes it)" if args.spin else ""
    print(f"# bare RingBackend, N={args.np}, {path}{spinning}, {args.dtype} {args.op}, median of "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.1f} at the end")
    print("| size | tree | wall per allreduce | cpu per allreduce per rank | of it, the calling thread's |\n"
          "|---|---|---|---|---|")
    for size in sizes:
        for tree in map(name, trees):
            walls, cpus, mains = zip(*runs[(tree, size)], strict=True)
            print(f"| {human(size)} | {tree} | {statistics.median(walls) * 1e3:.3f} ms | "
                  f"{statistics.median(cpus) * 1e3:.3f} ms | {statistics.median(mains) * 1e3:.3f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
