"""spark_hvd.mxnet against its peers on this machine, interleaved (issue 41)::

    /work/venvs/mxnet/bin/python benchmarks/mxnet_binding.py [--calls 200] [--rounds 3] [--steps 60]
        [--only allreduce|loop|phases] [--kinds hvd,hvd_zero,dist,dist_local,single]

(an environment with MXNet 1.9.1, numpy < 1.24 and torch: docs/mxnet.md). Two measurements, and a profile:

- allreduce (Sum) of one float32 array at 4 KiB and 16 MiB at 2 ranks, one ``spark-hvd-run -np 2`` job:
  ``spark_hvd.mxnet.allreduce`` (a new NDArray) and ``allreduce_`` (in place) on an ``mx.nd.NDArray`` vs
  ``spark_hvd.torch.allreduce`` / ``allreduce_`` on a ``torch.Tensor``, in a random order each round of four calls
  (the same on both ranks: a fixed rotation let a kind's position decide up to 1.5x of its time at 4 KiB); the
  median wall time per call and rank 0's process CPU time per call (mean, all its
  threads). The MXNet calls end with ``wait_to_read()``, the torch ones need none.
- a Gluon loop (an MLP 784-512-512-10, batch 64 per process, SGD with momentum) at 2 processes: samples/s with
  ``spark_hvd.mxnet.DistributedTrainer`` (``spark-hvd-run -np 2``) vs MXNet's own ``kvstore="dist_sync"`` (a
  scheduler, one server and two workers on localhost, ps-lite; Gluon's default there updates the weights on the
  server, once per step, and ``update_on_kvstore=False`` on every worker, as Horovod does), and one process alone
  (``kvstore=None``), rounds rotating; the median of the rounds. ``hvd`` is ``DistributedTrainer``'s default (one
  allreduce of the gradient buffer, every rank updating every weight); ``hvd_zero`` is ``sharded_update=True``
  (reduce-scatter of the buffer, each rank updating its half of the weights, allgather: ``spark_hvd/mxnet/zero.py``);
  ``hvd_each`` (with ``--kinds``) reduces each gradient's own array as before the buffer (``_fuse`` off). With the
  samples/s, the job's CPU time per step (every thread of the workers, and of dist_sync's server and scheduler) and
  that of the workers' Python threads.
- ``--only phases`` (not in the default run): where the loop's step goes at 2 ranks, over shared memory and over
  TCP (``SPARK_HVD_SHM=0``), for the default trainer and the sharded update: wall ms a step in forward + backward,
  ``trainer.step`` and the update MXNet runs after it; the core's collectives inside the step; the loop's own step
  time of the default, the sharded update, and the sharded update with its reduce-scatter and allgather replaced by
  one in-place allreduce of the buffer (a timing proxy of ideal collectives: the same bytes; its weights are
  wrong); the same collectives alone on the 2.7 MB gradient buffer; the SGD-with-momentum update alone.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1", PYTHONPATH=str(ROOT),
           PYTHONWARNINGS="ignore::DeprecationWarning")
for _k in [k for k in ENV if k.startswith(("SPARK_HVD_", "DMLC_"))]:
    del ENV[_k]
BATCH = 64


def _mean_ms(values: list[float]) -> float:
    return sum(values) / len(values) * 1e3


# ------------------------------------------------------------------------------------------------ allreduce

def allreduce_worker(calls: int) -> None:
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    import numpy as np
    import torch

    import spark_hvd.mxnet as hmx
    import spark_hvd.torch as hth

    torch.set_num_threads(1)
    hmx.init()
    for nbytes in (4096, 16 << 20):
        n = nbytes // 4
        t_mx = mx.nd.array(np.ones(n, np.float32))
        t_torch = torch.ones(n)
        reps = calls if nbytes <= 4096 else max(calls // 20, 5)
        kinds = ("mx", "mx_", "torch", "torch_")
        times: dict[str, list[float]] = {k: [] for k in kinds}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        order = random.Random(nbytes)  # the same order on both ranks
        for i in range(reps + 3):
            for kind in order.sample(kinds, len(kinds)):
                start, start_cpu = time.perf_counter(), time.process_time()
                if kind == "mx":
                    hmx.allreduce(t_mx, op=hmx.Sum, name="bench.mx").wait_to_read()
                elif kind == "mx_":
                    hmx.allreduce_(t_mx, op=hmx.Sum, name="bench.mx_").wait_to_read()
                elif kind == "torch":
                    hth.allreduce(t_torch, op=hth.Sum, name="bench.torch")
                else:
                    hth.allreduce_(t_torch, op=hth.Sum, name="bench.torch_")
                if i >= 3:
                    times[kind].append(time.perf_counter() - start)
                    cpu[kind].append(time.process_time() - start_cpu)
                if kind == "mx_":
                    t_mx[:] = 1.0
                    t_mx.wait_to_read()  # MXNet's queued write done outside the timed call, as torch's fill_
                elif kind == "torch_":
                    t_torch.fill_(1.0)
        if hmx.rank() == 0:
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"ALLREDUCE {nbytes} B ({reps} calls each), median ms per call: spark_hvd.mxnet.allreduce "
                  f"{med['mx']:.3f}, spark_hvd.torch.allreduce {med['torch']:.3f} (mx/torch "
                  f"{med['mx'] / med['torch']:.2f}); allreduce_ mx {med['mx_']:.3f}, torch {med['torch_']:.3f} "
                  f"(mx_/torch_ {med['mx_'] / med['torch_']:.2f}); CPU ms per call (mean): mx "
                  f"{_mean_ms(cpu['mx']):.3f}, torch {_mean_ms(cpu['torch']):.3f}, mx_ {_mean_ms(cpu['mx_']):.3f}, "
                  f"torch_ {_mean_ms(cpu['torch_']):.3f}", flush=True)
    hmx.shutdown()


def allreduce(calls: int) -> None:
    out = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "2", sys.executable,
                          str(Path(__file__).resolve()), "--worker", "allreduce", "--calls", str(calls)],
                         env=ENV, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if "ALLREDUCE" in line:
            print(line.split("ALLREDUCE", 1)[1].strip(), flush=True)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)


# ----------------------------------------------------------------------------------------------- Gluon loop

def mlp() -> Any:
    """The loop's model, the same on every rank: an MLP 784-512-512-10 (2.7 MB of float32 weights), hybridized."""
    import mxnet as mx

    mx.random.seed(0)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(512, activation="relu", in_units=784),
            mx.gluon.nn.Dense(512, activation="relu", in_units=512), mx.gluon.nn.Dense(10, in_units=512))
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True)
    return net


