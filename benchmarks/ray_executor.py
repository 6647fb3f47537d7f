"""``RayExecutor`` against Ray Train's ``TorchTrainer`` (gloo) on one local Ray cluster, 2 workers, interleaved
rounds; each round starts both from nothing (the executor's actors, the trainer's worker group) and takes:

- ``first_allreduce_s``: from the driver's ``executor.start()`` to the moment rank 0's first ``hvd.allreduce``
  (8 floats, spark_hvd.torch) completed; ``first_step_s``: to the end of its first training step of a small
  model (``hvd.broadcast_parameters`` + ``hvd.DistributedOptimizer``, one SGD step);
- ``TorchTrainer``'s ``first_step_s``: from ``TorchTrainer(..., ScalingConfig(num_workers=2)).fit()`` to the end of
  rank 0's first DDP step (``DistributedDataParallel`` of the same model, one SGD step), as Ray Train starts it;
- ``busbw_GBps`` at each ``--sizes`` MiB: float32 SUM allreduce bus bandwidth between the two workers, on the
  started group (``hvd.allreduce_`` / ``torch.distributed.all_reduce`` on gloo, in place), ``--steps`` timed calls
  after one warm-up, ``bytes * 2 (n - 1) / n / seconds`` (n = 2: bytes / seconds) from rank 0's own clock.

Both sides import torch in fresh worker processes each round. Ratios are per round (ours / theirs for the times,
ours / theirs for bandwidth) and their medians are printed with every figure.

    python benchmarks/ray_executor.py --rounds 3 --sizes 16,64 --steps 10

Ray runs with 4 CPUs, an 80 MiB object store, no dashboard, on loopback, as ``tests/ray`` does (the benchmark
stops if Ray Train's ``MASTER_ADDR`` is not 127.0.0.1).

``--worker-niceness N`` starts Ray's workers (both sides' ranks) at niceness N (``RAY_worker_niceness``); Ray's
default is 15, which on a machine shared with other work at niceness 0 gives both sides' ranks a small share of
the CPUs, so that at load the bandwidths measure the scheduler more than the allreduces. The niceness the ranks
ran at is printed (``nice``).

``--outside`` compares instead the allreduce inside the executor's actors with the same ranks outside Ray
(``spark_hvd.runner.launch.run_local``), interleaved: each round runs the bandwidth loops in the 2 actors as Ray
runs them, in the same actors with every thread reniced to 0 (``--renice``; root only: Linux lets no one else
lower a niceness), and in 2 ranks launched outside Ray; each side prints what its rank 0 sees (the ring's
shared-memory plan and whether it reads its peer's memory directly, ``cma``; the compiled loop, spinning, CPU
affinity, ``OMP_NUM_THREADS``, torch's threads, niceness, host id; its session and scheduler autogroup; the CPU
seconds of each of its threads during the loops).

    python benchmarks/ray_executor.py --outside --renice --rounds 3 --sizes 16,64 --steps 20

``--simhosts RATE`` runs the same rounds across 2 simulated hosts (root; ``tests/multihost/test_ray_hosts.py``'s
cluster: ``ray start --head`` on host 0, a 2-CPU Ray node on each of hosts 1 and 2, links shaped to ``RATE``), the
driver on host 0: ``RayExecutor(num_hosts=2, num_workers_per_host=1)`` against ``TorchTrainer`` with one worker a
host (``STRICT_SPREAD``, gloo on ``eth0``); ``link_fraction`` is the bus bandwidth over the link's rate.

    sudo -E env PATH=$PATH PYTHONPATH=$PWD python benchmarks/ray_executor.py --simhosts 2gbit --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
# loopback only (as tests/ray): Ray's node address (what Ray Train makes MASTER_ADDR) stays 127.0.0.1 instead of
# the machine's routed address, and gloo's device is loopback; Ray's workers inherit both
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def hvd_side(sizes: list[float], steps: int) -> dict[str, Any]:
    """On each RayExecutor rank: the first allreduce, the first training step, then the bandwidth loops."""
    import torch

    import spark_hvd.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(8), name="first")
    first_allreduce = time.time()
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    opt.zero_grad()
    model(torch.ones(8, 32)).pow(2).mean().backward()
    opt.step()
    first_step = time.time()
    busbw = _busbw(sizes, steps)
    return {"rank": hvd.rank(), "first_allreduce": first_allreduce, "first_step": first_step, "busbw": busbw,
            "nice": os.nice(0)}


def _busbw(sizes: list[float], steps: int) -> dict[str, float]:
    """On each of the 2 ranks: GB/s of ``steps`` in-place float32 SUM allreduces of each size (MiB) after one
    warm-up (``spark_hvd.torch``; 2 ranks: bus bandwidth = bytes / seconds)."""
    import torch

    import spark_hvd.torch as hvd

    busbw = {}
    for mib in sizes:
        t = torch.ones(int(mib * 2**18))
        hvd.allreduce_(t, op=hvd.Sum, name=f"bw{mib}")
        start = time.perf_counter()
        for _ in range(steps):
            hvd.allreduce_(t, op=hvd.Sum, name=f"bw{mib}")
        seconds = time.perf_counter() - start
        assert float(t[0]) == 2.0 ** (steps + 1), float(t[0])  # 2 ranks, SUM, steps + 1 times
        busbw[str(mib)] = round(t.numel() * 4 * steps / seconds / 1e9, 4)
    return busbw


def gloo_side(config: dict[str, Any]) -> None:
    """On each Ray Train worker: the first DDP step, then the bandwidth loops on Ray Train's gloo group; rank 0
    writes its figures to ``config["out"]`` (Ray Train 2.60 keeps only metrics reported with a checkpoint)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(torch.ones(8, 32)).pow(2).mean().backward()
    opt.step()
    first_step = time.time()
    busbw = {}
    for mib in config["sizes"]:
        t = torch.ones(int(mib * 2**18))
        dist.all_reduce(t)
        start = time.perf_counter()
        for _ in range(config["steps"]):
            dist.all_reduce(t)
        seconds = time.perf_counter() - start
        assert float(t[0]) == 2.0 ** (config["steps"] + 1), float(t[0])
        busbw[str(mib)] = t.numel() * 4 * config["steps"] / seconds / 1e9
    if dist.get_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump({"first_step": first_step, "busbw": busbw, "master": os.environ.get("MASTER_ADDR"),
                       "nice": os.nice(0)}, f)


