"""What encryption in transit costs: the bare TCP ring, frames authenticated only vs encrypted, interleaved.

Two groups of N ranks (``RingBackend`` over TCP, ``SPARK_HVD_SHM=0``, the compiled loop where it is built) are
started and kept alive, one with ``JobEnv.encrypt`` off and one with it on (``SPARK_HVD_ENCRYPT``); the driver
asks them in turn, alternating which goes first every round, to time float32 SUM allreduces of each size. A
group's time is its slowest rank's wall time per allreduce, its CPU the mean per rank (``time.process_time``: every
thread of the rank); the table gives the medians over rounds and the encrypted / authenticated ratios (targets of
issue 43 at 2 Gbit/s: time <= 1.05x, CPU <= 1.5x)::

    .venv/bin/python benchmarks/encryption.py                             # loopback, 16 and 64 MiB, np=2
    .venv/bin/python benchmarks/encryption.py --hosts 2 --link 2gbit      # two simulated hosts (root; tc tbf)

``--hosts H`` places the ranks on H simulated hosts (``benchmarks/allreduce_hosts.py``: a network + UTS namespace
each, links shaped by ``tc tbf``; the driver on a host of its own). On loopback the links are not the limit: the
ratios then show the cipher's CPU on the critical path. Figures from a loaded machine are indicative only; ratios
from one interleaved invocation stay meaningful.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import allreduce_hosts  # noqa: E402 - --hosts: ranks on simulated hosts

from spark_hvd.core.transport.wire import FramedSocket, make_secret  # noqa: E402

MODES = ("authenticated", "encrypted")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def _worker(mode: str) -> None:
    """One rank of one group: join, then serve ("run", nbytes, iters) with (wall s, CPU s) until ("stop",)."""
    import numpy as np

    from spark_hvd.core.backend import ReduceOp
    from spark_hvd.core.backends.ring import RingBackend
    from spark_hvd.core.jobenv import JobEnv
    from spark_hvd.core.settings import Settings
    from spark_hvd.core.transport.rendezvous import KVRendezvous

    job = JobEnv.from_env()
    settings = Settings.from_env()
    rdzv = KVRendezvous(job.rendezvous, job.secret, job.job_id, settings.timeout_s)  # the driver's KV: in clear
    backend = RingBackend(job.rank, job.size, rdzv, job.secret, settings, job.job_id, job=job)
    host, port = os.environ["BENCH_CONTROL"].rsplit(":", 1)
    control = FramedSocket(socket.create_connection((host, int(port)), timeout=120),
                           bytes.fromhex(os.environ["BENCH_SECRET"]), "bench driver")
    control.sock.settimeout(None)
    control.send_object(("hello", mode, job.rank, backend.transport, backend.encrypt, backend._compiled))
    buf = np.random.default_rng(job.rank).standard_normal(1).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # repeated sums of one buffer overflow to inf
        while True:
            command = control.recv_object()
            if command[0] == "stop":
                break
            _, nbytes, iters = command
            if buf.nbytes != nbytes:
                buf = np.random.default_rng(job.rank).standard_normal(nbytes // 4).astype(np.float32)
            backend.allreduce(buf, ReduceOp.SUM)  # warm-up
            backend.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(iters):
                backend.allreduce(buf, ReduceOp.SUM)
            control.send_object(("result", (time.perf_counter() - start) / iters, (time.process_time() - cpu) / iters))
    backend.barrier()
    backend.close()
    control.close()


class Group:
    """The N rank processes of one mode and their control connections."""

    def __init__(self, mode: str, n: int, control: str, secret: bytes, kv: str) -> None:
        self.mode, self.conns, self.info = mode, {}, set()
        env = dict(os.environ, BENCH_CONTROL=control, BENCH_SECRET=secret.hex(), OMP_NUM_THREADS="1",
                   SPARK_HVD_SHM="0", SPARK_HVD_SIZE=str(n), SPARK_HVD_JOB_ID=f"enc{os.getpid()}{mode[0]}",
                   SPARK_HVD_SECRET=secret.hex(), SPARK_HVD_RENDEZVOUS=kv,
                   SPARK_HVD_ENCRYPT="1" if mode == "encrypted" else "0")
        hosts = allreduce_hosts.inside()
        self.procs = [subprocess.Popen([*(allreduce_hosts.prefix(rank, n) if hosts else []), sys.executable,
                                        str(Path(__file__).resolve()), "--worker", mode],
                                       env={**env, "SPARK_HVD_RANK": str(rank)}) for rank in range(n)]

    def run(self, nbytes: int, iters: int) -> tuple[float, float]:
        """(slowest rank's seconds per allreduce, mean CPU seconds per allreduce per rank)."""
        for conn in self.conns.values():
            conn.send_object(("run", nbytes, iters))
        replies = [conn.recv_object() for conn in self.conns.values()]
        return max(r[1] for r in replies), sum(r[2] for r in replies) / len(replies)

    def stop(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send_object(("stop",))
            except Exception:  # a dead worker: killed below
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def bench(n: int, sizes: list[int], rounds: int, timeout_s: float = 180.0) -> dict:
    from spark_hvd.core.transport.rendezvous import KVStoreServer

    secret = make_secret()
    bind = allreduce_hosts.driver_address() if allreduce_hosts.inside() else "127.0.0.1"
    kv = KVStoreServer(secret, host=bind)
    kv_host, kv_port = kv.start()
    listener = socket.create_server((bind, 0))
    listener.settimeout(1.0)
    control = f"{bind}:{listener.getsockname()[1]}"
    groups = {mode: Group(mode, n, control, secret, f"{kv_host}:{kv_port}") for mode in MODES}
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while any(len(g.conns) < n for g in groups.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not start within {timeout_s:.0f}s")
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            conn = FramedSocket(sock, secret, "bench worker")
            _, mode, rank, transport, encrypt, compiled = conn.recv_object()
            groups[mode].conns[rank] = conn
            groups[mode].info.add(f"{transport}, {'encrypted' if encrypt else 'authenticated'}, "
                                  f"{'compiled' if compiled else 'Python'} loop")
        for g in groups.values():
            print(f"# {g.mode}: {'; '.join(sorted(g.info))}")
        order = list(groups.values())
        for rnd in range(rounds):
            for nbytes in sizes:
                iters = max(3, min(50, (512 << 20) // nbytes // max(1, n)))
                for g in order[rnd % 2:] + order[:rnd % 2]:
                    times.setdefault((g.mode, nbytes), []).append(g.run(nbytes, iters))
            print(f"# round {rnd + 1}/{rounds} done", flush=True)
    finally:
        listener.close()
        for g in groups.values():
            g.stop()
        kv.stop()
    return times


def table(sizes: list[int], times: dict) -> str:
    lines = ["| size | authenticated time | encrypted time | time ratio | authenticated CPU | encrypted CPU "
             "| CPU ratio |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for nbytes in sizes:
        auth, enc = times[("authenticated", nbytes)], times[("encrypted", nbytes)]
        wall = [statistics.median(t for t, _ in runs) for runs in (auth, enc)]
        cpu = [statistics.median(c for _, c in runs) for runs in (auth, enc)]
        # the ratio of each round's pair (interleaved), median over rounds
        wall_ratio = statistics.median(e[0] / a[0] for a, e in zip(auth, enc, strict=True))
        cpu_ratio = statistics.median(e[1] / a[1] for a, e in zip(auth, enc, strict=True))
        size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        lines.append(f"| {size} | {wall[0] * 1e3:.3f} ms | {wall[1] * 1e3:.3f} ms | {wall_ratio:.3f}x | "
                     f"{cpu[0] * 1e3:.3f} ms | {cpu[1] * 1e3:.3f} ms | {cpu_ratio:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--sizes", default="16M,64M", help="comma-separated sizes (default 16M,64M)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    parser.add_argument("--hosts", type=int, default=None,
                        help="place the ranks on this many simulated hosts (root; benchmarks/allreduce_hosts.py)")
    parser.add_argument("--link", default="2gbit", help="with --hosts: each host's link rate, as tc writes it")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    if args.hosts and not allreduce_hosts.inside():
        return allreduce_hosts.enter(args.hosts, args.link, [str(Path(__file__).resolve()), *(argv or sys.argv[1:])])
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    where = f"{args.hosts} simulated hosts, links at {args.link}" if allreduce_hosts.inside() else "loopback"
    print(f"# allreduce float32 SUM, np={args.np}, TCP ring on {where}, authenticated vs encrypted interleaved; "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at start; command: "
          f"{' '.join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])}", flush=True)
    times = bench(args.np, sizes, args.rounds)
    print(table(sizes, times))
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
