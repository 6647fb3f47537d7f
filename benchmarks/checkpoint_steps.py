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
(``moto_server`` beside this Python, started on a free local port for the run and stopped after it) through the
``s3://`` fsspec store, i.e. every checkpoint is uploaded over HTTP to a real S3 API (loopback, no network latency).

Usage::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/checkpoint_steps.py --steps 120 --batch 8 --repeats 2
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/checkpoint_steps.py --store s3 --steps 120 --batch 8

Prints one JSON line per run and a summary line with each mode's median steps/s and its ratio to ``none``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any


@contextlib.contextmanager
def moto_s3_store(log_dir: str) -> Iterator[Any]:
    """A store in a bucket of a moto S3 server started on a free local port (the tests' helper), stopped on exit."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import s3fs
    from helpers.moto_s3 import MOTO, moto_s3_endpoint, s3_options

    from spark_hvd.store import Store

    if not os.path.exists(MOTO):
        raise SystemExit(f"--store s3 needs moto_server beside {sys.executable}")
    with moto_s3_endpoint(os.path.join(log_dir, "moto.log")) as url:
        s3fs.S3FileSystem(**s3_options(url)).mkdir("bench-checkpoints")
        yield Store.create("s3://bench-checkpoints/store", **s3_options(url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--width", type=int, default=5000, help="the Linear is width x width float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--store", choices=("local", "s3"), default="local",
                        help="a local directory, or a bucket on a moto S3 server started for the run")
    args = parser.parse_args()

    import torch

    from spark_hvd.estimators.rank_run import RankRun
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
        ends = [time.perf_counter()]
        for step in range(args.steps):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
            run.step_end(0, step, {"rows": step})
            ends.append(time.perf_counter())
        loop_s = ends[-1] - ends[0]
        run.writer.wait()
        durations = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        median = statistics.median(durations)
        at = [i for i in range(args.steps) if mode != "none" and (i + 1) % args.every == 0]
        split = {"median_step_ms": round(median * 1e3, 1),
                 "checkpoint_steps_ms": [round(durations[i] * 1e3) for i in at],
                 "other_steps_excess_s": round(sum(d - median for i, d in enumerate(durations) if i not in at), 2)}
        return args.steps / loop_s, time.perf_counter() - ends[-1], split

    rates: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        store = Store.create(tmp) if args.store == "local" else stack.enter_context(moto_s3_store(tmp))
        one("none", store)  # warm-up
        for repeat in range(args.repeats):
            for mode in ("none", "sync", "async"):
                rate, end_wait, split = one(mode, store)
                rates[mode].append(rate)
                print(json.dumps({"repeat": repeat, "mode": mode, "steps_per_s": round(rate, 3),
                                  "end_wait_s": round(end_wait, 3), **split,
                                  "state_mb": round(state_mb, 1), "every": args.every,
                                  "store": args.store}), flush=True)
    none = statistics.median(rates["none"])
    print(json.dumps({mode: {"steps_per_s": round(statistics.median(r), 3),
                             "vs_none": round(statistics.median(r) / none, 3)} for mode, r in rates.items()}))


if __name__ == "__main__":
    main()