def _renice(value: int) -> None:
    """Every thread of this process to niceness ``value`` (Linux keeps a niceness per thread)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), value)
        except OSError:  # a thread that ended
            pass


def seen_by_rank(sizes: list[float], steps: int, nice: int | None = None) -> dict[str, Any]:
    """On a rank, inside or outside Ray: what it runs with, then the bandwidth loops (at niceness ``nice`` if
    given, restored after)."""
    import torch

    import spark_hvd.core as core
    import spark_hvd.torch as hvd

    hvd.init()
    before = os.nice(0)
    if nice is not None:
        _renice(nice)
    backend = core.get_engine().backend
    plan = getattr(backend, "plan", None)
    seen = {"plan": type(plan).__name__, "cma": getattr(plan, "cma", None) is not None,
            "compiled": getattr(backend, "_compiled", None),
            "spin": getattr(backend, "_spin", None), "affinity": sorted(os.sched_getaffinity(0)),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
            "nice": os.nice(0), "host_id": os.environ.get("SPARK_HVD_HOST_ID"), "local_size": hvd.local_size()}
    cpu_before = _thread_cpu()
    busbw = _busbw(sizes, steps)
    cpu_after = _thread_cpu()
    if nice is not None:
        _renice(before)
    seen["memory"] = _memory()
    seen["session"] = _session()
    # the CPU seconds each thread used during the loops, busiest first: the allreduce's, and any of Ray's
    used = {tid: round(cpu_after[tid][1] - cpu_before[tid][1], 3) for tid in cpu_after if tid in cpu_before}
    seen["threads"] = len(cpu_after)
    seen["thread_cpu_s"] = sorted(([cpu_after[t][0], s] for t, s in used.items() if s > 0), key=lambda x: -x[1])
    return {**seen, "busbw": busbw}


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """This process's threads: native id -> (name, CPU seconds used so far) (Linux ``/proc/self/task``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # a thread that ended
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    return out


def _session() -> dict[str, Any]:
    """This process's session and its scheduler autogroup (Linux ``sched_autogroup``: with it on, the CPUs are
    shared fairly between sessions before processes, and a group's niceness weighs it against the others)."""
    try:
        with open("/proc/self/autogroup") as f:
            group = f.read().strip()
    except OSError:
        group = None
    return {"sid": os.getsid(0), "pid": os.getpid(), "autogroup": group}


