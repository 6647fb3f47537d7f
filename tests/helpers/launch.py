"""Helpers of the binding tests: run a worker script under ``spark-hvd-run`` once per module, read its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "bindings" / "scripts"  # the worker scripts


def launch_worker(script: str, np_: int, out_dir: Path, timeout_s: float = 240.0,
                  quick: bool = False) -> dict[int, dict[str, str]]:
    """Run ``scripts/<script>`` on ``np_`` ranks (``spark-hvd-run``; plain ``python`` for one rank).

    ``quick`` runs only the worker's QUICK subset of checks.
    Returns ``{rank: {check name: "ok" or the traceback}}``; raises with the job's output if it failed.
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    env.setdefault("SPARK_HVD_TIMEOUT", "60")
    for k in [k for k in env if k.startswith("SPARK_HVD_") and k not in ("SPARK_HVD_TIMEOUT",)]:
        del env[k]  # never inherit another job's rank/rendezvous
    cmd = [sys.executable, str(SCRIPTS / script), str(out_dir)] + (["quick"] if quick else [])
    if np_ > 1:
        cmd = [sys.executable, "-m", "spark_hvd.runner", "-np", str(np_), "--timeout", str(int(timeout_s - 10))] + cmd
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    prefix = script.split("_")[0]
    results: dict[int, dict[str, str]] = {}
    for r in range(np_):
        path = out_dir / f"{prefix}-rank{r}.json"
        if path.exists():
            results[r] = json.loads(path.read_text())["results"]
    if proc.returncode != 0 or len(results) != np_:
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}; results of ranks {sorted(results)}\n"
                             f"--- stdout (tail)\n{proc.stdout[-4000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}")
    return results


def assert_check(results: dict[int, dict[str, str]], name: str) -> None:
    """Fail with every rank's traceback unless check ``name`` passed on all ranks."""
    failures = []
    for r, res in sorted(results.items()):
        outcome = res.get(name, "<check did not run>")
        if outcome != "ok":
            failures.append(f"rank {r}:\n{outcome}")
    if failures:
        raise AssertionError(f"check {name!r} failed\n" + "\n".join(failures))
