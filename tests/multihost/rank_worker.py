"""A rank of the multi-host launcher tests: ``rank_worker.py MODE``.

``check``: print one JSON line (rank, topology, host name, transport, and whether allreduce / allgather /
broadcast of random arrays equal numpy's result over every rank's array); ``loop``: allreduce until it fails
(printing the error to stderr, exit 3); ``fail R``: rank R crashes (exit code 5) after joining, the others wait in
an allreduce; ``hang``: sleep; ``orphan R``: every rank starts two sleepers that leave its process group (one in a
session of its own, one double-forked by ``setsid -f``) and prints its ``SPARK_HVD_RANK_MARK`` and their pids as a
JSON line, then behaves as ``fail R``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import numpy as np


def _arrays(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng(1000 + rank).standard_normal(n)


def main() -> None:
    mode = sys.argv[1]
    if mode == "hang":
        time.sleep(600)
        return
    if mode == "orphan":
        import subprocess

        child = subprocess.Popen(["sleep", "600"], start_new_session=True)
        subprocess.run(["setsid", "-f", "sleep", "601"], check=True)
        print(json.dumps({"mark": os.environ.get("SPARK_HVD_RANK_MARK"), "child": child.pid}), flush=True)
        mode = "fail"
    import spark_hvd.core as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if mode == "check":
        n = 1 << 20  # 8 MiB of float64: the ring's pipelined path
        got = hvd.allreduce(_arrays(rank, n), op=hvd.Sum)
        expected = sum(_arrays(r, n) for r in range(size))
        gathered = hvd.allgather(np.full((rank + 1, 3), rank, dtype=np.int64))
        expected_gather = np.concatenate([np.full((r + 1, 3), r, dtype=np.int64) for r in range(size)])
        root = hvd.broadcast(_arrays(rank, 1000), root_rank=size - 1)
        print(json.dumps({
            "rank": rank, "size": size, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "hostname": socket.gethostname(),
            "transport": getattr(hvd.get_engine().backend, "transport", None),
            "torchrun": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")},
            "allreduce": bool(np.allclose(got, expected, rtol=1e-10, atol=1e-10)),
            "allgather": bool(np.array_equal(gathered, expected_gather)),
            "broadcast": bool(np.array_equal(root, _arrays(size - 1, 1000)))}), flush=True)
    elif mode == "loop":
        buf = _arrays(rank, 1 << 18)
        print("looping", flush=True)
        try:
            while True:
                hvd.allreduce(buf, op=hvd.Average)
        except Exception as exc:  # noqa: BLE001 - the test reads the error
            print(f"FAILED {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            sys.exit(3)
    elif mode == "fail":
        if rank == int(sys.argv[2]):
            print(f"rank {rank} fails on purpose", file=sys.stderr, flush=True)
            os._exit(5)  # a crash: no shutdown, its connections just close
        hvd.allreduce(np.ones(10))
    hvd.shutdown()


if __name__ == "__main__":
    main()
