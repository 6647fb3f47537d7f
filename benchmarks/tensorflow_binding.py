"""spark_hvd.tensorflow against its peers on this machine, interleaved (issue 27)::

    .venv/bin/python benchmarks/tensorflow_binding.py [--rounds 3] [--steps 60] [--calls 200]
        [--only loop|allreduce|overhead]

Two measurements, each alternating the contenders round by round and printing the median of the rounds:

- a TF2 custom loop (an MLP, 784-512-512-10, batch 64 per rank, plain SGD on ``tf.Variable``s, the step in
  ``tf.function``) at 2 ranks: steps/s with ``spark_hvd.tensorflow.DistributedGradientTape`` (``spark-hvd-run
  -np 2``) vs ``tf.distribute.MultiWorkerMirroredStrategy`` (two workers on localhost, TF_CONFIG, its collective
  ring over gRPC; the gradients summed by ``ReplicaContext.all_reduce``, the same update);
- allreduce (Sum, eager) of one float32 tensor at 4 KiB and 16 MiB at 2 ranks through the public API (wall time per
  call, median, and rank 0's process CPU time per call, mean: all its threads, the engine's included):
  ``spark_hvd.tensorflow.allreduce`` on a ``tf.Tensor`` (a new tensor, as Horovod's TF API has no in-place form)
  vs ``spark_hvd.torch.allreduce`` (a new tensor too) and ``spark_hvd.torch.allreduce_`` (in place), rotating call by
  call inside one job; median per call.

``--only overhead``: the bindings' own cost per call, in one process of a job of one rank (the engine reduces
nothing): ``spark_hvd.tensorflow.allreduce`` and ``grouped_allreduce`` of three tensors vs ``spark_hvd.torch``'s,
at 4 KiB and 16 MiB, rotating call by call; median per call.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
for _k in [k for k in ENV if k.startswith("SPARK_HVD_")]:
    del ENV[_k]


def _model_and_step(tf: object, distributed: str, steps: int) -> float:
    """Build the MLP, run ``steps`` timed steps after 5 warm-up steps; returns steps/s."""
    import numpy as np

    strategy = tf.distribute.MultiWorkerMirroredStrategy() if distributed == "mwms" else None  # before any op
    rng = np.random.default_rng(0)
    sizes = [784, 512, 512, 10]
    x = tf.constant(rng.standard_normal((64, 784)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, 64).astype("int64"))

    def variables() -> list:
        return [tf.Variable(rng.standard_normal((a, b)).astype("float32") * 0.05) for a, b in zip(
            sizes[:-1], sizes[1:], strict=True)]

    def loss_of(ws: list) -> object:
        h = x
        for w in ws[:-1]:
            h = tf.nn.relu(h @ w)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ ws[-1]))

    if distributed == "hvd":
        import spark_hvd.tensorflow as hvd

        hvd.init()
        ws = variables()

        @tf.function
        def step() -> object:
            with tf.GradientTape() as tape:
                loss = loss_of(ws)
            grads = hvd.DistributedGradientTape(tape).gradient(loss, ws)
            for w, g in zip(ws, grads, strict=True):
                w.assign_sub(0.01 * g)
            return loss
        run = step
    else:
        with strategy.scope():
            ws = variables()

        def replica_step() -> object:
            with tf.GradientTape() as tape:
                loss = loss_of(ws)
            grads = tape.gradient(loss, ws)
            ctx = tf.distribute.get_replica_context()
            grads = ctx.all_reduce(tf.distribute.ReduceOp.MEAN, grads)
            for w, g in zip(ws, grads, strict=True):
                w.assign_sub(0.01 * g)
            return loss

        @tf.function
        def run() -> object:
            return strategy.run(replica_step)
    for _ in range(5):
        run()
    start = time.perf_counter()
    for _ in range(steps):
        out = run()
    tf.reduce_sum(out).numpy()  # the last step done
    return steps / (time.perf_counter() - start)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loop_round(kind: str, steps: int) -> float:
    """One 2-rank run of the loop with ``kind`` (hvd or mwms); rank 0's steps/s."""
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--steps", str(steps)]
    if kind == "hvd":
        out = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "2", *me], env=ENV,
                             capture_output=True, text=True, timeout=600)
        procs_out = [out.stdout]
        ok = out.returncode == 0
        if not ok:
            print(out.stderr[-3000:], file=sys.stderr)
    else:
        ports = [_free_port(), _free_port()]
        procs = []
        for i in range(2):
            cfg = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": i}}
            procs.append(subprocess.Popen(me, env=dict(ENV, TF_CONFIG=json.dumps(cfg)), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        results = [p.communicate(timeout=600) for p in procs]
        procs_out = [r[0] for r in results]
        ok = all(p.returncode == 0 for p in procs)
        if not ok:
            print(results[0][1][-3000:], file=sys.stderr)
    rates = [float(line.split("RATE ", 1)[1]) for o in procs_out for line in o.splitlines() if "RATE " in line]
    if not ok or not rates:
        raise RuntimeError(f"{kind} run failed: {procs_out}")
    return min(rates)  # the slower rank sets the job's pace


def _mean_ms(seconds: list[float]) -> float:
    return 1e3 * sum(seconds) / len(seconds)


def allreduce_worker(calls: int) -> None:
    import numpy as np
    import tensorflow as tf
    import torch

    import spark_hvd.tensorflow as htf
    import spark_hvd.torch as hth

    torch.set_num_threads(1)
    htf.init()
    for nbytes in (4096, 16 << 20):
        n = nbytes // 4
        t_tf = tf.constant(np.ones(n, np.float32))
        t_torch = torch.ones(n)
        reps = calls if nbytes <= 4096 else max(calls // 20, 5)
        kinds = ("tf", "torch", "torch_")
        times: dict[str, list[float]] = {k: [] for k in kinds}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}  # this rank's process CPU time (all its threads)
        for i in range(reps + 3):
            for kind in kinds[i % 3:] + kinds[:i % 3]:  # rotated: each goes first a third of the time
                start, start_cpu = time.perf_counter(), time.process_time()
                if kind == "tf":
                    htf.allreduce(t_tf, op=htf.Sum, name="bench.tf").numpy()
                elif kind == "torch":
                    hth.allreduce(t_torch, op=hth.Sum, name="bench.torch")
                else:
                    hth.allreduce_(t_torch, op=hth.Sum, name="bench.torch_")
                if i >= 3:
                    times[kind].append(time.perf_counter() - start)
                    cpu[kind].append(time.process_time() - start_cpu)
                if kind == "torch_":
                    t_torch.fill_(1.0)
        if htf.rank() == 0:
            med = {k: statistics.median(v) for k, v in times.items()}
            tf_ms, torch_ms, inplace_ms = (med[k] * 1e3 for k in kinds)
            print(f"ALLREDUCE {nbytes} B: spark_hvd.tensorflow.allreduce {tf_ms:.3f} ms, spark_hvd.torch.allreduce "
                  f"{torch_ms:.3f} ms (tf/torch time {tf_ms / torch_ms:.2f}), spark_hvd.torch.allreduce_ "
                  f"{inplace_ms:.3f} ms (tf/torch_ {tf_ms / inplace_ms:.2f}); CPU per call (mean) tf "
                  f"{_mean_ms(cpu['tf']):.3f} ms, torch {_mean_ms(cpu['torch']):.3f} ms (tf/torch CPU "
                  f"{_mean_ms(cpu['tf']) / _mean_ms(cpu['torch']):.2f}), torch_ {_mean_ms(cpu['torch_']):.3f} ms",
                  flush=True)
    htf.shutdown()


def overhead(calls: int) -> None:
    """The bindings' cost per call at size 1 (see the module docstring)."""
    import numpy as np
    import tensorflow as tf
    import torch

    import spark_hvd.tensorflow as htf
    import spark_hvd.torch as hth

    torch.set_num_threads(1)
    htf.init()
    for nbytes in (4096, 16 << 20):
        n = nbytes // 4
        t_tf, t_torch = tf.constant(np.ones(n, np.float32)), torch.ones(n)
        runs = {
            "tf": lambda a=t_tf: htf.allreduce(a, op=htf.Sum, name="o.tf"),
            "torch": lambda a=t_torch: hth.allreduce(a, op=hth.Sum, name="o.torch"),
            "tf x3": lambda a=t_tf: htf.grouped_allreduce([a, a, a], op=htf.Sum, name="o.tf3"),
            "torch x3": lambda a=t_torch: hth.grouped_allreduce([a, a, a], op=hth.Sum, name="o.torch3"),
        }
        kinds = list(runs)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        reps = calls if nbytes <= 4096 else max(calls // 10, 10)
        for i in range(reps + 3):
            for kind in kinds[i % 4:] + kinds[:i % 4]:
                start = time.perf_counter()
                runs[kind]()
                if i >= 3:
                    times[kind].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"OVERHEAD {nbytes} B, one rank, ms per call: tf {med['tf']:.3f}, torch {med['torch']:.3f} "
              f"(tf/torch {med['tf'] / med['torch']:.2f}); grouped x3: tf {med['tf x3']:.3f}, torch "
              f"{med['torch x3']:.3f} ({med['tf x3'] / med['torch x3']:.2f})", flush=True)
    htf.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--only", choices=["loop", "allreduce", "overhead"], help="run one of the measurements")
    p.add_argument("--worker", choices=["hvd", "mwms", "allreduce"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker in ("hvd", "mwms"):
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
        print(f"RATE {_model_and_step(tf, args.worker, args.steps):.3f}", flush=True)
        if args.worker == "hvd":
            import spark_hvd.tensorflow as hvd

            hvd.shutdown()
        return
    if args.worker == "allreduce":
        allreduce_worker(args.calls)
        return
    print(f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    if args.only != "allreduce":
        loop(args.rounds, args.steps)
    if args.only in (None, "allreduce"):
        allreduce(args.calls)
    if args.only == "overhead":
        overhead(args.calls)
    print(f"load average at end {os.getloadavg()[0]:.1f}", flush=True)


def loop(rounds: int, steps: int) -> None:
    """The TF2 loop, spark_hvd.tensorflow and MultiWorkerMirroredStrategy alternating round by round."""
    rates: dict[str, list[float]] = {"hvd": [], "mwms": []}
    for r in range(rounds):
        for kind in ("hvd", "mwms") if r % 2 == 0 else ("mwms", "hvd"):
            rates[kind].append(loop_round(kind, steps))
            print(f"round {r} {kind} {rates[kind][-1]:.2f} steps/s", flush=True)
    hvd, mwms = statistics.median(rates["hvd"]), statistics.median(rates["mwms"])
    print(f"TF2 loop at 2 ranks: spark_hvd.tensorflow {hvd:.2f} steps/s, MultiWorkerMirroredStrategy {mwms:.2f} "
          f"steps/s (median of {rounds}); ratio {hvd / mwms:.2f}x", flush=True)


def allreduce(calls: int) -> None:
    """The allreduce of one tensor at 4 KiB and 16 MiB, TF vs torch, in one 2-rank job."""
    out = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "2", sys.executable,
                          str(Path(__file__).resolve()), "--worker", "allreduce", "--calls", str(calls)],
                         env=ENV, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if "ALLREDUCE" in line:
            print(line.split("ALLREDUCE", 1)[1].strip(), flush=True)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)


if __name__ == "__main__":
    main()
