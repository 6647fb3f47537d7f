"""Allreduce benchmark: spark_hvd as users call it and its bare RingBackend vs torch.distributed (gloo) vs mpi4py
on Open MPI, interleaved.

For each job size N, one group of N processes per implementation is started and kept alive; the driver then
asks the groups in turn (rotating the order every round) to time ``iters`` float32 SUM allreduces of one size,
so every implementation sees the same machine conditions. Idle groups block on their control socket and use no
CPU. Each measurement is the slowest rank's mean time per allreduce; the table shows the median over rounds, the
bus bandwidth ``2 (N-1)/N x bytes / time`` and the ratio of bus bandwidth to gloo's (> 1: faster than gloo)::

    .venv/bin/python benchmarks/allreduce.py                 # N=2 and 4, 4 KiB .. 256 MiB, 5 rounds (ring-hier: N=4)
    .venv/bin/python benchmarks/allreduce.py --quick         # N=2, 4 KiB .. 64 MiB, 3 rounds
    .venv/bin/python benchmarks/allreduce.py --np 2 --impls ring,gloo --sizes 4K,16M --rounds 7
    .venv/bin/python benchmarks/allreduce.py --fusion        # + 161 ResNet-50 tensors through the engine (ring)
    .venv/bin/python benchmarks/allreduce.py --np 4 --impls ring,ring-tcp,ring-hier,gloo   # the ring's other paths
    .venv/bin/python benchmarks/allreduce.py --np 2 --impls api,api-tcp,ring,ring-tcp,gloo,mpi   # the user's path
    .venv/bin/python benchmarks/allreduce.py --np 2 --impls api,api-tcp,ring,gloo --sizes 4K --osu  # OSU style
    .venv/bin/python benchmarks/allreduce.py --np 2 --impls api,ring --sizes 4K --alternate   # two tensors in turn
    .venv/bin/python benchmarks/allreduce.py --np 2 --impls api,ring --sizes 4K --after-barrier  # barrier, one call

``--op reducescatter`` / ``--op allgather`` time those collectives instead (``ring``, ``ring-tcp``, ``ring-hier``,
``api``, ``api-tcp``, ``api-hier``, ``gloo``, ``mpi``): SIZE is the whole buffer, as nccl-tests count it (the
reducescatter's input, of which each rank gets 1/N; the allgather's output, of which each rank gives 1/N), and the
bus bandwidth is ``(N-1)/N x bytes / time``. ``api`` calls ``hvd.reducescatter(t, op=hvd.Sum)`` /
``hvd.allgather(t)``, gloo ``dist.reduce_scatter`` (its tensor form is not in gloo) / ``dist.all_gather_into_tensor``::

    .venv/bin/python benchmarks/allreduce.py --np 2 --impls api,api-tcp,ring,ring-tcp,gloo --op reducescatter
    BENCH_VARIANTS='{"ar": {"BENCH_OP": "allreduce"}}' \
        .venv/bin/python benchmarks/allreduce.py --np 2 --impls ring,ring:ar --op allgather   # against the allreduce

(a variant's ``BENCH_OP`` times another collective in the same invocation; the busbw column keeps ``--op``'s factor.)

``--osu`` times as osu_allreduce does: a barrier between timed allreduces (only the allreduce is timed), so no
call can ride on the one before it; ``--after-barrier`` times the loop a user writes to time a small collective:
untimed back-to-back calls, then ``hvd.barrier()`` before each timed call, each call's slowest rank, the median over
calls (and logs how far apart the ranks left the barrier; ``--unnamed``: ``hvd.allreduce_(t)`` with no name);
``--alternate`` times back-to-back calls that alternate between two tensors (two names). Without any, one tensor
is reduced back to back (a steady training loop's best case).

``ring`` is the built-in backend as a user gets it (shared memory between the ranks of one host); ``ring-tcp``
forces its TCP ring (``SPARK_HVD_SHM=0``); ``ring-hier`` makes the first and second half of the ranks look like
two hosts (``SPARK_HVD_HOST_ID``), so it runs the hierarchical path: shared memory within a "host", the TCP ring
between the two leaders (needs N >= 4 to differ from the TCP ring); ``ring-sync`` is ``ring`` with a 16-byte
allreduce before each call, the collectives a steady ``api`` call makes when no speculation carries it (the
engine's fast round, then the data) without the engine's Python; ``ring-agreed`` (two ranks over TCP only) is the
collective a steady ``api`` call makes when speculation carries it (the agreement as the data's first frame,
``spark_hvd.core.algorithms.agreed``), without the engine's Python. ``api`` and ``api-tcp`` are what a user calls:
``spark_hvd.torch.allreduce_`` on a CPU tensor after ``hvd.init()`` (engine, negotiation, response cache and the
torch binding on top of the same backend; ``api-tcp`` with ``SPARK_HVD_SHM=0``, ``api-hier`` on ``ring-hier``'s two
"hosts"), one fixed tensor name per size as a training loop has.

The driver's control connections use the same authenticated framing as the library (``FramedSocket``).
``BENCH_PROFILE=DIR`` in the environment writes a cProfile of every rank's timed loop to
``DIR/IMPL.RANK.NBYTES.NS.prof`` (read with ``pstats``; the profiler slows the Python parts, so time without it);
with ``BENCH_PROFILE_CLOCK=cpu`` its clock is the calling thread's CPU time instead of the wall clock.
``BENCH_TRACE=DIR``: every rank of the spark_hvd implementations writes each timed loop's per-frame timeline (its
calls, and each frame ``RingExchange`` sent and received, with the send socket's ``TCP_INFO``) to
``DIR/IMPL.RANK.NBYTES.NS.json``; ``benchmarks/allreduce_trace.py DIR`` summarises two ranks' timelines against the
wire's schedule (entry and exit costs, the boundary between calls, each direction's excess over the wire time).
``BENCH_STATS=1``: rank 0 of ``api`` prints how many of each measurement's timed calls were one speculative
collective (the negotiation carried by the data's own collective, or packed with it) to stderr, and every rank of
every implementation, per timed call, its voluntary context switches (all its threads: how often it slept), its
CPU time and the ACKs its network namespace took in TCP's slow and fast paths (with ``--hosts``: its own).

**Variants in one invocation** (A/B comparisons under the same machine conditions): ``IMPL:NAME`` in ``--impls``
runs ``IMPL`` with the environment variables of ``NAME`` in ``BENCH_VARIANTS`` (JSON) added, as a group of its own;
``BENCH_ROOT`` among them imports spark_hvd from another checkout (the worker script stays this one)::

    BENCH_VARIANTS='{"main": {"BENCH_ROOT": "/work/main"}, "python": {"SPARK_HVD_COMPILED_RING": "0"}}' \
        .venv/bin/python benchmarks/allreduce.py --np 2 --impls ring,ring:main,ring:python,gloo --sizes 64M

``BENCH_PERF=DIR``: every rank records its timed loops from 1 MiB with ``perf record -g`` (Linux perf on the PATH;
root or a permissive ``perf_event_paranoid``) to ``DIR/IMPL.RANK.NBYTES.NS.data``, and
``benchmarks/allreduce_perf.py DIR`` sums them by implementation (kernel copies, MAC, system calls, Python...).
Sampling inflates the ranks' CPU (more for implementations that switch threads often): compare shares and
samples between implementations of one run, and time without it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(os.environ.get("BENCH_ROOT") or Path(__file__).resolve().parents[1])  # BENCH_ROOT: a variant's tree
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import allreduce_hosts  # noqa: E402 - --hosts: ranks on simulated hosts

from spark_hvd.core.transport.wire import FramedSocket, make_secret  # noqa: E402

logger = logging.getLogger("bench")
_MODES = {"osu": "--osu: a barrier between timed allreduces, as osu_allreduce",
          "alt": "--alternate: two tensors alternating, time per call",
          "new": "--new-names: every call a new name, time per call",
          "bar": "--after-barrier: back-to-back warm-up, then hvd.barrier() before each timed call; per call the "
                 "slowest rank, median over calls",
          "barnn": "--after-barrier --unnamed: as --after-barrier, each call hvd.allreduce_(t) without a name"}
IMPLS = ("api", "api-tcp", "ring", "gloo", "mpi", "ring-tcp", "ring-hier", "api-hier", "ring-sync", "ring-agreed")
DEFAULT_IMPLS = ("api", "api-tcp", "ring", "ring-hier", "gloo", "mpi")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def osu_iterations(nbytes: int) -> int:
    """``--osu`` / ``--alternate``: fewer calls (each also pays a barrier or a second tensor)."""
    return max(3, min(200, (16 << 20) // max(nbytes, 1)))


def iterations(nbytes: int, quick: bool) -> int:
    budget = (32 if quick else 64) * (1 << 20)
    return max(3, min(200 if quick else 400, budget // max(nbytes, 1)))


# ---------------------------------------------------------------------------------------------- worker side
def _acks() -> tuple[int, int]:
    """The TCP ACKs this process's network namespace took in the slow path and in the fast path (header
    prediction) so far (``TcpExt`` TCPPureAcks, TCPHPAcks); (0, 0) where /proc does not say."""
    try:
        with open("/proc/self/net/netstat") as f:
            lines = f.read().split("\n")
    except OSError:
        return 0, 0
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            counters = dict(zip(names.split()[1:], map(int, values.split()[1:]), strict=True))
            return counters.get("TCPPureAcks", 0), counters.get("TCPHPAcks", 0)
    return 0, 0


def _switches() -> int:
    """This process's voluntary context switches so far, all its threads (how often it slept waiting)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def _connect_control() -> FramedSocket:
    host, port = os.environ["BENCH_CONTROL"].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=120)
    sock.settimeout(None)
    return FramedSocket(sock, bytes.fromhex(os.environ["BENCH_SECRET"]), "bench driver")


