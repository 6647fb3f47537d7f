"""Engine fusion benchmark: ResNet-50's 161 gradients enqueued one by one vs one allreduce of the same bytes.

Each iteration, on every rank, runs interleaved (after a barrier each):

- ``tensors``: 161 float32 arrays shaped like ResNet-50's parameters (25.6 M values, 102 MB) submitted one by one
  with ``allreduce_async`` and then synchronized (negotiation, response cache, fusion, collectives);
- ``single``: one ``allreduce`` through the engine of one array of the same 25.6 M values.

It prints the median time of each and their ratio (target: tensors / single <= 1.1 at N=2)::

    .venv/bin/python benchmarks/engine_fusion.py --np 2 --iters 15 [--backend ring|torch] [--fusion-mib 64]
    .venv/bin/python benchmarks/engine_fusion.py --np 2 --iters 15 --pages huge   # numpy's default memory
    .venv/bin/python benchmarks/engine_fusion.py --np 2 --iters 15 --bare         # the backend alone too
    .venv/bin/python benchmarks/engine_fusion.py --iters 20 --loops               # the cross-memory loops alone

Each variant's process CPU (every thread: the engine's and the backend's work, not the waits for the peer) is
printed under its wall time: on a loaded machine their difference is the steadier measure of what the engine adds.

``--np 1`` (a job of one rank: the backend does nothing) leaves the engine's own cost: enqueueing, the round, the
handles.

Over TCP (``SPARK_HVD_SHM=0``) from three ranks the 161 tensors of a round are reduced where they lie as from two
(one ring over them: ``RingBackend._tcp_allreduce_fused``); ``--hosts K`` gives the ranks K host identities
(``SPARK_HVD_HOST_ID``, the first ranks on the first host), so the ring backend runs its hierarchical plan: shared
memory within each "host", TCP between them (loopback: no link is shaped; what the engine's fusion buffer costs
there, not the network)::

    SPARK_HVD_SHM=0 .venv/bin/python benchmarks/engine_fusion.py --np 3 --iters 15 --bare   # TCP ring, 3 ranks
    .venv/bin/python benchmarks/engine_fusion.py --np 4 --hosts 2 --iters 15                  # ring-hier, 2 x 2

``--bare`` also times the backend without the engine, interleaved with the rest: ``allreduce_fused`` of the 161
arrays against ``allreduce`` of the one, wall time and the calling thread's CPU (on a loaded machine the CPU tells
the backend's own cost apart from waiting for the peer). Its backend has a mesh of its own: on the engine's, an
engine heartbeat falling in a bare call (one a second while the engine idles) interleaved its frames with the
call's (seen once at 3 ranks under load 6: a frame failing its authentication check).

``--loops`` times only the two loops of the cross-memory allreduce (``shm_cma``) in one process, no ranks: its
compiled reduce-scatter and its allgather read over all 102 MB, on the 161 arrays and on one array (what the many
arrays cost the loops themselves, without a peer to wait for).

``--pages``: the memory every array of the benchmark lives in. ``small`` (the default) allocates them as torch
allocates tensors, in 4 KiB pages (torch asks for transparent huge pages only with ``THP_MEM_ALLOC_ENABLE=1``);
``huge`` leaves numpy's default, which asks the kernel for transparent huge pages for arrays from 4 MiB. The page
size alone moves a two-rank shared-memory allreduce of 102 MB by up to ~1.7x (cross-memory attach pins the
peer's pages one by one), and with ``huge`` the one 102 MB array gets huge pages where only the gradients from
4 MiB do (issue 45): the two variants then compare memory more than the engine.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import statistics
import sys
import time

import numpy as np


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of torchvision's ResNet-50, in model order (161 tensors, 25,557,032 values)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,), (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


def _loops(iters: int, pages: str) -> None:
    """``--loops``: the two loops of the cross-memory allreduce (``shm_cma``) over all 102 MB in one process, its
    own memory standing for the peer's: the reduce-scatter's compiled loop (``_ringloop.cma_reduce``: block reads
    into the scratch, reduced piece by piece) and the allgather's one ``process_vm_readv``, each on the 161 arrays
    and on one array of the same bytes, interleaved; the calling thread's CPU, medians. No peer to wait for: what
    the many arrays cost the loops themselves."""
    if pages == "small":
        from numpy._core.multiarray import _set_madvise_hugepage

        _set_madvise_hugepage(False)
    from spark_hvd.core.transport import shm_cma

    if shm_cma._CMA_REDUCE is None:
        sys.exit("--loops needs the compiled loop (setup.py build_ext --inplace) on Linux")
    rng = np.random.default_rng(0)
    mine = [rng.standard_normal(s).astype(np.float32).reshape(-1) for s in reversed(resnet50_shapes())]
    theirs = [a.copy() for a in mine]
    cases = {"161 arrays": (mine, theirs), "one array": ([np.concatenate(mine)], [np.concatenate(theirs)])}
    scratch, pid, nbytes = np.empty(shm_cma.BLOCK_BYTES, np.uint8), os.getpid(), cases["one array"][0][0].nbytes
    times: dict[str, list[float]] = {f"{k}: {loop}": [] for k in cases for loop in ("reduce-scatter", "allgather")}
    for _ in range(iters):
        for name, (a, b) in cases.items():
            table = [np.array([(x.ctypes.data, x.nbytes) for x in arrays], np.int64).reshape(-1) for arrays in (a, b)]
            c0 = time.thread_time()
            shm_cma._CMA_REDUCE(pid, table[0], table[1], scratch, 0, nbytes, 0, 0, 1)  # float32 SUM
            c1 = time.thread_time()
            shm_cma.read_peer(pid, [(x.ctypes.data, x.nbytes) for x in a], [(x.ctypes.data, x.nbytes) for x in b],
                              0, "allgather")
            c2 = time.thread_time()
            times[f"{name}: reduce-scatter"].append(c1 - c0)
            times[f"{name}: allgather"].append(c2 - c1)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"the cross-memory loops over all {nbytes / 1e6:.1f} MB in one process, {iters} iterations, {pages} pages: "
          "calling thread's CPU, median ms")
    for k, v in med.items():
        print(f"{k:40s} {v:8.2f}")
    for loop in ("reduce-scatter", "allgather"):
        print(f"{loop}: 161 arrays / one {med[f'161 arrays: {loop}'] / med[f'one array: {loop}']:.3f}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


def _rank(env: dict[str, str], iters: int, warmup: int, pages: str, bare: bool, queue: multiprocessing.Queue) -> None:
    os.environ.update(env)
    if pages == "small":  # as torch allocates: no madvise(MADV_HUGEPAGE) on large arrays
        from numpy._core.multiarray import _set_madvise_hugepage

        _set_madvise_hugepage(False)
    import spark_hvd.core as core
    from spark_hvd.core.backend import ReduceOp

    core.init()
    try:
        shapes = resnet50_shapes()
        rng = np.random.default_rng(core.rank())
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        # backward order: the last layer's gradient is ready first
        order = list(reversed(range(len(grads))))
        flat = np.concatenate([g.reshape(-1) for g in grads])
        times: dict[str, list[float]] = {"tensors": [], "single": [], "tensors cpu": [], "single cpu": []}
        if bare:
            times.update({"bare fused": [], "bare single": [], "bare fused cpu": [], "bare single cpu": []})
        backend = _bare_backend() if bare else None
        backward = [grads[i] for i in order]
        for it in range(warmup + iters):
            if bare:
                for key, call in (("bare fused", lambda: backend.allreduce_fused(backward, ReduceOp.SUM)),
                                  ("bare single", lambda: backend.allreduce(flat, ReduceOp.SUM))):
                    core.barrier()
                    w0, c0 = time.perf_counter(), time.thread_time()
                    call()
                    w1, c1 = time.perf_counter(), time.thread_time()
                    if it >= warmup:
                        times[key].append(w1 - w0)
                        times[key + " cpu"].append(c1 - c0)
            core.barrier()
            t0, p0 = time.perf_counter(), time.process_time()
            handles = [core.allreduce_async(grads[i], name=f"grad.{i}") for i in order]
            for h in handles:
                core.synchronize(h)
            t1, p1 = time.perf_counter(), time.process_time()
            core.barrier()
            t2, p2 = time.perf_counter(), time.process_time()
            core.allreduce(flat, name="flat")
            t3, p3 = time.perf_counter(), time.process_time()
            if it >= warmup:
                times["tensors"].append(t1 - t0)
                times["single"].append(t3 - t2)
                times["tensors cpu"].append(p1 - p0)
                times["single cpu"].append(p3 - p2)
        stats = dict(core.get_engine().stats)
        queue.put((core.rank(), times, stats, core.backend_name(), getattr(core.get_engine().backend, "transport", "")))
        if backend is not None:
            backend.close()
    finally:
        core.shutdown()


def _bare_backend():
    """``--bare``'s backend: a ring backend of the same job settings on a mesh of its own (a job id of its own), so
    that no engine round (a heartbeat among them: one a second while the engine idles) shares its sockets."""
    from spark_hvd.core.backends.ring import RingBackend
    from spark_hvd.core.jobenv import JobEnv
    from spark_hvd.core.settings import Settings
    from spark_hvd.core.transport.rendezvous import KVRendezvous

    job, settings = JobEnv.from_env(), Settings.from_env()
    job_id = f"{job.job_id}-bare"
    return RingBackend(job.rank, job.size, KVRendezvous(job.rendezvous, job.secret, job_id, settings.timeout_s),
                       job.secret, settings, job_id, job=job)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=2, help="number of ranks")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", default="ring", choices=["ring", "torch"])
    parser.add_argument("--fusion-mib", type=float, default=None, help="SPARK_HVD_FUSION_THRESHOLD in MiB")
    parser.add_argument("--pages", default="small", choices=["small", "huge"],
                        help="the arrays' memory: 4 KiB pages as torch's tensors (default), or numpy's transparent "
                             "huge pages from 4 MiB")
    parser.add_argument("--bare", action="store_true",
                        help="also time the backend alone: allreduce_fused of the arrays against allreduce of one")
    parser.add_argument("--hosts", type=int, default=0,
                        help="give the ranks this many host identities (the ring's hierarchical plan)")
    parser.add_argument("--loops", action="store_true",
                        help="only the cross-memory pair's two loops in this one process (no ranks), see below")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.loops:
        _loops(args.iters, args.pages)
        return

    from spark_hvd.core.transport.rendezvous import KVStoreServer
    from spark_hvd.core.transport.wire import make_secret

    shapes = resnet50_shapes()
    total = sum(int(np.prod(s)) for s in shapes)
    secret = make_secret()
    server = KVStoreServer(secret)
    host, port = server.start()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    try:
        for r in range(args.np):
            env = {"SPARK_HVD_RANK": str(r), "SPARK_HVD_SIZE": str(args.np), "SPARK_HVD_RENDEZVOUS": f"{host}:{port}",
                   "SPARK_HVD_SECRET": secret.hex(), "SPARK_HVD_JOB_ID": f"bench{os.getpid()}",
                   "SPARK_HVD_BACKEND": args.backend, "OMP_NUM_THREADS": "1", "SPARK_HVD_TIMEOUT": "120"}
            if args.hosts:
                env["SPARK_HVD_HOST_ID"] = f"bench-host-{args.hosts * r // args.np}"
            if args.fusion_mib is not None:
                env["SPARK_HVD_FUSION_THRESHOLD"] = str(int(args.fusion_mib * 1024 * 1024))
            p = ctx.Process(target=_rank, args=(env, args.iters, args.warmup, args.pages, args.bare, queue),
                            daemon=True)
            p.start()
            procs.append(p)
        results = [queue.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        server.stop()
    results.sort(key=lambda x: x[0])
    _, times, stats, backend, transport = results[0]
    # an iteration's time is the slowest rank's
    per_iter = {k: [max(res[1][k][i] for res in results) for i in range(args.iters)] for k in times}
    med = {k: statistics.median(v) for k, v in per_iter.items()}
    print(f"engine fusion benchmark: N={args.np}, backend={backend} ({transport}), {len(shapes)} tensors, "
          f"{total:,} float32 values ({total * 4 / 1e6:.1f} MB), {args.iters} iterations after {args.warmup} warm-up, "
          f"fusion threshold {args.fusion_mib if args.fusion_mib is not None else 64} MiB, {args.pages} pages"
          + (f", {args.hosts} host identities" if args.hosts else ""))
    print(f"{'variant':<34}{'median ms':>12}{'min ms':>10}{'max ms':>10}")
    labels = {"tensors": "161 tensors, enqueued one by one", "single": "one allreduce, same bytes",
              "tensors cpu": "  161: the process's CPU", "single cpu": "  one: the process's CPU",
              "bare fused": "backend: allreduce_fused of 161", "bare single": "backend: allreduce of one",
              "bare fused cpu": "  fused: calling thread's CPU", "bare single cpu": "  one: calling thread's CPU"}
    for key in times:
        v = per_iter[key]
        print(f"{labels[key]:<34}{med[key] * 1e3:>12.2f}{min(v) * 1e3:>10.2f}{max(v) * 1e3:>10.2f}")
    ratio = med["tensors"] / med["single"]
    print(f"ratio tensors/single: {ratio:.3f} of medians (target <= 1.1), "
          f"{min(per_iter['tensors']) / min(per_iter['single']):.3f} of minimums")
    print(f"the process's CPU (every thread; the steadier figure on a loaded machine), 161 tensors / one: "
          f"{med['tensors cpu'] / med['single cpu']:.3f} of medians, "
          f"+{(med['tensors cpu'] - med['single cpu']) * 1e3:.2f} ms")
    if args.bare:
        print(f"backend alone, fused/single: wall {med['bare fused'] / med['bare single']:.3f}, calling thread's "
              f"CPU {med['bare fused cpu'] / med['bare single cpu']:.3f} (medians)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"rank 0 engine stats: rounds={stats.get('rounds', 0)}, allreduce collectives="
          f"{stats.get('allreduce_collectives', 0)} for {stats.get('allreduce_tensors', 0)} tensors, "
          f"cache hits={stats.get('cache_hits', 0)}, full requests={stats.get('full_requests', 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
