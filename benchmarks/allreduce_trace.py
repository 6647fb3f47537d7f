"""Per-frame timelines of ``benchmarks/allreduce.py`` runs between two ranks (``BENCH_TRACE=DIR``), summarised.

``BENCH_TRACE=DIR python benchmarks/allreduce.py --hosts 2 --np 2 --impls api,ring,gloo --sizes 16M`` makes every
rank of the TCP implementations write, for each timed loop, what its ``RingExchange`` did
(``spark_hvd.core.transport.tcp.loop`` ``TRACE``: perf_counter_ns of each frame's first ``sendmsg`` and of its last byte
handed to the kernel, of each frame's last byte received, of each hand-over to the collective, and the send socket's
``TCP_INFO`` at each exchange's start and end) around each call, to ``DIR/IMPL.RANK.NBYTES.NS.json``. The clock is
CLOCK_MONOTONIC, shared by
processes in every network namespace, so the two ranks' events line up. Then::

    python benchmarks/allreduce_trace.py DIR [--link 2gbit] [--impl api]

prints, for each traced loop of two ranks: per rank, the medians of the call's entry (call -> exchange starts),
the first data frame's start (exchange start -> its first ``sendmsg``), the tail (last frame's last byte received
-> exchange done) and the exit (exchange done -> call returns), and the boundary (the last byte of call k received
-> call k + 1's first data frame handed to ``sendmsg``) and its send socket at each call's end (congestion window,
smoothed RTT, bytes TCP had not sent yet); per direction and call, the excess of the data's arrival
over the wire's time for it (MTU 1500 with TCP timestamps: 1448 payload bytes per 1514 on the wire; negative: the
shaper's bucket refilled during idle time before), counted from when that direction could start (its sender's first
data frame, or the end of its previous call's data if that came later).
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from pathlib import Path

PAYLOAD_PER_WIRE = 1448 / 1514
DATA = 1000  # frames larger than this are data (the agreement header is 16 bytes)


def _calls(events: list) -> list[dict]:
    calls: list[dict] = []
    for t, kind, _, nbytes in events:
        ms = t / 1e6
        if kind == "call":
            calls.append({"call": ms, "bytes_in": 0})
        elif not calls:
            continue
        elif kind == "run":
            calls[-1].setdefault("run", ms)
        elif kind == "s0" and nbytes > DATA:
            calls[-1].setdefault("s0", ms)
        elif kind == "r" and nbytes > DATA:
            calls[-1]["last_in"] = ms
            calls[-1]["bytes_in"] += nbytes
        elif kind == "end":
            calls[-1]["end"] = ms
        elif kind == "ret":
            calls[-1]["ret"] = ms
        elif kind == "tcp" and nbytes:
            calls[-1].setdefault("tcp", []).append(nbytes)
    return calls


def summarise(paths: tuple[str, str], rate_bytes: float) -> str:
    calls = [_calls(json.loads(Path(p).read_text())) for p in paths]
    if any(not c or any("s0" not in x or "last_in" not in x for x in c) for c in calls):
        return f"{Path(paths[0]).name}: not a two-rank TCP loop"
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    lines = [f"{Path(paths[0]).name} and rank 1: {len(calls[0])} calls, span "
             f"{max(c[-1]['ret'] for c in calls) - min(c[0]['call'] for c in calls):.2f} ms"]
    for r, cs in enumerate(calls):
        nxt = [b["s0"] - a["last_in"] for a, b in zip(cs, cs[1:], strict=False)]
        entry, first = med([c["run"] - c["call"] for c in cs]), med([c["s0"] - c["run"] for c in cs])
        tail, exit_ = med([c["end"] - c["last_in"] for c in cs]), med([c["ret"] - c["end"] for c in cs])
        lines.append(f"  rank {r}: entry {entry:.3f} ms, first data {first:.3f}, tail {tail:.3f}, exit {exit_:.3f}, "
                     f"boundary {med(nxt):.3f} (medians)")
        ends = [c["tcp"][-1] for c in cs if c.get("tcp")]
        if ends:  # the send socket at each call's end: what TCP had (cwnd, smoothed RTT, bytes it had not sent)
            lines.append("    send socket at call ends: " + "; ".join(
                f"cwnd {e.get('cwnd')} rtt {e.get('rtt_us', 0) / 1e3:.2f} ms unsent {e.get('notsent', 0) >> 10} KiB"
                for e in ends))
    for a, b in ((0, 1), (1, 0)):
        excess = []
        for k, got in enumerate(calls[b]):
            start = calls[a][k]["s0"] if k == 0 else max(calls[a][k]["s0"], calls[b][k - 1]["last_in"])
            excess.append(got["last_in"] - start - got["bytes_in"] / rate_bytes * 1e3)
        lines.append(f"  {a}->{b}: excess over the wire per call " + " ".join(f"{x:+.2f}" for x in excess) + " ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir")
    parser.add_argument("--link", default="2gbit", help="the link rate, as tc writes it (default 2gbit)")
    parser.add_argument("--impl", default=None, help="only this implementation")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import allreduce_hosts

    rate = allreduce_hosts.rate_bits(args.link) / 8 * PAYLOAD_PER_WIRE
    groups: dict[tuple[str, str], list[list[str]]] = {}
    for rank in (0, 1):
        for path in sorted(glob.glob(f"{args.dir}/*.{rank}.*.json")):
            impl, _, nbytes, _ = Path(path).name.rsplit(".", 4)[:4]
            if args.impl is None or impl == args.impl:
                runs = groups.setdefault((impl, nbytes), [[], []])
                runs[rank].append(path)
    for (_impl, _nbytes), (zeros, ones) in sorted(groups.items()):
        for pair in zip(zeros, ones, strict=False):
            print(summarise(pair, rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