def loop_worker(kind: str, steps: int) -> None:
    """One process of the loop: ``hvd`` (spark_hvd), ``dist`` / ``dist_local`` (a dist_sync worker, the update on
    the server / on the worker) or ``single``."""
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    import numpy as np

    rng = np.random.default_rng(0)
    x = mx.nd.array(rng.standard_normal((BATCH, 784)).astype(np.float32))
    y = mx.nd.array(rng.integers(0, 10, BATCH).astype(np.float32))
    net = mlp()
    params = net.collect_params()
    opt = {"learning_rate": 0.01, "momentum": 0.9}
    if kind.startswith("hvd"):
        import spark_hvd.mxnet as hvd

        hvd.init()
        hvd.broadcast_parameters(params)
        trainer = hvd.DistributedTrainer(params, "sgd", opt, sharded_update=kind == "hvd_zero")
        if kind == "hvd_each":  # the trainer before its gradients shared one buffer: one allreduce per gradient
            trainer._fuse, trainer._flat = False, None
        rank = hvd.rank()
    elif kind in ("dist", "dist_local"):  # dist: the server updates (Gluon's default); dist_local: each worker
        kv = mx.kv.create("dist_sync")
        trainer = mx.gluon.Trainer(params, "sgd", opt, kvstore=kv, update_on_kvstore=kind == "dist")
        rank = kv.rank
    else:
        trainer = mx.gluon.Trainer(params, "sgd", opt, kvstore=None)
        rank = 0
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()

    def step() -> None:
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(BATCH)

    for _ in range(5):
        step()
    mx.nd.waitall()
    print("START", flush=True)  # the dist_sync driver reads the server's CPU time from here to the RATE lines
    start, start_cpu, start_main = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(steps):
        step()
    mx.nd.waitall()
    rate = steps * BATCH / (time.perf_counter() - start)
    cpu = (time.process_time() - start_cpu) / steps * 1e3
    main_cpu = (time.thread_time() - start_main) / steps * 1e3
    print(f"RATE {rate:.1f} CPU {cpu:.3f} RANK {rank} MAIN {main_cpu:.3f}", flush=True)
    if kind == "hvd_zero":
        assert trainer._zero is not None, f"the default did not shard: {trainer._unsharded_why}"
    if kind.startswith("hvd"):
        hvd.shutdown()


