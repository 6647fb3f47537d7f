"""Sum the ``perf record`` files of ``allreduce.py``'s timed loops (``BENCH_PERF=DIR``) by implementation.

For each implementation (and size) it prints the samples in all (every implementation of one run timed the same
number of calls per size, so samples compare directly), the share of a few groups of symbols (self time: kernel
copies to and from user space, the MAC, numpy's reduction, libpython, softirq work, scheduling) and of a few entry
points (with their callees: sending, receiving, polling, futexes), then the top symbols::

    BENCH_PERF=/tmp/perf .venv/bin/python benchmarks/allreduce.py --hosts 2 --np 2 --impls ring,gloo --sizes 64M
    .venv/bin/python benchmarks/allreduce_perf.py /tmp/perf [--top 15]

Needs Linux ``perf`` on the PATH.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

#: self-time groups: (name, test on (dso, symbol))
GROUPS = (
    ("kernel copies", lambda dso, sym: sym in ("_copy_to_iter", "_copy_from_iter", "copy_user_generic",
                                               "rep_movs_alternative")),
    ("MAC (GMAC/GHASH)", lambda dso, sym: "gcm" in sym or "ghash" in sym.lower()),
    ("user memcpy", lambda dso, sym: "memmove" in sym or "memcpy" in sym),
    ("reduction", lambda dso, sym: "multiarray" in dso or "gloo::sum" in sym),
    ("libpython", lambda dso, sym: "libpython" in dso),
    ("softirq", lambda dso, sym: sym == "handle_softirqs"),
    ("scheduling", lambda dso, sym: sym in ("finish_task_switch.isra.0", "_raw_spin_unlock_irqrestore",
                                            "__schedule")),
)
#: entry points counted with their callees
ENTRIES = ("tcp_sendmsg", "tcp_recvmsg", "do_sys_poll", "do_epoll_wait", "__x64_sys_futex", "__x64_sys_setsockopt",
           "asm_sysvec_apic_timer_interrupt")
_LINE = re.compile(r"\s*([\d.]+)%\s+(?:([\d.]+)%\s+)?(\S+)\s+\[.\]\s+(.*)")


def _report(path: Path, children: bool) -> tuple[int, list[tuple[float, str, str]]]:
    args = ["perf", "report", "-i", str(path), "--stdio", "-g", "none"]
    args += ["--children", "--sort", "sym"] if children else ["--no-children", "--sort", "dso,sym"]
    out = subprocess.run(args, capture_output=True, text=True, check=False).stdout
    found = re.search(r"^# Samples: (\d+)", out, re.MULTILINE)
    rows = []
    for line in out.splitlines():
        if line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m:
            if children:  # children%, self%, [k], symbol
                rows.append((float(m.group(1)), "", m.group(4).strip()))
            else:  # overhead%, dso, [k], symbol
                rows.append((float(m.group(1)), m.group(3), m.group(4).strip()))
    return (int(found.group(1)) if found else 0), rows


def summarise(folder: Path, top: int) -> str:
    files: dict[str, list[Path]] = collections.defaultdict(list)
    for path in sorted(folder.glob("*.data")):
        name, _rank, nbytes = path.name.split(".")[:3]
        files[f"{name} {int(nbytes) >> 20} MiB"].append(path)
    lines = []
    for key, paths in files.items():
        samples, selfs, entries = 0, collections.Counter(), collections.Counter()
        for path in paths:
            n, rows = _report(path, children=False)
            samples += n
            for pct, dso, sym in rows:
                selfs[(dso, sym)] += pct * n / 100
            n, rows = _report(path, children=True)
            for pct, _, sym in rows:
                if sym in ENTRIES:
                    entries[sym] += pct * n / 100
        if not samples:
            continue
        groups = {name: sum(v for (dso, sym), v in selfs.items() if test(dso, sym)) for name, test in GROUPS}
        lines.append(f"== {key}: {samples} samples in {len(paths)} loops")
        lines.append("   self: " + ", ".join(f"{g} {100 * v / samples:.1f}%" for g, v in groups.items()))
        lines.append("   with callees: " + ", ".join(f"{e} {100 * entries[e] / samples:.1f}%" for e in ENTRIES
                                                    if entries[e]))
        for (dso, sym), v in selfs.most_common(top):
            lines.append(f"   {100 * v / samples:5.1f}%  {Path(dso).name[:28]:28}  {sym[:90]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    print(summarise(args.folder, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