def _memory() -> dict[str, str]:
    """This process's huge pages in use and whether it may have them, and its malloc preload (Linux)."""
    out = {"LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}
    for path, names in (("/proc/self/smaps_rollup", ("AnonHugePages",)), ("/proc/self/status", ("THP_enabled",))):
        try:
            with open(path) as f:
                out.update({k: v.strip() for k, _, v in (line.partition(":") for line in f) if k in names})
        except OSError:
            pass
    return out


def compare_outside(args: argparse.Namespace, sizes: list[float], temp_dir: str) -> None:
    """``--outside``: see the module docstring."""
    from spark_hvd.ray import RayExecutor
    from spark_hvd.runner.launch import run_local

    sides = ["ray", "ray_nice0", "outside"] if args.renice else ["ray", "outside"]
    res: dict[str, list[float]] = {}
    seen: dict[str, dict[str, Any]] = {}
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2, cpus_per_worker=1)
    executor.start()
    try:
        for _ in range(args.rounds):
            for side in sides:
                if side == "outside":
                    path = os.path.join(temp_dir, "outside.json")
                    result = run_local([sys.executable, os.path.abspath(__file__), "--rank-outside", path,
                                        args.sizes, str(args.steps)], 2, capture=True, verbose=0, timeout=600)
                    if result.returncode:
                        raise RuntimeError(f"the ranks outside Ray failed: {result.stderr[-20:]}")
                    with open(path) as f:
                        out = json.load(f)
                else:
                    out = executor.run(seen_by_rank, args=[sizes, args.steps, 0 if side == "ray_nice0" else None])[0]
                seen[side] = {k: v for k, v in out.items() if k != "busbw"}
                for mib, bw in out["busbw"].items():
                    res.setdefault(f"{side}.busbw_GBps.{mib}MiB", []).append(bw)
            for side in sides[:-1]:
                for mib in out["busbw"]:
                    res.setdefault(f"ratio.{side}_vs_outside.{mib}MiB", []).append(round(
                        res[f"{side}.busbw_GBps.{mib}MiB"][-1] / res[f"outside.busbw_GBps.{mib}MiB"][-1], 4))
    finally:
        executor.shutdown()
    print(json.dumps({"rounds": args.rounds, "sizes_MiB": sizes, "steps": args.steps, "seen_by_rank_0": seen,
                      "median": {k: round(statistics.median(v), 4) for k, v in res.items()}, "all": res},
                     indent=1), file=sys.stdout)


def rounds(args: argparse.Namespace, sizes: list[float], temp_dir: str, executor_kwargs: dict[str, Any],
           scaling: dict[str, Any], master: str | None) -> dict[str, list[float]]:
    """The interleaved rounds (see the module docstring); ``master``: the ``MASTER_ADDR`` Ray Train must use (None:
    any)."""
    import ray.train.torch as ray_torch
    from ray.train import RunConfig, ScalingConfig

    from spark_hvd.ray import RayExecutor

    res: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        res.setdefault(key, []).append(round(value, 4))

    for _ in range(args.rounds):
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), **executor_kwargs)
        t0 = time.time()
        executor.start()
        try:
            out = executor.run(hvd_side, args=[sizes, args.steps])[0]
        finally:
            executor.shutdown()
        add("ray_executor.first_allreduce_s", out["first_allreduce"] - t0)
        add("ray_executor.first_step_s", out["first_step"] - t0)
        for mib, bw in out["busbw"].items():
            add(f"ray_executor.busbw_GBps.{mib}MiB", bw)
        add("ray_executor.nice", out["nice"])

        path = os.path.join(temp_dir, "gloo_side.json")
        trainer = ray_torch.TorchTrainer(
            gloo_side, train_loop_config={"sizes": sizes, "steps": args.steps, "out": path},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, **scaling),
            torch_config=ray_torch.TorchConfig(backend="gloo"), run_config=RunConfig(storage_path=temp_dir))
        t0 = time.time()
        trainer.fit()
        with open(path) as f:
            theirs = json.load(f)
        os.unlink(path)
        if master is not None and theirs["master"] != master:
            raise RuntimeError(f"Ray Train's MASTER_ADDR is {theirs['master']}, not {master}")
        add("torch_trainer.first_step_s", theirs["first_step"] - t0)
        for mib, bw in theirs["busbw"].items():
            add(f"torch_trainer.busbw_GBps.{mib}MiB", bw)
        add("torch_trainer.nice", theirs["nice"])
        add("ratio.first_allreduce_vs_ddp_step", res["ray_executor.first_allreduce_s"][-1]
            / res["torch_trainer.first_step_s"][-1])
        add("ratio.first_step_vs_ddp_step", res["ray_executor.first_step_s"][-1]
            / res["torch_trainer.first_step_s"][-1])
        for mib in out["busbw"]:
            add(f"ratio.busbw.{mib}MiB", out["busbw"][mib] / theirs["busbw"][mib])
    return res


def _summary(args: argparse.Namespace, sizes: list[float], res: dict[str, list[float]], **extra: Any) -> str:
    return json.dumps({"rounds": args.rounds, "sizes_MiB": sizes, "steps": args.steps, **extra,
                       "median": {k: round(statistics.median(v), 4) for k, v in res.items()}, "all": res}, indent=1)