def _worker(name: str) -> None:
    """One rank of one implementation (``name``: IMPL or IMPL:VARIANT): connect, then serve ("run", nbytes, iters)
    until ("stop",)."""
    impl = name.split(":", 1)[0]
    carried: Callable[[], int] | None = None  # BENCH_STATS: calls so far whose round was one speculative collective
    if impl == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()

        def allreduce(buf: np.ndarray) -> None:
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        def reducescatter(buf: np.ndarray) -> None:
            comm.Reduce_scatter_block(buf, np.empty(buf.size // size, buf.dtype), op=MPI.SUM)

        def allgather(piece: np.ndarray) -> None:
            comm.Allgather(piece, np.empty(piece.size * size, piece.dtype))

        barrier = comm.Barrier
        close = lambda: None  # noqa: E731
        transport = "open mpi defaults"
    elif impl == "gloo":
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        rank, size = int(os.environ["SPARK_HVD_RANK"]), int(os.environ["SPARK_HVD_SIZE"])
        gloo_addr = os.environ.get("BENCH_GLOO_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://{gloo_addr}:{os.environ['BENCH_GLOO_PORT']}",
                                rank=rank, world_size=size)

        def allreduce(buf: np.ndarray) -> None:
            dist.all_reduce(torch.from_numpy(buf))

        def reducescatter(buf: np.ndarray) -> None:
            whole = torch.from_numpy(buf)
            dist.reduce_scatter(torch.empty(buf.size // size), list(whole.chunk(size)))

        def allgather(piece: np.ndarray) -> None:
            with warnings.catch_warnings():  # "deprecated": its successor is not in every torch the legs run
                warnings.simplefilter("ignore", FutureWarning)
                dist.all_gather_into_tensor(torch.empty(piece.size * size), torch.from_numpy(piece))

        barrier = dist.barrier
        close = dist.destroy_process_group
        transport = "gloo tcp"
    elif impl.startswith("api"):
        import torch

        import spark_hvd.core as core
        import spark_hvd.torch as hvd

        torch.set_num_threads(1)
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        tensors: dict[int, torch.Tensor] = {}

        def allreduce(buf: np.ndarray, tag: str | None = "") -> None:
            tensor = tensors.get(id(buf))
            if tensor is None:
                if len(tensors) > 1:
                    tensors.clear()
                tensor = tensors[id(buf)] = torch.from_numpy(buf)  # shares buf's memory
            hvd.allreduce_(tensor, name=None if tag is None else f"bench.{buf.nbytes}{tag}", op=hvd.Sum)

        def reducescatter(buf: np.ndarray) -> None:
            hvd.reducescatter(torch.from_numpy(buf), name=f"bench.rs.{buf.nbytes}", op=hvd.Sum)

        def allgather(piece: np.ndarray) -> None:
            hvd.allgather(torch.from_numpy(piece), name=f"bench.ag.{piece.nbytes}")

        barrier = hvd.barrier
        close = hvd.shutdown
        transport = f"spark_hvd.torch.allreduce_ over {getattr(core.get_engine().backend, 'transport', '?')}"

        def speculated() -> int:
            stats = core.get_engine().stats
            return stats["speculative_rounds"] - stats["speculation_misses"]

        carried = speculated
    else:
        from spark_hvd.core.backend import ReduceOp
        from spark_hvd.core.backends.ring import RingBackend
        from spark_hvd.core.jobenv import JobEnv
        from spark_hvd.core.settings import Settings
        from spark_hvd.core.transport.rendezvous import KVRendezvous
        from spark_hvd.core.transport.wire import secret_from_env

        rank, size = int(os.environ["SPARK_HVD_RANK"]), int(os.environ["SPARK_HVD_SIZE"])
        secret = secret_from_env()
        settings = Settings.from_env()
        rdzv = KVRendezvous(os.environ["SPARK_HVD_RENDEZVOUS"], secret, os.environ["SPARK_HVD_JOB_ID"],
                            settings.timeout_s)
        backend = RingBackend(rank, size, rdzv, secret, settings, os.environ["SPARK_HVD_JOB_ID"],
                              job=JobEnv.from_env())  # its SPARK_HVD_ENCRYPT (benchmarks/encryption.py)

        sync = np.zeros(4, np.float32)

        def allreduce(buf: np.ndarray) -> None:
            if impl == "ring-sync":  # the public API's collective pattern without the engine: a small one first
                backend.allreduce(sync, ReduceOp.SUM)
            if impl == "ring-agreed":  # a speculative round's collective between two ranks over TCP
                backend.allreduce_agreed(buf, ReduceOp.SUM, True)
            else:
                backend.allreduce(buf, ReduceOp.SUM)

        def reducescatter(buf: np.ndarray) -> None:
            backend.reducescatter(buf, ReduceOp.SUM)

        def allgather(piece: np.ndarray) -> None:
            backend.allgather(piece)

        barrier = backend.barrier
        close = backend.close
        transport = (f"{backend.transport}, {'encrypted' if backend.encrypt else 'authenticated'}, "
                     f"{'compiled' if backend._compiled else 'Python'} loop")
    allreduce = _the_op(os.environ.get("BENCH_OP", "allreduce"), impl, size, allreduce, locals())
    counting = bool(os.environ.get("BENCH_STATS")) and carried is not None
    control = _connect_control()
    control.send_object(("hello", name, rank, transport))
    buffers: dict[int, np.ndarray] = {}
    rng = np.random.default_rng(rank)
    while True:
        command = control.recv_object()
        if command[0] == "stop":
            break
        _, nbytes, iters, warmup, *mode = command
        buf = buffers.get(nbytes)
        if buf is None:
            buffers.clear()
            buf = buffers[nbytes] = rng.standard_normal(nbytes // 4).astype(np.float32)
        if mode and mode[0] in ("bar", "barnn"):
            control.send_object(("result", _after_barrier(allreduce, barrier, buf, iters, warmup,
                                                          mode[0] == "barnn"), 0.0))
            continue
        if mode and mode[0] != "loop":
            control.send_object(("result", *_osu_timed(mode[0], allreduce, barrier, buf, iters, warmup)))
            continue
        with np.errstate(over="ignore", invalid="ignore"):  # repeated sums of the same buffer overflow to inf
            for _ in range(warmup):
                allreduce(buf)
            barrier()
            profile = _profiler()
            before = carried() if carried is not None else 0
            trace = _trace_start(impl)
            perf = _perf_start(name, rank, nbytes)
            switches, acks = _switches(), _acks()
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(iters):
                if trace is not None:
                    trace.append((time.perf_counter_ns(), "call", 0, 0))
                allreduce(buf)
                if trace is not None:
                    trace.append((time.perf_counter_ns(), "ret", 0, 0))
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            switches, acks = _switches() - switches, [b - a for a, b in zip(acks, _acks(), strict=True)]
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait(60)
            if trace is not None:
                _trace_dump(trace, name, rank, nbytes)
            if os.environ.get("BENCH_STATS"):
                print(f"[stats] {name} rank {rank} {human(nbytes)}: per call {switches / iters:.1f} voluntary context "
                      f"switches, {cpu / iters * 1e3:.3f} ms CPU, {acks[0] / iters:.0f} ACKs in TCP's slow path and "
                      f"{acks[1] / iters:.0f} in its fast path", file=sys.stderr, flush=True)
            if counting and carried is not None and rank == 0:
                print(f"[stats] {impl} {human(nbytes)}: {carried() - before} of {iters} timed calls speculative",
                      file=sys.stderr, flush=True)
            if profile is not None:
                profile.disable()
                profile.dump_stats(f"{os.environ['BENCH_PROFILE']}/{name}.{rank}.{nbytes}.{time.time_ns()}.prof")
        control.send_object(("result", elapsed / iters, cpu / iters))
    barrier()
    close()
    control.close()


def _perf_start(name: str, rank: int, nbytes: int) -> subprocess.Popen | None:
    """``BENCH_PERF``: a ``perf record -g`` of this process, started (and given half a second to attach) before a
    timed loop from 1 MiB; else None."""
    folder = os.environ.get("BENCH_PERF")
    if not folder or nbytes < (1 << 20):
        return None
    out = f"{folder}/{name}.{rank}.{nbytes}.{time.time_ns()}.data"
    perf = subprocess.Popen(["perf", "record", "-q", "-g", "-p", str(os.getpid()), "-o", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return perf


def _trace_start(impl: str) -> list | None:
    """``BENCH_TRACE``: the list ``RingExchange`` records its frames in (``spark_hvd.core.transport.tcp.loop.TRACE``;
    ``tcp.TRACE`` in checkouts from before ``tcp`` was a package), else None."""
    if not os.environ.get("BENCH_TRACE") or impl in ("gloo", "mpi"):
        return None
    from spark_hvd.core.transport import tcp

    holder = getattr(tcp, "loop", tcp)
    holder.TRACE = []
    return holder.TRACE


def _trace_dump(trace: list, impl: str, rank: int, nbytes: int) -> None:
    """Stop recording; write one timed loop's timeline to ``BENCH_TRACE/IMPL.RANK.NBYTES.NS.json``."""
    import json

    from spark_hvd.core.transport import tcp

    getattr(tcp, "loop", tcp).TRACE = None
    path = f"{os.environ['BENCH_TRACE']}/{impl}.{rank}.{nbytes}.{time.time_ns()}.json"
    with open(path, "w") as fh:
        json.dump(trace, fh)


def _profiler() -> Any:
    """A started cProfile.Profile when BENCH_PROFILE names a folder for each rank's timed loops, else None."""
    if not os.environ.get("BENCH_PROFILE"):
        return None
    import cProfile

    clock = time.thread_time if os.environ.get("BENCH_PROFILE_CLOCK") == "cpu" else time.perf_counter
    profile = cProfile.Profile(clock)
    profile.enable()
    return profile


_NEW_NAMES = [0]  # --new-names: a name no call used before


def _osu_timed(mode: str, allreduce: Any, barrier: Any, buf: np.ndarray, iters: int,
               warmup: int) -> tuple[float, float]:
    """``--osu``: osu_allreduce's loop, a barrier between timed allreduces (only the allreduce is timed), so each
    one starts with every rank arriving together after another collective. ``alt`` (``--alternate``):
    back-to-back calls alternating two tensors of this size (two names; on the bare backends, two buffers).
    ``new`` (``--new-names``): every call a name never used before (after untimed warm-up calls, as the other modes).
    Returns (seconds, CPU seconds) per allreduce."""
    other = buf.copy()
    tagged = "tag" in getattr(getattr(allreduce, "__code__", None), "co_varnames", ())

    def call(b: np.ndarray, tag: str) -> None:
        if tagged:
            allreduce(b, tag)
        else:
            allreduce(b)

    elapsed = cpu = 0.0
    with np.errstate(over="ignore", invalid="ignore"):  # repeated sums of the same buffer overflow to inf
        if mode == "osu":
            for _ in range(warmup + 2):
                call(buf, "")
                barrier()
            for _ in range(iters):
                t, c = time.perf_counter(), time.process_time()
                call(buf, "")
                elapsed += time.perf_counter() - t
                cpu += time.process_time() - c
                barrier()
        elif mode == "new":
            barrier()
            for _ in range(warmup + 2):  # untimed, as the other modes: the barrier disarmed the round of new names
                _NEW_NAMES[0] += 1     # (``spark_hvd.core.engine.fresh``), which two rounds of new names arm again
                call(buf, f".new{_NEW_NAMES[0]}")
            t, c = time.perf_counter(), time.process_time()
            for _ in range(iters):
                _NEW_NAMES[0] += 1
                call(buf, f".new{_NEW_NAMES[0]}")
            elapsed, cpu = time.perf_counter() - t, time.process_time() - c
        else:
            for _ in range(warmup + 2):
                call(buf, "")
                call(other, ".b")
            barrier()
            t, c = time.perf_counter(), time.process_time()
            for i in range(iters):
                if i % 2:
                    call(other, ".b")
                else:
                    call(buf, "")
            elapsed, cpu = time.perf_counter() - t, time.process_time() - c
    return elapsed / iters, cpu / iters


def _after_barrier(allreduce: Any, barrier: Any, buf: np.ndarray, iters: int, warmup: int,
                   unnamed: bool) -> list[tuple[float, float]]:
    """``--after-barrier``: the loop a user writes to time a small collective, untimed back-to-back calls to warm
    up, then per call ``hvd.barrier()`` and the timed ``hvd.allreduce_(t)``. ``unnamed``: the calls give no name
    (each is ``allreduce.noname.<n>``, as ``hvd.allreduce_(t)`` names it; the bare backends know no names).
    Returns (when the barrier returned, the call's seconds) per timed call on this rank (the driver takes the
    slowest rank per call, and reports how far apart the ranks left the barrier)."""
    tagged = "tag" in getattr(getattr(allreduce, "__code__", None), "co_varnames", ())
    tag = None if unnamed else ""
    call = (lambda: allreduce(buf, tag)) if tagged else (lambda: allreduce(buf))
    times = []
    clock = time.perf_counter
    with np.errstate(over="ignore", invalid="ignore"):  # repeated sums of the same buffer overflow to inf
        for _ in range(warmup + 10):
            call()
        for _ in range(iters):
            barrier()
            t = clock()
            call()
            times.append((t, clock() - t))
    return times


# ---------------------------------------------------------------------------------------------- driver side
def _the_op(op: str, impl: str, size: int, allreduce: Callable[..., None], defined: dict[str, Any]
            ) -> Callable[..., None]:
    """What the timed loops call with the whole buffer for ``--op``: the allreduce; the reducescatter of it; the
    allgather of this rank's 1/N of it (a view made once per buffer)."""
    if op == "allreduce":
        return allreduce
    if op not in defined or impl in ("ring-sync", "ring-agreed"):
        raise SystemExit(f"{impl} has no {op} (--op {op}: use ring, ring-tcp, ring-hier, api*, gloo or mpi)")
    collective = defined[op]
    if op == "reducescatter":
        return lambda buf, tag="": collective(buf)
    pieces: dict[int, np.ndarray] = {}

    def gather(buf: np.ndarray, tag: str = "") -> None:
        piece = pieces.get(id(buf))
        if piece is None:
            pieces.clear()
            piece = pieces[id(buf)] = buf[:buf.size // size]
        collective(piece)

    return gather


def variant_env(name: str) -> dict[str, str]:
    """The environment variables ``IMPL:VARIANT`` adds (``BENCH_VARIANTS``); none for a plain ``IMPL``."""
    if ":" not in name:
        return {}
    impl, variant = name.split(":", 1)
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r} in {name!r}")
    variants = json.loads(os.environ.get("BENCH_VARIANTS") or "{}")
    if variant not in variants:
        raise ValueError(f"{name!r}: BENCH_VARIANTS has no variant {variant!r} (it has {sorted(variants)})")
    return {str(k): str(v) for k, v in variants[variant].items()}


class Group:
    """The N processes of one implementation and their control connections (by rank)."""

    def __init__(self, impl: str, n: int, control_addr: str, secret: bytes, kv_addr: str | None) -> None:
        self.impl, self.n = impl, n
        self.conns: dict[int, FramedSocket] = {}
        self.transports: set[str] = set()
        name, impl = impl, impl.split(":", 1)[0]
        env = dict(os.environ, BENCH_CONTROL=control_addr, BENCH_SECRET=secret.hex(), OMP_NUM_THREADS="1")
        variant = variant_env(name)
        env.update(variant)
        script = [sys.executable, str(Path(__file__).resolve()), "--worker", name]
        self.procs: list[subprocess.Popen] = []
        hosts = allreduce_hosts.inside()
        if impl == "mpi":
            mpirun = str(Path(sys.executable).parent / "mpirun")
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            where = allreduce_hosts.mpirun_args(n) if hosts else []
            self.procs.append(subprocess.Popen([mpirun, "-np", str(n), "--oversubscribe", *where, *script], env=env))
            return
        job = f"bench{os.getpid()}{name.replace(':', '-')}{n}"
        extra = {"SPARK_HVD_SIZE": str(n), "SPARK_HVD_JOB_ID": job, "SPARK_HVD_SECRET": secret.hex()}
        if impl in ("ring-tcp", "api-tcp"):
            extra["SPARK_HVD_SHM"] = "0"
        if impl == "gloo" and hosts:  # rank 0 serves gloo's store on its own host: a port free there, likely
            extra.update(BENCH_GLOO_ADDR=allreduce_hosts.host_of(0, n)["address"], GLOO_SOCKET_IFNAME="eth0",
                         BENCH_GLOO_PORT=str(20000 + os.getpid() % 20000))
        elif impl == "gloo":
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                extra["BENCH_GLOO_PORT"] = str(probe.getsockname()[1])
        else:
            extra["SPARK_HVD_RENDEZVOUS"] = kv_addr or ""
        for rank in range(n):
            own = {"SPARK_HVD_RANK": str(rank)}
            if impl in ("ring-hier", "api-hier"):
                own["SPARK_HVD_HOST_ID"] = f"bench-host-{2 * rank // n}"
            place = allreduce_hosts.prefix(rank, n) if hosts else []
            self.procs.append(subprocess.Popen([*place, *script], env={**env, **extra, **own, **variant}))

    def run(self, nbytes: int, iters: int, warmup: int, mode: str = "loop") -> tuple[float, float]:
        """(slowest rank's seconds per allreduce, mean CPU seconds per allreduce per rank); for a mode that times
        each call (``--after-barrier``), the median over calls of each call's slowest rank."""
        for conn in self.conns.values():
            conn.send_object(("run", nbytes, iters, warmup, mode))
        replies = [conn.recv_object() for conn in self.conns.values()]
        if isinstance(replies[0][1], list):  # per call (barrier exit, seconds) on each rank
            calls = list(zip(*(r[1] for r in replies), strict=True))
            spread = statistics.median(max(t for t, _ in c) - min(t for t, _ in c) for c in calls)
            slowest = [max(d for _, d in c) for c in calls]
            logger.info("%s %s: the ranks left the barrier %.1f us apart (median), slowest rank per call %.1f us "
                        "(median; quartiles %.1f, %.1f)", self.impl, human(nbytes), spread * 1e6,
                        statistics.median(slowest) * 1e6, *(q * 1e6 for q in statistics.quantiles(slowest, n=4)[::2]))
            return statistics.median(slowest), 0.0
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


def start_groups(impls: list[str], n: int, timeout_s: float = 180) -> list[Group]:
    from spark_hvd.core.transport.rendezvous import KVStoreServer

    secret = make_secret()
    bind = allreduce_hosts.driver_address() if allreduce_hosts.inside() else "127.0.0.1"
    kv = KVStoreServer(secret, host=bind)
    kv_host, kv_port = kv.start()
    listener = socket.socket()
    listener.bind((bind, 0))
    listener.listen(64)
    listener.settimeout(1.0)
    control_addr = f"{bind}:{listener.getsockname()[1]}"
    groups = {impl: Group(impl, n, control_addr, secret, f"{kv_host}:{kv_port}") for impl in impls}
    deadline = time.monotonic() + timeout_s
    while any(len(g.conns) < n for g in groups.values()):
        if time.monotonic() > deadline:
            missing = {i: n - len(g.conns) for i, g in groups.items() if len(g.conns) < n}
            raise TimeoutError(f"workers did not start within {timeout_s:.0f}s: {missing}")
        for g in groups.values():
            for p in g.procs:
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"a {g.impl} worker exited with code {p.returncode} during start-up")
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        sock.settimeout(None)
        conn = FramedSocket(sock, secret, "bench worker")
        _, impl, rank, transport = conn.recv_object()
        groups[impl].conns[rank] = conn
        groups[impl].transports.add(transport)
    listener.close()
    groups_list = [groups[i] for i in impls]
    groups_list[0].kv = kv  # type: ignore[attr-defined]  # keep the KV service alive with the groups
    return groups_list


def bench(n: int, impls: list[str], sizes: list[int], rounds: int,
          quick: bool, mode: str = "loop") -> dict[tuple[str, int], list[tuple[float, float]]]:
    groups = start_groups(impls, n)
    print(f"N={n} transports: " + "; ".join(f"{g.impl}: {'/'.join(sorted(g.transports))}" for g in groups))
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for rnd in range(rounds):
            order = groups[rnd % len(groups):] + groups[:rnd % len(groups)]
            for nbytes in sizes:
                iters = iterations(nbytes, quick) if mode == "loop" else osu_iterations(nbytes)
                warmup = 1 if rnd or nbytes >= (16 << 20) else 3
                for g in order:
                    times.setdefault((g.impl, nbytes), []).append(g.run(nbytes, iters, warmup, mode))
            logger.info("N=%d: round %d/%d done", n, rnd + 1, rounds)
    finally:
        for g in groups:
            g.stop()
        getattr(groups[0], "kv", None) and groups[0].kv.stop()  # type: ignore[attr-defined]
    return times


def table(n: int, impls: list[str], sizes: list[int], times: dict[tuple[str, int], list[tuple[float, float]]]) -> str:
    head = ["size"] + [f"{i} {col}" for i in impls for col in ("time", "busbw", "cpu")] + \
        [f"{i}/gloo" for i in impls if i != "gloo" and "gloo" in impls]
    lines = [f"N={n} (median of {len(next(iter(times.values())))} rounds; time: slowest rank per allreduce; busbw in "
             "GB/s; cpu: CPU time per allreduce per rank; x/gloo = busbw ratio)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    factor = (1 if os.environ.get("BENCH_OP", "allreduce") == "allreduce" else 0.5) * 2 * (n - 1) / n
    for nbytes in sizes:
        med = {i: statistics.median(t for t, _ in times[(i, nbytes)]) for i in impls}
        cpu = {i: statistics.median(c for _, c in times[(i, nbytes)]) for i in impls}
        row = [human(nbytes)]
        for i in impls:
            t = med[i]
            row += [f"{t * 1e3:.3f} ms" if t < 1 else f"{t:.2f} s", f"{factor * nbytes / t / 1e9:.2f}",
                    f"{cpu[i] * 1e3:.3f} ms"]
        if "gloo" in impls:
            row += [f"{med['gloo'] / med[i]:.2f}x" for i in impls if i != "gloo"]
        if allreduce_hosts.inside():  # the fraction of the link rate each one's bus bandwidth reaches
            link = allreduce_hosts.rate_bits(allreduce_hosts.link_rate()) / 8
            row += [f"{factor * nbytes / med[i] / link:.2f}" for i in impls]
        lines.append("| " + " | ".join(row) + " |")
    if allreduce_hosts.inside():
        lines[1] = lines[1].rstrip(" |") + " | " + " | ".join(f"{i}/link" for i in impls) + " |"
        lines[2] += "---|" * len(impls)
        lines[0] += f"; ranks on simulated hosts, links shaped to {allreduce_hosts.link_rate()} (x/link: busbw / link)"
    return "\n".join(lines)


def fusion_case(n: int, iters: int) -> str:
    """161 ResNet-50-shaped tensors through spark_hvd.core's engine vs one allreduce of the same bytes."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "engine_fusion.py"), "--np", str(n), "--iters", str(iters)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return out.stdout.strip() + ("\n" + out.stderr.strip()[-2000:] if out.returncode else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="N=2, 4 KiB..64 MiB, 3 rounds")
    parser.add_argument("--np", default=None, help="comma-separated job sizes (default 2,4)")
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                        help=f"comma-separated subset of {','.join(IMPLS)} (default {','.join(DEFAULT_IMPLS)})")
    parser.add_argument("--sizes", default=None, help="comma-separated sizes, e.g. 4K,1M,256M")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--fusion", action="store_true", help="also run benchmarks/engine_fusion.py (ring, N=2)")
    parser.add_argument("--hosts", type=int, default=None,
                        help="place the ranks on this many simulated hosts (root; benchmarks/allreduce_hosts.py)")
    parser.add_argument("--link", default="2gbit", help="with --hosts: each host's link rate, as tc writes it")
    parser.add_argument("--osu", action="store_true",
                        help="OSU style: a barrier between timed allreduces (osu_allreduce's loop)")
    parser.add_argument("--alternate", action="store_true",
                        help="back-to-back calls alternating two tensors of each size (two names)")
    parser.add_argument("--after-barrier", action="store_true",
                        help="untimed back-to-back warm-up, then hvd.barrier() before each timed call (per call the "
                             "slowest rank; the median over calls)")
    parser.add_argument("--unnamed", action="store_true",
                        help="with --after-barrier: the api calls give no name (hvd.allreduce_(t))")
    parser.add_argument("--op", choices=("allreduce", "reducescatter", "allgather"), default="allreduce",
                        help="the collective timed (SIZE: the whole buffer; busbw (N-1)/N x SIZE / time for the "
                             "other two)")
    parser.add_argument("--new-names", action="store_true",
                        help="back-to-back calls, each under a name not used before (a full negotiation each)")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    if args.hosts and not allreduce_hosts.inside():
        return allreduce_hosts.enter(args.hosts, args.link, [str(Path(__file__).resolve()), *(argv or sys.argv[1:])])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    impls = [i for i in args.impls.split(",") if i]
    for name in impls:
        if name.split(":", 1)[0] not in IMPLS:
            parser.error(f"unknown implementation {name!r} (choose from {', '.join(IMPLS)}, each optionally :VARIANT)")
        try:
            variant_env(name)
        except ValueError as exc:
            parser.error(str(exc))
    nps = [int(x) for x in (args.np or ("2" if args.quick else "2,4")).split(",")]
    os.environ["BENCH_OP"] = args.op  # the workers inherit it
    default_sizes = "4K,64K,1M,16M,64M" if args.quick else "4K,64K,1M,4M,16M,64M,256M"
    sizes = [parse_size(s) for s in (args.sizes or default_sizes).split(",")]
    rounds = args.rounds or (3 if args.quick else 5)
    print(f"# {args.op} float32 SUM, interleaved; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} "
          f"at start; command: {' '.join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])}")
    for n in nps:
        # the hierarchical path needs two "hosts" of at least two ranks each to differ from the TCP ring
        run = [i for i in impls if not i.split(":", 1)[0].endswith("-hier") or n >= 4]
        mode = ("osu" if args.osu else "alt" if args.alternate else "new" if args.new_names
                else ("barnn" if args.unnamed else "bar") if args.after_barrier else "loop")
        if mode != "loop":
            print(f"mode: {_MODES[mode]}")
        times = bench(n, run, sizes, rounds, args.quick, mode)
        print(table(n, run, sizes, times))
        print(f"load average {os.getloadavg()[0]:.1f} after N={n}", flush=True)
    if args.fusion:
        print(fusion_case(2, 10))
    return 0


if __name__ == "__main__":
    sys.exit(main())
