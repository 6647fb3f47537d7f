"""``scaling_model.py --measure``: the costs of each allreduce algorithm, timed through the public API, and their fit.

Every measurement is ``spark_hvd.torch.allreduce_`` (``benchmarks/allreduce.py``'s ``api-tcp`` worker: engine,
response cache, speculation and the torch binding on the TCP backend; one fixed tensor name per size, called back
to back, as a training loop calls it) at N = 2, 4 and 8, with the engine's thresholds set so that one algorithm runs
at every size:

- ``ring``: the pipelined ring (``SPARK_HVD_LOG_DEPTH_BYTES=0``; at N=2 arrays up to 1 MiB take the pair exchange,
  one exchange of the whole array, as the engine does);
- ``rd``: recursive doubling (``core/algorithms/recursive_doubling.py``; ``SPARK_HVD_LOG_DEPTH_BYTES`` above every
  size), N>=3;
- ``hd``: recursive halving-doubling, Rabenseifner (``core/algorithms/halving_doubling.py``;
  ``SPARK_HVD_HALVING_DOUBLING_BYTES =1``), N>=3;
- ``hier``: the 2-level path (``core/algorithms/hier_pipeline.py``): two hosts of N/2 ranks, shared memory within, TCP
  between;
- ``bare``: the ring through ``RingBackend.allreduce`` without the engine (what the API adds is the difference);
- ``negotiation``: a new name on every call at 4 KiB (a full negotiated round each, no cache, no speculation).

Where the machine allows (root, namespaces), every rank is its own simulated host (``tests/multihost/simhosts.py``:
network + UTS namespaces, links shaped by ``tc tbf``); otherwise loopback TCP with ``SPARK_HVD_SHM=0`` (and
``SPARK_HVD_HOST_ID`` for the two "hosts" of ``hier``). The JSON says which.

The fit is one weighted least squares (relative error, non-negative coefficients) over every size and N of the API
configurations::

    t(alg, N, n) = c  +  a_alg * steps_alg(N)  +  b_alg * bytes_alg(N) * n  +  f * fast(N, n)

``steps``/``bytes``: ring ``2(N-1)`` / ``2(N-1)/N`` (pair exchange: 1 / 1), rd ``log2 N`` / ``log2 N``, hd ``2 log2 N``
/ ``2(N-1)/N``; ``c`` the engine's per-call cost (shared); ``f`` the fast round's cost per log-depth step, paid by a
round the speculation does not carry (``fast = ceil(log2 N)`` above ``core/engine/speculation.py``'s limits: 64 KiB at
N=2, 1 MiB at N>=3 over TCP; 0 below). It is fitted twice: on wall time (the slowest rank; here N ranks share two
cores) and on CPU time per rank (what a rank's host spends; on hosts with a core per rank that is the critical path).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import allreduce  # noqa: E402 - the benchmark's worker groups
import allreduce_hosts  # noqa: E402

SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
QUICK_SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20)
#: (name, benchmark worker, engine settings, job sizes)
CONFIGS = (
    ("ring", "api-tcp", {"SPARK_HVD_LOG_DEPTH_BYTES": "0", "SPARK_HVD_HALVING_DOUBLING_BYTES": "0"}, (2, 4, 8)),
    ("rd", "api-tcp", {"SPARK_HVD_LOG_DEPTH_BYTES": str(1 << 30), "SPARK_HVD_HALVING_DOUBLING_BYTES": "0"}, (4, 8)),
    ("hd", "api-tcp", {"SPARK_HVD_LOG_DEPTH_BYTES": "0", "SPARK_HVD_HALVING_DOUBLING_BYTES": "1"}, (4, 8)),
    ("hier", "api-hier", {}, (4, 8)),
    ("bare", "ring-tcp", {"SPARK_HVD_LOG_DEPTH_BYTES": "0", "SPARK_HVD_HALVING_DOUBLING_BYTES": "0"}, (2, 4, 8)),
)
PAIR_BYTES = 1 << 20  # core/backends/ring.py PAIR_EXCHANGE_BYTES: two ranks exchange whole arrays up to this
SPEC_BYTES, SPEC_LARGE_BYTES = 64 << 10, 1 << 20  # core/engine/speculation.py
FAMILIES = ("ring", "rd", "hd")


def log_steps(n: int) -> int:
    return max(1, math.ceil(math.log2(n)))


def shape(alg: str, ranks: int, nbytes: float) -> tuple[str, float, float]:
    """(family, message steps per rank, bytes factor) of ``alg`` among ``ranks`` for an array of ``nbytes``."""
    if alg in ("ring", "bare") and ranks == 2 and nbytes <= PAIR_BYTES:
        return "ring", 1.0, 1.0  # the pair exchange: one exchange of the whole array
    if alg == "rd":
        return "rd", float(log_steps(ranks)), float(log_steps(ranks))
    if alg == "hd":
        return "hd", 2.0 * log_steps(ranks), 2 * (ranks - 1) / ranks
    return "ring", 2.0 * (ranks - 1), 2 * (ranks - 1) / ranks


def fast_steps(ranks: int, nbytes: float) -> float:
    """Log-depth steps of the fast round a steady call pays when speculation does not carry it (0 when it does)."""
    limit = SPEC_LARGE_BYTES if ranks >= 3 else SPEC_BYTES
    return float(log_steps(ranks)) if nbytes > limit else 0.0


def iterations(nbytes: int) -> int:
    return max(3, min(100, (8 << 20) // nbytes))


# ---------------------------------------------------------------------------------------------- measuring
@contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _two_hosts(impl: str, ranks: int) -> Iterator[str]:
    """``hier`` on simulated hosts: ranks 0..N/2-1 on the first host, the rest on the second (the same two "hosts"
    as ``api-hier`` on loopback), found as hosts by the library itself (worker ``api``)."""
    if impl != "api-hier" or not allreduce_hosts.inside():
        yield impl
        return
    original = allreduce_hosts.host_of
    allreduce_hosts.host_of = lambda rank, n: allreduce_hosts._state()["hosts"][2 * rank // n]
    try:
        yield "api"
    finally:
        allreduce_hosts.host_of = original


def measure(sizes: tuple[int, ...], rounds: int, nps: tuple[int, ...], log: Any = print) -> list[dict]:
    """Run every configuration at every N in ``nps``; a record per (config, N, size) with each round's times."""
    records: list[dict] = []
    for name, impl, env, ns in CONFIGS:
        for ranks in (n for n in ns if n in nps):
            with _environ(env), _two_hosts(impl, ranks) as worker:
                load0 = os.getloadavg()[0]
                groups = allreduce.start_groups([worker], ranks)
                group = groups[0]
                mine: dict[int, dict] = {}
                try:
                    for rnd in range(rounds):
                        for nbytes in sizes:
                            t, cpu = group.run(nbytes, iterations(nbytes), 3 if rnd == 0 else 2)
                            rec = mine.setdefault(nbytes, {"config": name, "ranks": ranks, "nbytes": nbytes,
                                                           "mode": "steady", "time_s": [], "cpu_s": []})
                            rec["time_s"].append(t)
                            rec["cpu_s"].append(cpu)
                        if name == "ring":  # a full negotiated round on every call, same group
                            t, cpu = group.run(4096, 30, 2, "new")
                            rec = mine.setdefault(-1, {"config": "negotiation", "ranks": ranks, "nbytes": 4096,
                                                       "mode": "new-names", "time_s": [], "cpu_s": []})
                            rec["time_s"].append(t)
                            rec["cpu_s"].append(cpu)
                finally:
                    for g in groups:
                        g.stop()
                    getattr(groups[0], "kv", None) and groups[0].kv.stop()  # type: ignore[attr-defined]
                load1 = os.getloadavg()[0]
                for rec in mine.values():
                    rec.update(load=[round(load0, 1), round(load1, 1)], transport="/".join(sorted(group.transports)))
                    records.append(rec)
                log(f"{name} N={ranks}: " + ", ".join(
                    f"{allreduce.human(r['nbytes'])}{' new' if r['mode'] != 'steady' else ''} "
                    f"{statistics.median(r['time_s']) * 1e3:.3f} ms (cpu {statistics.median(r['cpu_s']) * 1e3:.3f})"
                    for r in mine.values()) + f"; load {load0:.1f} -> {load1:.1f}")
    return records


