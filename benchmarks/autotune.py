"""Autotune on against off, in one invocation, for a starting setting that is not the best and for the defaults.

Each rank of ``spark-hvd-run -np N`` (TCP between the ranks, ``SPARK_HVD_SHM=0``, and the Python ring loop,
``SPARK_HVD_COMPILED_RING=0``: where the fusion threshold decides how many collectives a round takes; two ranks that
both run the compiled loop reduce a round's tensors in one collective whatever the threshold) trains a made-up
model: every step computes (a few numpy matmuls), submits ``--tensors`` gradients of ``--tensor-kib`` KiB
asynchronously, as a ``DistributedOptimizer``'s hooks do, and waits for them. Cases (``--cases``):

- ``small-fusion``: the user set ``SPARK_HVD_FUSION_THRESHOLD`` to one gradient's size, so every gradient is its own
  collective; the defaults (64 MiB) fuse a step's gradients into one. What autotune should find.
- ``defaults``: the defaults. Autotune should keep them, and lose no more than its tuning windows.

For each case, autotune off and on are run alternately (``--repeats`` each, the order flipped every repeat); each
run reports steps/s over all its steps (the tuning included) and over its last ``--tail`` steps (after tuning), and
rank 0's autotune log says what was kept. The table gives the medians and the on/off ratios; the load of the host
is printed with them.

    .venv/bin/python benchmarks/autotune.py [--np 2] [--steps 600] [--tail 150] [--repeats 3] [--backend torch]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time

CASES = {"small-fusion": lambda a: {"SPARK_HVD_FUSION_THRESHOLD": str(a.tensor_kib * 1024)}, "defaults": lambda a: {}}


def worker(args: argparse.Namespace) -> None:
    """One rank: ``args.steps`` steps; rank 0 writes the time of every step."""
    import numpy as np

    import spark_hvd.core as core

    core.init()
    rank = core.rank()
    grads = [np.random.default_rng(rank * 1000 + k).standard_normal(args.tensor_kib * 256).astype(np.float32)
             for k in range(args.tensors)]
    a = np.random.default_rng(rank).standard_normal((args.compute, args.compute)).astype(np.float32)
    core.barrier()
    ends = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        for _ in range(4):  # the step's compute
            a = np.tanh(a @ a * 1e-2)
        handles = [core.allreduce_async(g, name=f"grad{k}", op=core.ReduceOp.AVERAGE) for k, g in enumerate(grads)]
        for handle in handles:
            handle.wait()
        ends.append(time.perf_counter() - t0)
    core.barrier()
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(ends, f)
    core.shutdown()


def run(case: str, autotune: bool, args: argparse.Namespace, tmp: str) -> dict:
    from spark_hvd.runner.launch import run_local

    tag = f"{case}-{int(autotune)}-{time.monotonic_ns()}"
    out, log = os.path.join(tmp, tag + ".json"), os.path.join(tmp, tag + ".csv")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--result", out, "--steps", str(args.steps),
            "--tensors", str(args.tensors), "--tensor-kib", str(args.tensor_kib), "--compute", str(args.compute)]
    env = {"OMP_NUM_THREADS": "1", "SPARK_HVD_SHM": "0", "SPARK_HVD_COMPILED_RING": "0", **CASES[case](args)}
    if args.backend:
        env["SPARK_HVD_BACKEND"] = args.backend
    if autotune:
        env |= {"SPARK_HVD_AUTOTUNE": "1", "SPARK_HVD_AUTOTUNE_LOG": log}
    result = run_local(argv, args.np, env=env, timeout=args.timeout, capture=True, verbose=0)
    if result.returncode != 0:
        raise RuntimeError(f"{case} autotune={autotune} failed (exit {result.returncode}):\n"
                           + "\n".join(result.stderr[-30:]))
    with open(out) as f:
        ends = json.load(f)
    tail = ends[-1] - ends[-1 - args.tail]
    got = {"all": len(ends) / ends[-1], "tail": args.tail / tail, "kept": "", "windows": 0}
    if autotune:
        with open(log, newline="") as f:
            rows = list(csv.DictReader(f))
        best = [r for r in rows if r["trial"] == "best"]
        got["windows"] = sum(1 for r in rows if r["trial"] not in ("best", "reset"))
        got["kept"] = (f"{best[-1]['cycle_time_ms']} ms, {best[-1]['tensor_fusion_threshold']} MiB "
                       f"(x{best[-1]['ratio']})") if best else "unfinished"
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--tail", type=int, default=150, help="steps at the end timed apart (after the tuning)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tensors", type=int, default=64, help="gradients per step")
    p.add_argument("--tensor-kib", type=int, default=16, help="KiB per gradient")
    p.add_argument("--compute", type=int, default=128, help="side of the matrices multiplied per step")
    p.add_argument("--cases", default="small-fusion,defaults")
    p.add_argument("--backend", help="SPARK_HVD_BACKEND (default: the built-in ring; 'torch': gloo)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    cases = args.cases.split(",")
    loads = [os.getloadavg()[0]]
    runs: dict[tuple[str, bool], list[dict]] = {(c, on): [] for c in cases for on in (False, True)}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for case in cases:
                for on in ((False, True) if rep % 2 == 0 else (True, False)):  # alternate, flip the order
                    got = run(case, on, args, tmp)
                    runs[(case, on)].append(got)
                    loads.append(os.getloadavg()[0])
                    print(f"repeat {rep} {case:12s} autotune {'on ' if on else 'off'}  all {got['all']:7.1f} "
                          f"steps/s  last {args.tail} {got['tail']:7.1f} steps/s  {got['kept']}  "
                          f"(load {loads[-1]:.1f})", flush=True)
    print(f"\nnp={args.np} over TCP ({args.backend or 'ring'} backend), {args.steps} steps of {args.tensors} x "
          f"{args.tensor_kib} KiB gradients "
          f"(+ {args.compute}x{args.compute} matmuls), medians of {args.repeats} alternated runs; "
          f"1-minute load {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores\n")
    print("| case | off: all / last steps/s | on: all / last steps/s | on/off all | on/off last | kept |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in cases:
        off, on = runs[(case, False)], runs[(case, True)]
        med = {k: (statistics.median(r[k] for r in off), statistics.median(r[k] for r in on)) for k in ("all", "tail")}
        kept = "; ".join(r["kept"] for r in on)
        print(f"| {case} | {med['all'][0]:.1f} / {med['tail'][0]:.1f} | {med['all'][1]:.1f} / {med['tail'][1]:.1f} "
              f"| {med['all'][1] / med['all'][0]:.2f} | {med['tail'][1] / med['tail'][0]:.2f} | {kept} |")
    print("\nall runs, steps/s (all, last): " + "; ".join(
        f"{c} {'on' if on else 'off'}: " + ", ".join(f"{r['all']:.1f}/{r['tail']:.1f}" for r in runs[(c, on)])
        for c, on in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