def _rate(out: str) -> tuple[float, float, float]:
    """(rank 0's samples/s, the workers' CPU ms per step summed, that of their Python threads) from the workers'
    ``RATE`` lines."""
    rate, cpu, main = 0.0, 0.0, 0.0
    for line in out.splitlines():
        if "RATE" in line:
            fields = line.split("RATE", 1)[1].split()
            cpu += float(fields[2])
            main += float(fields[6])
            if fields[4] == "0":
                rate = float(fields[0])
    return rate, cpu, main


def loop_round(kind: str, steps: int) -> tuple[float, float, float]:
    """Samples/s of one process (rank 0) of a 2-process run (one process for ``single``); the job's CPU
    milliseconds per step: the workers' threads, with dist_sync's server and scheduler from the moment both workers
    start timing to the moment both are done (the server sums, and with Gluon's default updates, for the workers);
    and the workers' Python threads alone (forward and backward queued, the trainer's step; MXNet's worker thread
    computes)."""
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--steps", str(steps)]
    if kind.startswith("hvd"):
        out = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "2", *me], env=ENV,
                             capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        return _rate(out.stdout)
    if kind == "single":
        return _rate(subprocess.run(me, env=ENV, capture_output=True, text=True, timeout=900, check=True).stdout)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(ENV, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_SERVER="1",
                DMLC_NUM_WORKER="2", PS_VERBOSE="0")
    serve = [sys.executable, "-c", "import warnings; warnings.simplefilter('ignore'); import mxnet"]
    helpers = [subprocess.Popen(serve, env=dict(base, DMLC_ROLE=role), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for role in ("scheduler", "server")]
    workers = [subprocess.Popen(me, env=dict(base, DMLC_ROLE="worker"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    lines: list[list[str]] = [[], []]
    errs: list[list[str]] = [[], []]
    seen = {"START": threading.Semaphore(0), "RATE": threading.Semaphore(0)}

    def read(i: int) -> None:
        for line in workers[i].stdout:
            lines[i].append(line)
            for word, sem in seen.items():
                if line.startswith(word):
                    sem.release()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    readers += [threading.Thread(target=lambda i=i: errs[i].extend(workers[i].stderr), daemon=True)
                for i in range(2)]
    for t in readers:
        t.start()
    helper_cpu = []  # the scheduler's and server's CPU seconds when both workers start timing, and when both end
    try:
        for word in ("START", "RATE"):
            for _ in range(2):
                if not seen[word].acquire(timeout=900):
                    raise RuntimeError(f"no {word} line from a dist_sync worker: {''.join(sum(errs, []))[-3000:]}")
            helper_cpu.append(sum(_proc_cpu(p.pid) for p in helpers))
        for w in workers:
            w.wait(timeout=900)
        for t in readers:
            t.join(timeout=60)
    finally:
        for p in (*workers, *helpers):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    for w, err in zip(workers, errs, strict=True):
        if w.returncode != 0:
            raise RuntimeError("".join(err)[-3000:])
    rate, cpu, main = _rate("".join(sum(lines, [])))
    return rate, cpu + (helper_cpu[1] - helper_cpu[0]) / steps * 1e3, main


def _proc_cpu(pid: int) -> float:
    """The user + system CPU seconds of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


KINDS = ("hvd", "hvd_zero", "dist", "dist_local", "single")


def loop(rounds: int, steps: int, kinds: tuple[str, ...] = KINDS) -> None:
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    cpus: dict[str, list[float]] = {k: [] for k in kinds}
    mains: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            rate, cpu, main = loop_round(kind, steps)
            rates[kind].append(rate)
            cpus[kind].append(cpu)
            mains[kind].append(main)
            print(f"round {r} {kind} {rate:.1f} samples/s per process, the job's CPU {cpu:.2f} ms per step (the "
                  f"workers' Python threads {main:.2f})", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print("the job's CPU ms per step, all processes (median; the workers' Python threads'): " + ", ".join(
        f"{k} {statistics.median(cpus[k]):.2f} ({statistics.median(mains[k]):.2f})" for k in kinds), flush=True)
    print(f"Gluon loop, samples/s per process (median of {rounds}): " + ", ".join(f"{k} {med[k]:.1f}" for k in kinds)
          + "; " + ", ".join(f"{h}/{k} {med[h] / med[k]:.2f}x" for h in kinds if h.startswith("hvd")
                             for k in kinds if k != h and (k == "hvd" or not k.startswith("hvd")))
          + " (hvd: DistributedTrainer's default, one allreduce; hvd_zero: sharded_update=True; dist: "
          "kvstore dist_sync, the update on the server; dist_local: dist_sync with update_on_kvstore=False)",
          flush=True)


# ---------------------------------------------------------------------------------- where a step's time goes

def phases_worker(steps: int) -> None:
    """One rank of ``--only phases``: the loop's step taken apart for the default trainer and the sharded update
    (wall ms per step: forward + backward waited for, ``trainer.step``, the update MXNet still runs after it), the
    core's collectives inside the sharded step; the loop's own step time (nothing waited for inside) of the default,
    the sharded update and a timing proxy of the sharded update over ideal collectives; the same collectives alone
    on the 2.7 MB buffer, and the SGD-with-momentum update alone."""
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    import numpy as np

    import spark_hvd.core as core
    import spark_hvd.mxnet as hvd

    hvd.init()
    rng = np.random.default_rng(0)
    x = mx.nd.array(rng.standard_normal((BATCH, 784)).astype(np.float32))
    y = mx.nd.array(rng.integers(0, 10, BATCH).astype(np.float32))
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    inside: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[name] = inside.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    real = {k: getattr(core, k) for k in ("allreduce", "reducescatter", "allgather")}
    for sharded in (False, True):
        net = mlp()
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                                         prefix=f"phases{int(sharded)}.", sharded_update=sharded)
        spent = {"forward+backward": 0.0, "trainer.step": 0.0, "update after step": 0.0}
        for i in range(5 + steps):
            if i == 5:
                spent = dict.fromkeys(spent, 0.0)
                inside.clear()
                for k, fn in real.items():
                    setattr(core, k, timed(k, fn))
            t0 = time.perf_counter()
            with mx.autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            mx.nd.waitall()
            t1 = time.perf_counter()
            trainer.step(BATCH)
            t2 = time.perf_counter()
            mx.nd.waitall()
            t3 = time.perf_counter()
            for k, v in zip(spent, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                spent[k] += v
        for k, fn in real.items():
            setattr(core, k, fn)
        print(f"PHASES rank {hvd.rank()} {'sharded' if sharded else 'default'}: "
              + ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in {**spent, **inside}.items()) + " ms a step",
              flush=True)
    # the loop's own step (nothing waited for inside it), 3 rounds alternated; the proxy is the sharded step with its
    # reduce-scatter and allgather replaced by one in-place allreduce of the buffer (the same bytes), the shard a
    # view of it and the allgather's result a ready array: a timing bound for ideal collectives, its weights wrong
    walls: dict[str, list[float]] = {"default": [], "sharded": [], "sharded with one allreduce (proxy)": []}
    ready: dict[str, Any] = {}

    def proxy_scatter(buf: Any, **_: Any) -> Any:
        core.allreduce(buf, name="p.proxy")
        ready.setdefault("full", np.empty_like(buf))
        lo, hi = ready["trainer"]._zero.bounds[hvd.rank()], ready["trainer"]._zero.bounds[hvd.rank() + 1]
        return buf[lo:hi]

    for r in range(3):
        for kind in walls:
            net = mlp()
            trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                                             prefix=f"wall{r}{kind[:3]}.", sharded_update=kind != "default")
            ready["trainer"] = trainer
            if "proxy" in kind:
                core.reducescatter, core.allgather = proxy_scatter, lambda *_, **__: ready["full"]
            for i in range(5 + steps):
                if i == 5:
                    mx.nd.waitall()
                    start = time.perf_counter()
                with mx.autograd.record():
                    loss = loss_fn(net(x), y)
                loss.backward()
                trainer.step(BATCH)
            mx.nd.waitall()
            walls[kind].append((time.perf_counter() - start) / steps * 1e3)
            core.reducescatter, core.allgather = real["reducescatter"], real["allgather"]
    print(f"PHASES rank {hvd.rank()} the loop's wall ms a step, 3 rounds alternated: " + ", ".join(
        f"{k} {'/'.join(f'{v:.2f}' for v in vs)}" for k, vs in walls.items()), flush=True)
    buf = np.ones(trainer._flat.buffers[0].size, np.float32)
    alone = {"allreduce": lambda: core.allreduce(buf, name="p.a"),
             "reducescatter": lambda: core.reducescatter(buf, name="p.r"),
             "allgather of half": lambda: core.allgather(buf[:buf.size // 2], name="p.g")}
    out = {}
    for k, fn in alone.items():
        for _ in range(3):
            fn()
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        out[k] = (time.perf_counter() - t) / steps * 1e3
    params = list(net.collect_params().values())
    opt = trainer._optimizer
    states = [opt.create_state(i, p.data()) for i, p in enumerate(params)]
    t = time.perf_counter()
    for _ in range(steps):
        for i, p in enumerate(params):
            opt.update(i, p.data(), p.grad(), states[i])
        mx.nd.waitall()
    out["SGD-momentum update of every weight"] = (time.perf_counter() - t) / steps * 1e3
    print(f"PHASES rank {hvd.rank()} alone on the {buf.nbytes / 1e6:.1f} MB buffer: "
          + ", ".join(f"{k} {v:.2f}" for k, v in out.items()) + " ms", flush=True)
    hvd.shutdown()


def phases(steps: int) -> None:
    for shm in ("1", "0"):
        out = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "2", sys.executable,
                              str(Path(__file__).resolve()), "--worker", "phases", "--steps", str(steps)],
                             env=dict(ENV, SPARK_HVD_SHM=shm), capture_output=True, text=True, timeout=900)
        for line in out.stdout.splitlines():
            if "PHASES" in line:
                print(("shared memory: " if shm == "1" else "TCP (SPARK_HVD_SHM=0): ")
                      + line.split("PHASES", 1)[1].strip(), flush=True)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--only", choices=["allreduce", "loop", "phases"],
                   help="run one of the measurements (phases: where a step's time goes, default vs sharded)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"the loop's contenders, comma-separated (of {', '.join(KINDS)}, hvd_each)")
    p.add_argument("--worker", choices=["allreduce", "phases", *KINDS, "hvd_each"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "allreduce":
        allreduce_worker(args.calls)
        return
    if args.worker == "phases":
        phases_worker(args.steps)
        return
    if args.worker:
        loop_worker(args.worker, args.steps)
        return
    print(f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    if args.only in (None, "allreduce"):
        allreduce(args.calls)
    if args.only in (None, "loop"):
        loop(args.rounds, args.steps, tuple(args.kinds.split(",")))
    if args.only == "phases":
        phases(args.steps)
    print(f"load average at end {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
