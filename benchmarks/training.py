"""Training throughput: spark_hvd's DistributedOptimizer against torch DistributedDataParallel.

Same model, same synthetic batches, same launcher (``spark-hvd-run``), 1 and 2 processes, the four
configurations interleaved and repeated in one invocation. Reports samples/s (all ranks together, median of
the repeats) and the scaling efficiency ``throughput(2) / (2 * throughput(1))`` of each.

On the CPU (default): a small CNN on 3x32x32 images, DDP over gloo. With ``--gpu``: torchvision's ResNet-50 on
3x224x224 images on each rank's GPU (its local rank), DDP over NCCL, spark_hvd's CUDA gradients over NCCL too;
``--procs 1`` on a one-GPU host (NCCL needs a GPU per rank).

    .venv/bin/python benchmarks/training.py [--repeats 3] [--steps 40] [--batch 32] [--out results.md]
    python benchmarks/training.py --gpu --procs 1 --batch 64 --steps 30
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time

log = logging.getLogger("benchmarks.training")

MODES = ("spark_hvd", "ddp")


# ------------------------------------------------------------------------------------------------ worker side
def _model(gpu: bool = False):
    import torch

    torch.manual_seed(0)
    if gpu:
        import torchvision

        return torchvision.models.resnet50()
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),    # 32 -> 16
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),   # 16 -> 8
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10),
    )


def worker(mode: str, steps: int, warmup: int, batch: int, out_path: str, port: int, gpu: bool) -> None:
    """One rank: train ``warmup + steps`` steps on synthetic images; rank 0 writes samples/s."""
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["SPARK_HVD_RANK"])
    size = int(os.environ["SPARK_HVD_SIZE"])
    device = torch.device("cuda", int(os.environ["SPARK_HVD_LOCAL_RANK"])) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    model = _model(gpu).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode == "spark_hvd":
        import spark_hvd.torch as hvd

        hvd.init()
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        barrier = hvd.barrier
        net = model
    else:
        import torch.distributed as dist

        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if gpu else None)
        barrier = dist.barrier
    g = torch.Generator().manual_seed(1000 + rank)
    side, classes = (224, 1000) if gpu else (32, 10)
    data = [(torch.randn(batch, 3, side, side, generator=g).to(device),
             torch.randint(0, classes, (batch,), generator=g).to(device)) for _ in range(8)]
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()

    for i in range(warmup):
        step(i)
    sync()
    barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    sync()
    barrier()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"samples_per_s": steps * batch * size / elapsed, "elapsed_s": elapsed}, f)
    if mode == "spark_hvd":
        hvd.shutdown()
    else:
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------------ driver side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(mode: str, np_: int, args: argparse.Namespace, tmp: str) -> float:
    from spark_hvd.runner.launch import run_local

    out = os.path.join(tmp, f"{mode}-{np_}-{time.monotonic_ns()}.json")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--batch", str(args.batch), "--result", out, "--port", str(_free_port()),
            *(["--gpu"] if args.gpu else [])]
    env = {"OMP_NUM_THREADS": "1"}
    result = run_local(argv, np_, env=env, timeout=args.timeout, capture=True, verbose=0)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} on {np_} process(es) failed (exit {result.returncode}):\n"
                           + "\n".join(result.stderr[-30:]))
    with open(out) as f:
        return float(json.load(f)["samples_per_s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=32, help="images per process per step")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", help="also write the markdown table here")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--gpu", action="store_true", help="ResNet-50 on each rank's GPU, DDP over NCCL")
    p.add_argument("--procs", default="1,2", help="process counts, e.g. 1,2")
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.batch, args.result, args.port, args.gpu)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    procs = [int(n) for n in args.procs.split(",")]
    configs = [(m, n) for n in procs for m in MODES]
    load_before = os.getloadavg()[0]
    samples: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = configs if rep % 2 == 0 else list(reversed(configs))  # interleave, alternate the order
            for mode, n in order:
                sps = run_config(mode, n, args, tmp)
                samples[(mode, n)].append(sps)
                log.info("repeat %d  %-9s np=%d  %8.1f samples/s", rep, mode, n, sps)
    med = {c: statistics.median(v) for c, v in samples.items()}
    what = "ResNet-50 (3x224x224 -> 1000" if args.gpu else "small CNN (3x32x32 -> 10"
    lines = [
        f"{what}, {sum(p.numel() for p in _model(args.gpu).parameters()):,} parameters), SGD+momentum, "
        f"batch {args.batch} per process, {args.steps} timed steps after {args.warmup} warm-up, "
        f"median of {args.repeats} interleaved repeats, 1 torch thread per process"
        + (", one GPU per process" if args.gpu else ""),
        "",
        f"| processes | spark_hvd DistributedOptimizer (samples/s) | torch DDP {'nccl' if args.gpu else 'gloo'} "
        "(samples/s) | spark_hvd / DDP |",
        "| --- | --- | --- | --- |",
    ]
    for n in procs:
        a, b = med[("spark_hvd", n)], med[("ddp", n)]
        lines.append(f"| {n} | {a:.1f} | {b:.1f} | {a / b:.2f} |")
    lines += ["", f"1-minute load average of this {os.cpu_count()}-core host: {load_before:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end"]
    if 1 in procs and 2 in procs:
        eff = {m: med[(m, 2)] / (2 * med[(m, 1)]) for m in MODES}
        lines += ["", f"scaling efficiency 1 -> 2 processes: spark_hvd {eff['spark_hvd']:.2f}, DDP {eff['ddp']:.2f}"]
    lines += ["", "all runs (samples/s): " + "; ".join(
                  f"{m} np={n}: " + ", ".join(f"{v:.1f}" for v in samples[(m, n)]) for m, n in configs)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
