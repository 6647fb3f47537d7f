"""Training steps/s with step checkpoints every 50 steps: background upload vs synchronous upload vs none.

One process plays rank 0 of a one-rank run: the estimators' own ``RankRun`` (step trigger, local snapshot,
``BackgroundWriter``, ``write_step_checkpoint`` into a real local store with fsync and manifest) around a plain
torch loop (forward, backward, SGD step) on a model of ~100 MB of state (a 5000 x 5000 float32 ``Linear`` is
95 MiB of weights; SGD without momentum adds no state). What is timed is the loop: steps/s over ``--steps`` steps,
the modes interleaved ``--repeats`` times so the machine's load hits them alike. The wait for ``async``'s last
upload after the loop (what the end of a fit pays once) is reported apart as ``end_wait_s``; choose ``--steps``
not a multiple of ``--every`` so that no checkpoint falls on the last step. Each run also says where its loop time
went: the median step, the checkpointing steps' own times, and the other steps' time above the median (``async``'s
upload competing with training shows there).

``--store local`` (the default) commits into a temporary directory; ``--store s3`` into a bucket of a moto S3 server
(``moto_server`` beside this Python, started for the run and stopped after it) through the ``s3://`` fsspec store,
i.e. every checkpoint is uploaded over HTTP(S) to a real S3 API. Where that server runs decides what is modelled:

- by default on a free port of this host, sharing its cores with training (a worst case: a real S3 runs
  elsewhere, and moto's Python server needs about as much CPU per upload as the client);
- ``--pin TRAIN,SERVER`` pins this process (every thread it starts, so training and the upload client) to CPU
  ``TRAIN``, and the server (and, under ``--link``, nothing else of it) to CPU ``SERVER``: the "remote" S3 gets a
  core of its own while the upload's client CPU stays on training's core, as it would on a training host;
- ``--link RATE`` (root, Linux) runs the server in a simulated host (network + UTS namespaces,
  ``tests/multihost/simhosts.py``) and this measurement in another, joined by a ``tc tbf`` link of ``RATE``
  (``1gbit``...), so an upload takes the link's wall time (no latency: this kernel has no ``netem``);
- ``--tls``: the server speaks HTTPS (self-signed), as a real S3 does; over plain HTTP botocore also hashes every
  payload (SHA-256) to sign it, which it skips over HTTPS when a checksum header is sent.

Each run reports the training thread's CPU time and the CPU time of the process's other threads (the upload
client: s3fs/aiobotocore, checksums, the store's bookkeeping), so what the upload costs the training core is
measured, not inferred.

Prints one JSON line per run and a summary line with each mode's median steps/s and its ratio to ``none``, and its
median CPU seconds (all threads: training, snapshot, upload client) with ``cpu_vs_none`` = none's CPU over the
mode's: the steps/s ratio where the loop and the upload client have one core to themselves, which the machine's
load moves far less than the wall-clock ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

TESTS = Path(__file__).resolve().parents[1] / "tests"
BUCKET = "bench-checkpoints"


@contextlib.contextmanager
def moto_s3_store(log_dir: str, args: argparse.Namespace) -> Iterator[Any]:
    """A store in a bucket of a moto S3 server: the one at ``--moto-endpoint``, else one started on a free local
    port (pinned to the ``--pin`` server CPU), stopped on exit."""
    sys.path.insert(0, str(TESTS))
    import s3fs
    from helpers.moto_s3 import MOTO, moto_s3_endpoint, s3_options, wait_answering

    from spark_hvd.store import Store

    if not os.path.exists(MOTO):
        raise SystemExit(f"--store s3 needs moto_server beside {sys.executable}")
    with contextlib.ExitStack() as stack:
        url = args.moto_endpoint
        if url:
            wait_answering(url)
        else:
            url = stack.enter_context(moto_s3_endpoint(os.path.join(log_dir, "moto.log"), tls=args.tls,
                                                       cpu=args.pin[1] if args.pin else None))
        s3fs.S3FileSystem(**s3_options(url), skip_instance_cache=True).mkdir(BUCKET)
        yield Store.create(f"s3://{BUCKET}/store", **s3_options(url))


def pin_this_process(cpu: int) -> None:
    """Every thread of this process (and those it starts later) on ``cpu`` only."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu})


