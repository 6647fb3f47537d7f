"""Device path benchmark: torch tensors reduced where they lie vs staged through host memory and the ring.

The same training-like step runs in two jobs of ``--np`` ranks launched back to back by this script (rounds
alternate, so both see the same load): ResNet-50's 161 gradient shapes as torch tensors, allreduced with
``grouped_allreduce_`` (negotiation, fusion, the collectives), ``--iters`` times after a warm-up.

- on a CUDA host with at least ``--np`` GPUs the tensors are on each rank's GPU (its local rank): ``device`` =
  NCCL on the GPUs, ``host`` = ``SPARK_HVD_DEVICE_BACKEND=none`` (copied to host memory, reduced by the ring,
  copied back). That is issue 15's "NCCL vs the ring through host memory" row;
- without CUDA (or with ``--cpu``) the tensors are CPU tensors: ``device`` = gloo standing in for NCCL
  (``SPARK_HVD_DEVICE_BACKEND=gloo``), ``host`` = the ring. A smoke run of the device plumbing: it only says what
  the stand-in costs, not what NCCL would.

``peer``: the same step by hand on ``torch.distributed`` (NCCL on GPUs, gloo on the CPU): the tensors packed into
buckets of at most ``SPARK_HVD_FUSION_THRESHOLD`` bytes, one ``all_reduce`` each, copied back (what a fusion buffer
does; DDP's buckets do the same). Not run with ``--process-set``.

``--process-set``: the step runs on a process set of the first ``--np - 1`` ranks (the last rank only registers
and removes the set), so ``device`` is the set's own group (an NCCL communicator of its members; gloo on CPU)
and ``host`` the set's ring through host memory.

NCCL needs one GPU per rank (two ranks on one GPU is an error): on a host with fewer GPUs than ``--np`` the script
stops and says so. It prints the median seconds per step of each mode, host / device, and a RESULTS.md row::

    .venv/bin/python benchmarks/device_allreduce.py --np 2 --iters 10 [--rounds 2] [--scale 1.0] [--cpu]
    .venv/bin/python benchmarks/device_allreduce.py --np 3 --process-set --iters 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _peer_step(grads: list, threshold: int) -> Any:
    """The peer's step (see the module docstring)."""
    import torch
    import torch.distributed as dist

    def step() -> None:
        bucket: list = []
        size = 0
        for g in [*grads, None]:
            if g is None or (bucket and size + g.numel() * g.element_size() > threshold):
                flat = torch.cat([t.view(-1) for t in bucket])
                dist.all_reduce(flat)
                for t, piece in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                    t.copy_(piece.view_as(t))
                bucket, size = [], 0
            if g is not None:
                bucket.append(g)
                size += g.numel() * g.element_size()

    return step


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(iters: int, scale: float, cpu: bool, subset: bool, peer: bool) -> None:
    import torch
    from engine_fusion import resnet50_shapes

    import spark_hvd.torch as hvd

    hvd.init()
    on_gpu = torch.cuda.is_available() and not cpu
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    shapes = resnet50_shapes()
    if scale != 1.0:
        shapes = [(max(1, int(s[0] * scale)), *s[1:]) for s in shapes]
    grads = [torch.randn(s, device=device) for s in shapes]
    ps = hvd.add_process_set(list(range(hvd.size() - 1))) if subset else hvd.global_process_set
    step = lambda: hvd.grouped_allreduce_(grads, name="grads", process_set=ps)  # noqa: E731
    if peer:  # torch.distributed itself, meeting through a TCPStore (a benchmark on one host)
        import torch.distributed as dist

        from spark_hvd.core.settings import Settings

        port = hvd.broadcast_object(_free_port() if hvd.rank() == 0 else None, root_rank=0)
        store = dist.TCPStore("127.0.0.1", port, hvd.size(), hvd.rank() == 0)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=hvd.rank(),
                                world_size=hvd.size())
        step = _peer_step(grads, Settings.from_env().fusion_threshold)
    times = []
    for i in range(iters + 2 if ps.included() else 0):
        hvd.barrier(process_set=ps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    if hvd.rank() == 0:
        values = sum(int(np.prod(s)) for s in shapes)
        print("RESULT " + json.dumps({"median_s": statistics.median(times), "values": values,
                                      "device": device.type, "ranks": ps.size()}), flush=True)
    if subset:
        hvd.remove_process_set(ps)
    if peer:
        dist.destroy_process_group()
    hvd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each mode")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each tensor's first dimension")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors and the gloo stand-in even with CUDA")
    parser.add_argument("--process-set", action="store_true",
                        help="reduce on a process set of the first np - 1 ranks (np >= 3)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.iters, args.scale, args.cpu, args.process_set, args.peer)
        return
    if args.process_set and args.np < 3:
        raise SystemExit("--process-set needs --np 3 or more (a set of np - 1 ranks other than the whole job)")
    import torch

    from spark_hvd.runner.launch import run_local

    cuda = torch.cuda.is_available() and not args.cpu
    if cuda and torch.cuda.device_count() < args.np:
        raise SystemExit(f"--np {args.np} needs {args.np} GPUs, one per rank (NCCL refuses two ranks on one GPU); "
                         f"{torch.cuda.device_count()} visible: use --np {torch.cuda.device_count()} or --cpu")
    modes = {"device": "nccl" if cuda else "gloo", "host": "none", **({} if args.process_set else {"peer": "none"})}
    results: dict[str, list[float]] = {m: [] for m in modes}
    values, kind, ranks = 0, "", args.np
    for _ in range(args.rounds):
        for mode, setting in modes.items():
            argv = [sys.executable, os.path.abspath(__file__), "--worker", "--iters", str(args.iters),
                    "--scale", str(args.scale), *(["--cpu"] if args.cpu else []),
                    *(["--process-set"] if args.process_set else []), *(["--peer"] if mode == "peer" else [])]
            out = run_local(argv, args.np, env={"SPARK_HVD_DEVICE_BACKEND": setting, "OMP_NUM_THREADS": "1"},
                            timeout=900, capture=True)
            if out.returncode != 0:
                raise SystemExit(f"{mode} run failed ({out.returncode}):\n" + "\n".join(out.stderr[-30:]))
            line = next(x for x in out.stdout if "RESULT " in x)
            report = json.loads(line.split("RESULT ", 1)[1])
            results[mode].append(report["median_s"])
            values, kind, ranks = report["values"], report["device"], report["ranks"]
    device_s, host_s = statistics.median(results["device"]), statistics.median(results["host"])
    where = f", on a process set of {ranks} ranks" if args.process_set else ""
    print(f"np={args.np} tensors=161 values={values} ({values * 4 / 2**20:.1f} MiB float32) on {kind}{where}")
    print(f"device path ({modes['device']}): {device_s * 1000:.1f} ms/step   runs {results['device']}")
    print(f"through host (ring):  {host_s * 1000:.1f} ms/step   runs {results['host']}")
    print(f"host / device: {host_s / device_s:.2f}")
    peer = ""
    if "peer" in results:
        peer_s = statistics.median(results["peer"])
        print(f"peer, torch.distributed {modes['device']} in fusion-sized buckets: {peer_s * 1000:.1f} ms/step   "
              f"runs {results['peer']}   peer / device: {peer_s / device_s:.2f}")
        peer = f" torch.distributed: {peer_s * 1000:.1f} ms | {peer_s / device_s:.2f} |"
    name = torch.cuda.get_device_name(0) if cuda else "CPU (gloo stand-in, not NCCL)"
    np_col = f"{args.np} (set of {ranks})" if args.process_set else str(args.np)
    print(f"| {name} | {np_col} | {values * 4 / 2**20:.1f} MiB, 161 tensors | {modes['device']}: "
          f"{device_s * 1000:.1f} ms | ring through host: {host_s * 1000:.1f} ms | {host_s / device_s:.2f} |{peer}")


if __name__ == "__main__":
    main()