# ---------------------------------------------------------------------------------------------- fitting
def _nnls(rows: list[list[float]], targets: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative least squares of relative error: minimise sum(((A x) / t - 1)^2); (x, relative residuals)."""
    from scipy.optimize import nnls

    a = np.asarray(rows, dtype=np.float64)
    t = np.asarray(targets, dtype=np.float64)
    scaled = a / t[:, None]
    norms = np.maximum(np.abs(scaled).max(axis=0), 1e-300)  # columns of very different scale: condition them
    x, _ = nnls(scaled / norms, np.ones_like(t))
    x = x / norms
    return x, a @ x / t - 1


def fit(records: list[dict], key: str = "time_s") -> dict:
    """The joint fit of the API configurations (ring, rd, hd), the bare ring's own, and hier's per-N lines."""
    api = [r for r in records if r["config"] in FAMILIES and r["mode"] == "steady"]
    names = ["c", "f"] + [f"{p}_{fam}" for fam in FAMILIES for p in ("a", "b")]
    rows, targets = [], []
    for r in api:
        fam, steps, factor = shape(r["config"], r["ranks"], r["nbytes"])
        row = [0.0] * len(names)
        row[0], row[1] = 1.0, fast_steps(r["ranks"], r["nbytes"])
        row[names.index(f"a_{fam}")] = steps
        row[names.index(f"b_{fam}")] = factor * r["nbytes"]
        rows.append(row)
        targets.append(statistics.median(r[key]))
    out: dict[str, Any] = {}
    if rows:
        x, res = _nnls(rows, targets)
        coef = dict(zip(names, x.tolist(), strict=True))
        out["api"] = {"c_s": coef["c"], "fast_round_step_s": coef["f"],
                      **{fam: {"alpha_s": coef[f"a_{fam}"], "beta_s_per_byte": coef[f"b_{fam}"]} for fam in FAMILIES},
                      "residuals": _residuals(api, res)}
    bare = [r for r in records if r["config"] == "bare"]
    if bare:
        rows = [[1.0, shape("bare", r["ranks"], r["nbytes"])[1],
                 shape("bare", r["ranks"], r["nbytes"])[2] * r["nbytes"]] for r in bare]
        x, res = _nnls(rows, [statistics.median(r[key]) for r in bare])
        out["bare_ring"] = {"c_s": x[0], "alpha_s": x[1], "beta_s_per_byte": x[2], "residuals": _residuals(bare, res)}
    hier = {}
    for ranks in sorted({r["ranks"] for r in records if r["config"] == "hier"}):
        pts = [r for r in records if r["config"] == "hier" and r["ranks"] == ranks]
        x, res = _nnls([[1.0, r["nbytes"]] for r in pts], [statistics.median(r[key]) for r in pts])
        hier[str(ranks)] = {"hosts": 2, "ranks_per_host": ranks // 2, "c_s": x[0], "beta_s_per_byte": x[1],
                            "residuals": _residuals(pts, res)}
    out["hier"] = hier
    neg = {}
    for r in records:
        if r["mode"] == "new-names":
            steady = next((s for s in records if s["config"] == "ring" and s["ranks"] == r["ranks"]
                           and s["nbytes"] == r["nbytes"] and s["mode"] == "steady"), None)
            neg[str(r["ranks"])] = {"new_name_s": statistics.median(r[key]),
                                    "steady_s": statistics.median(steady[key]) if steady else None}
    out["negotiation_4KiB"] = neg
    return out


def _residuals(records: list[dict], res: np.ndarray) -> dict:
    per = [{"config": r["config"], "ranks": r["ranks"], "nbytes": r["nbytes"], "rel": round(float(e), 4)}
           for r, e in zip(records, res, strict=True)]
    return {"rms": float(np.sqrt(np.mean(res ** 2))), "max_abs": float(np.max(np.abs(res))), "points": per}


# ---------------------------------------------------------------------------------------------- the mode
def run(out: Path, quick: bool, hosts: str, link: str, argv: list[str]) -> tuple[int, bool]:
    """``--measure``: on simulated hosts (``hosts='auto'`` where they can be made, ``'sim'`` or fail, ``'loopback'``)
    or loopback TCP; write the records and both fits to ``out``. Returns (exit code, whether it ran in a simulated
    driver host started here: then that run did everything the command line asked)."""
    if not allreduce_hosts.inside() and hosts != "loopback":
        sys.path.insert(0, str(HERE.parent / "tests" / "multihost"))
        import simhosts

        reason = simhosts.unavailable_reason()
        if reason is None:
            return allreduce_hosts.enter(8, link, [str(HERE / "scaling_model.py"), *argv]), True
        if hosts == "sim":
            sys.stderr.write(f"scaling_model.py --measure --hosts sim: {reason}\n")
            return 2, False
        print(f"simulated hosts unavailable ({reason}): loopback TCP")
    where = (f"simulated hosts: a network + UTS namespace per rank (hier: N/2 ranks on each of two), links shaped "
             f"by tc tbf to {allreduce_hosts.link_rate()}" if allreduce_hosts.inside()
             else "loopback TCP on one machine (SPARK_HVD_SHM=0; hier: SPARK_HVD_HOST_ID makes two hosts)")
    sizes = QUICK_SIZES if quick else SIZES
    nps = (2, 4) if quick else (2, 4, 8)
    rounds = 2 if quick else 3
    start = time.time()
    load = os.getloadavg()[0]
    print(f"--measure: {where}; N={nps}; sizes {[allreduce.human(s) for s in sizes]}; {rounds} rounds; "
          f"{os.cpu_count()} CPUs; load {load:.1f}", flush=True)
    records = measure(sizes, rounds, nps, log=lambda line: print(line, flush=True))
    result = {
        "what": "spark_hvd.torch.allreduce_ (float32 SUM, one name per size, back to back) per algorithm; "
                "benchmarks/scaling_measure.py",
        "where": where, "cpus": os.cpu_count(), "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start)),
        "seconds": round(time.time() - start), "load_start": round(load, 1),
        "load_end": round(os.getloadavg()[0], 1), "command": "benchmarks/scaling_model.py " + " ".join(argv),
        "records": records, "fit_wall": fit(records, "time_s"), "fit_cpu": fit(records, "cpu_s"),
    }
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"wrote {out} ({result['seconds']} s; load {result['load_start']} -> {result['load_end']})")
    return 0, False