def on_simhosts(args: argparse.Namespace, sizes: list[float]) -> None:
    """``--simhosts RATE``: the cluster of ``tests/multihost/test_ray_hosts.py`` with links at ``RATE``, this file
    as the driver on host 0 (``--cluster``); prints its figures with the link fractions."""
    import importlib.util
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parents[1] / "tests" / "multihost"
    sys.path.insert(0, str(here))
    import simhosts

    spec = importlib.util.spec_from_file_location("test_ray_hosts", here / "test_ray_hosts.py")
    assert spec is not None and spec.loader is not None
    ray_hosts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ray_hosts)
    reason = simhosts.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--simhosts: {reason}")
    simhosts.sweep_stale()
    simhosts.install_teardown()
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # each simulated host's link (the Ray nodes' workers inherit it)
    os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # set for loopback above: it refuses a multi-node cluster
    sim = simhosts.SimHosts(3, rate=args.simhosts)
    try:
        logs = Path(sim.tmp) / "logs"
        logs.mkdir()
        hosts = ray_hosts.RayHosts(sim, logs)
        out = logs / "result.json"
        with open(logs / "driver.log", "w") as log:
            proc = hosts.head.popen([sys.executable, __file__, "--cluster", hosts.address, str(out), "--rounds",
                                     str(args.rounds), "--sizes", args.sizes, "--steps", str(args.steps)],
                                    env=hosts.env, stdout=log, stderr=subprocess.STDOUT)
            rc = proc.wait(1800)
        if rc != 0:
            raise RuntimeError(f"the driver on host 0 exited {rc}:\n{(logs / 'driver.log').read_text()[-6000:]}")
        res = json.loads(out.read_text())
    finally:
        sim.close()
    link = simhosts._rate_bits(args.simhosts) / 8 / 1e9  # GB/s
    for side in ("ray_executor", "torch_trainer"):
        for mib in sizes:
            res[f"{side}.link_fraction.{mib}MiB"] = [
                round(bw / link, 4) for bw in res[f"{side}.busbw_GBps.{mib}MiB"]]
    print(_summary(args, sizes, res, link_GBps=link))


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--rank-outside":  # a rank of --outside's job outside Ray
        out = seen_by_rank([float(s) for s in sys.argv[3].split(",")], int(sys.argv[4]))
        import spark_hvd.core as core

        if core.rank() == 0:
            with open(sys.argv[2], "w") as f:
                json.dump(out, f)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="16,64", help="MiB, comma-separated")
    parser.add_argument("--steps", type=int, default=10, help="timed allreduces per size (<= 100)")
    parser.add_argument("--worker-niceness", type=int, default=None,
                        help="niceness of Ray's workers (RAY_worker_niceness; Ray's default: 15)")
    parser.add_argument("--outside", action="store_true",
                        help="compare the allreduce in the executor's actors with the same ranks outside Ray")
    parser.add_argument("--renice", action="store_true", help="with --outside: also in the actors at niceness 0 "
                        "(root only)")
    parser.add_argument("--simhosts", metavar="RATE", help="across 2 simulated hosts with links at RATE (root)")
    parser.add_argument("--cluster", nargs=2, metavar=("ADDRESS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    if args.simhosts:
        on_simhosts(args, sizes)
        return
    if args.worker_niceness is not None:  # read by the raylet ray.init starts; its workers inherit it
        os.environ["RAY_worker_niceness"] = str(args.worker_niceness)

    import ray

    temp_dir = tempfile.mkdtemp(prefix="shvd-ray-bench-")
    if args.cluster:  # --simhosts's driver, on host 0: one worker on each of the 2 worker hosts
        ray.init(address=args.cluster[0], configure_logging=False, log_to_driver=False)
        try:
            res = rounds(args, sizes, temp_dir, {"num_hosts": 2, "num_workers_per_host": 1, "cpus_per_worker": 1},
                         {"resources_per_worker": {"CPU": 1}, "placement_strategy": "STRICT_SPREAD"}, None)
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
        with open(args.cluster[1], "w") as f:
            json.dump(res, f)
        return
    ray.init(num_cpus=4, num_gpus=0, object_store_memory=80 * 1024**2, include_dashboard=False,
             _node_ip_address="127.0.0.1", _temp_dir=temp_dir, log_to_driver=False, configure_logging=False)
    try:
        if args.outside:
            compare_outside(args, sizes, temp_dir)
            return
        res = rounds(args, sizes, temp_dir, {"num_workers": 2, "cpus_per_worker": 1}, {}, "127.0.0.1")
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    print(_summary(args, sizes, res), file=sys.stdout)


if __name__ == "__main__":
    main()
