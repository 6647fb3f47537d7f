"""How fast the DATA frames' tag (AES-256-GCM's GMAC, ``core/wire``) runs on 1..T threads.

It tags frames of each size on T threads at once (one shared key object) and prints the aggregate GB/s: above 1x
for 2 threads only because ``cryptography`` hashes without the GIL, and only as far as idle cores allow. (A pool
of threads tagging the ring's frames off the calling thread was tried and removed: on 2 cores it cost CPU and
gained nothing, issue 45.)::

    .venv/bin/python benchmarks/mac_tag.py                       # 64 KiB .. 1 MiB frames, 1 and 2 threads
    .venv/bin/python benchmarks/mac_tag.py --threads 1,2,4 --sizes 1M

Numbers depend on the load of the machine: print ``uptime`` with them.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.allreduce import human, parse_size  # noqa: E402
from spark_hvd.core.transport.wire import _Direction  # noqa: E402


def _frames(size: int, count: int = 8) -> list[memoryview]:
    return [memoryview(np.random.default_rng(k).random(size // 8)).cast("B") for k in range(count)]


def threads_rate(direction: _Direction, size: int, threads: int, total: int) -> float:
    """Aggregate GB/s of ``threads`` threads tagging ``total`` bytes of ``size``-byte frames between them."""
    frames = _frames(size)
    per_thread = max(1, total // size // threads)

    def work(k: int) -> None:
        for i in range(per_thread):
            direction.data_tag(i, size + 1, b"\0", frames[(i + k) % len(frames)])

    best = float("inf")
    for _ in range(3):
        workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return per_thread * threads * size / best / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64K,256K,1M")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--total", default="256M", help="bytes tagged per measurement")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    counts = [int(t) for t in args.threads.split(",")]
    total = parse_size(args.total)
    direction = _Direction(os.urandom(32))
    direction.reserve()
    print(f"# GMAC tags, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    print("| frame | " + " | ".join(f"{t} thread{'s' if t > 1 else ''} GB/s" for t in counts) + " |")
    print("|---|" + "---|" * len(counts))
    for size in sizes:
        rates = [threads_rate(direction, size, t, total) for t in counts]
        print(f"| {human(size)} | " + " | ".join(f"{r:.1f}" for r in rates) + " |")
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