def run_between_simulated_hosts(args: argparse.Namespace, argv: list[str]) -> int:
    """``--link``: the moto server in simulated host 1, this benchmark (``argv`` less ``--link``) in host 0."""
    sys.path.insert(0, str(TESTS))
    sys.path.insert(0, str(TESTS / "multihost"))
    from helpers.moto_s3 import moto_argv, stop
    from simhosts import SimHosts, install_teardown, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"--link: {reason}")
    install_teardown()
    with SimHosts(2, rate=args.link) as sim, tempfile.TemporaryDirectory() as tmp:
        client, server = sim.hosts
        url = f"{'https' if args.tls else 'http'}://{server.address}:9000"
        log_path = os.path.join(tmp, "moto.log")
        with open(log_path, "wb") as log:
            moto = server.popen(moto_argv(server.address, 9000, tls=args.tls, cpu=args.pin[1] if args.pin else None),
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            child = client.popen([sys.executable, __file__, *argv, "--moto-endpoint", url])
            return child.wait()
        finally:
            stop(moto)


def _without_link(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--link":
            skip = True
        elif not a.startswith("--link="):
            out.append(a)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--width", type=int, default=5000, help="the Linear is width x width float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--store", choices=("local", "s3"), default="local",
                        help="a local directory, or a bucket on a moto S3 server started for the run")
    parser.add_argument("--pin", type=lambda v: tuple(int(c) for c in v.split(",")), default=None,
                        metavar="TRAIN,SERVER", help="CPU of this process (training and upload client), CPU of the "
                        "S3 server")
    parser.add_argument("--link", default=None, metavar="RATE",
                        help="--store s3: the server in a simulated host behind a tbf link of RATE (root)")
    parser.add_argument("--tls", action="store_true", help="--store s3: the server speaks HTTPS")
    parser.add_argument("--moto-endpoint", default=None, help=argparse.SUPPRESS)  # --link's inner run
    args = parser.parse_args()
    if args.pin is not None and len(args.pin) != 2:
        parser.error("--pin takes two CPUs: TRAIN,SERVER")
    if (args.link or args.tls) and args.store != "s3":
        parser.error("--link and --tls need --store s3")
    if args.link:
        raise SystemExit(run_between_simulated_hosts(args, _without_link(sys.argv[1:])))
    if args.pin:
        pin_this_process(args.pin[0])

    import torch

    from spark_hvd.estimators.common.rank_run import RankRun
    from spark_hvd.store import Store

    torch.set_num_threads(1)
    model = torch.nn.Linear(args.width, args.width, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)
    hvd = SimpleNamespace(broadcast_object=lambda value, root_rank: value, allgather_object=lambda value: [value])

    class Trainer:
        def save_checkpoint(self, directory: str) -> None:
            torch.save(model.state_dict(), f"{directory}/model.pt")
            torch.save(optimizer.state_dict(), f"{directory}/optimizer.pt")

    Trainer.hvd = hvd
    state_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6

    def one(mode: str, store: Store) -> tuple[float, float]:
        spec = SimpleNamespace(store=store, run_id=f"bench-{mode}", best=None, backward_passes_per_step=1,
                               checkpoint_upload="sync" if mode == "sync" else "async", checkpoint_when_busy="wait",
                               checkpoint_every_steps=None if mode == "none" else args.every,
                               checkpoint_every_seconds=None)
        run = RankRun(spec, Trainer())
        run.readers = SimpleNamespace(steps=lambda split: args.steps)
        cpu0, thread0 = time.process_time(), time.thread_time()
        ends = [time.perf_counter()]
        for step in range(args.steps):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
            run.step_end(0, step, {"rows": step})
            ends.append(time.perf_counter())
        loop_s = ends[-1] - ends[0]
        train_cpu, loop_cpu = time.thread_time() - thread0, time.process_time() - cpu0
        run.writer.wait()
        cpu = {"train_thread_cpu_s": round(train_cpu, 3),  # training and the in-step snapshot
               "other_threads_cpu_in_loop_s": round(loop_cpu - train_cpu, 3),
               "other_threads_cpu_s": round(time.process_time() - cpu0 - (time.thread_time() - thread0), 3)}
        durations = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        median = statistics.median(durations)
        at = [i for i in range(args.steps) if mode != "none" and (i + 1) % args.every == 0]
        split = {"median_step_ms": round(median * 1e3, 1),
                 "checkpoint_steps_ms": [round(durations[i] * 1e3) for i in at],
                 "other_steps_excess_s": round(sum(d - median for i, d in enumerate(durations) if i not in at), 2)}
        return args.steps / loop_s, time.perf_counter() - ends[-1], {**split, **cpu}

    rates: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    cpus: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        store = Store.create(tmp) if args.store == "local" else stack.enter_context(moto_s3_store(tmp, args))
        one("none", store)  # warm-up
        for repeat in range(args.repeats):
            for mode in ("none", "sync", "async"):
                rate, end_wait, split = one(mode, store)
                rates[mode].append(rate)
                cpus[mode].append(split["train_thread_cpu_s"] + split["other_threads_cpu_s"])
                print(json.dumps({"repeat": repeat, "mode": mode, "steps_per_s": round(rate, 3),
                                  "end_wait_s": round(end_wait, 3), **split,
                                  "state_mb": round(state_mb, 1), "every": args.every,
                                  "store": args.store, "pin": args.pin, "tls": args.tls,
                                  "load": os.getloadavg()[0]}), flush=True)
    none, none_cpu = statistics.median(rates["none"]), statistics.median(cpus["none"])
    # cpu_vs_none: none's CPU seconds over this mode's (training thread + every other thread of the process, the
    # upload client's included), i.e. the steps/s ratio where one core runs the loop and the upload client alone
    print(json.dumps({mode: {"steps_per_s": round(statistics.median(r), 3),
                             "vs_none": round(statistics.median(r) / none, 3),
                             "cpu_s": round(statistics.median(cpus[mode]), 3),
                             "cpu_vs_none": round(none_cpu / statistics.median(cpus[mode]), 3)}
                      for mode, r in rates.items()}))


if __name__ == "__main__":
    main()
