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
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import allreduce  # noqa: E402 - its worker pool (``Group``) runs the ranks
import allreduce_hosts  # noqa: E402 - --hosts: ranks on simulated hosts

#: the groups: ``allreduce.py``'s bare TCP ring (``ring-tcp``) with ``SPARK_HVD_ENCRYPT`` off and on; ``control``
#: (``--control``) is a second group with it off, whose ratio to the first is the comparison's own noise
MODES = {"authenticated": "0", "encrypted": "1", "control": "0"}


def bench(n: int, sizes: list[int], rounds: int, control: bool = False, timeout_s: float = 180.0) -> dict:
    """Each mode's (seconds, CPU seconds) per allreduce per round, by (mode, size): the groups take turns at
    going first, round by round."""
    modes = [m for m in MODES if control or m != "control"]
    os.environ["BENCH_VARIANTS"] = json.dumps({mode: {"SPARK_HVD_ENCRYPT": MODES[mode]} for mode in modes})
    groups = allreduce.start_groups([f"ring-tcp:{mode}" for mode in modes], n, timeout_s)
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for g in groups:
            print(f"# {g.impl.split(':')[1]}: {'; '.join(sorted(g.transports))}")
        for rnd in range(rounds):
            for nbytes in sizes:
                iters = max(3, min(50, (512 << 20) // nbytes // max(1, n)))
                for g in groups[rnd % len(groups):] + groups[:rnd % len(groups)]:
                    times.setdefault((g.impl.split(":")[1], nbytes), []).append(g.run(nbytes, iters, 1))
            print(f"# round {rnd + 1}/{rounds} done", flush=True)
    finally:
        for g in groups:
            g.stop()
        getattr(groups[0], "kv", None) and groups[0].kv.stop()  # type: ignore[attr-defined]
    return times


def table(sizes: list[int], times: dict) -> str:
    """Medians over rounds; each ratio is the median over rounds of that round's ratio to ``authenticated``."""
    modes = [m for m in MODES if (m, sizes[0]) in times]
    others = modes[1:]
    head = ([f"{m} time" for m in modes] + [f"{m} time ratio" for m in others] + [f"{m} CPU" for m in modes]
            + [f"{m} CPU ratio" for m in others])
    lines = ["| size | " + " | ".join(head) + " |", "|" + " --- |" * (1 + len(head))]
    for nbytes in sizes:
        runs = {m: times[(m, nbytes)] for m in modes}
        wall = [f"{statistics.median(t for t, _ in runs[m]) * 1e3:.3f} ms" for m in modes]
        cpu = [f"{statistics.median(c for _, c in runs[m]) * 1e3:.3f} ms" for m in modes]
        base = runs["authenticated"]
        # the ratio of each round's pair (interleaved), median over rounds
        wall_ratio = [f"{statistics.median(o[0] / a[0] for a, o in zip(base, runs[m], strict=True)):.3f}x"
                      for m in others]
        cpu_ratio = [f"{statistics.median(o[1] / a[1] for a, o in zip(base, runs[m], strict=True)):.3f}x"
                     for m in others]
        size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        lines.append(f"| {size} | " + " | ".join(wall + wall_ratio + cpu + cpu_ratio) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--sizes", default="16M,64M", help="comma-separated sizes (default 16M,64M)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    parser.add_argument("--hosts", type=int, default=None,
                        help="place the ranks on this many simulated hosts (root; benchmarks/allreduce_hosts.py)")
    parser.add_argument("--link", default="2gbit", help="with --hosts: each host's link rate, as tc writes it")
    parser.add_argument("--control", action="store_true",
                        help="a third group, authenticated too: its ratio to the first is the noise of the comparison")
    args = parser.parse_args(argv)
    if args.hosts and not allreduce_hosts.inside():
        return allreduce_hosts.enter(args.hosts, args.link, [str(Path(__file__).resolve()), *(argv or sys.argv[1:])])
    sizes = [allreduce.parse_size(s) for s in args.sizes.split(",") if s]
    where = f"{args.hosts} simulated hosts, links at {args.link}" if allreduce_hosts.inside() else "loopback"
    print(f"# allreduce float32 SUM, np={args.np}, TCP ring on {where}, authenticated vs encrypted interleaved; "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at start; command: "
          f"{' '.join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])}", flush=True)
    times = bench(args.np, sizes, args.rounds, args.control)
    print(table(sizes, times))
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
