"""spark-hvd-run / run_local: rank environment, [rank] prefixes, failure propagation, exit codes, timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from spark_hvd.runner import run_local

REPO = Path(__file__).resolve().parents[2]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "rank_script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_two_ranks_environment_prefixes_and_reports(tmp_path):
    script = _script(tmp_path, """
        import os, sys
        from spark_hvd.runner import report
        env = {k: os.environ[k] for k in ("SPARK_HVD_RANK", "SPARK_HVD_SIZE", "SPARK_HVD_LOCAL_RANK",
               "SPARK_HVD_LOCAL_SIZE", "SPARK_HVD_CROSS_RANK", "SPARK_HVD_CROSS_SIZE", "SPARK_HVD_RENDEZVOUS",
               "SPARK_HVD_SECRET", "SPARK_HVD_JOB_ID")}
        rank = env["SPARK_HVD_RANK"]
        print(f"hello rank={rank} size={env['SPARK_HVD_SIZE']} local={env['SPARK_HVD_LOCAL_RANK']}/"
              f"{env['SPARK_HVD_LOCAL_SIZE']} cross={env['SPARK_HVD_CROSS_RANK']}/{env['SPARK_HVD_CROSS_SIZE']} "
              f"extra={os.environ.get('EXTRA')} job={env['SPARK_HVD_JOB_ID']}")
        print(f"to stderr {rank}", file=sys.stderr)
        report(epoch=1, acc=0.5)
    """)
    result = run_local([sys.executable, script], 2, env={"EXTRA": "x"}, timeout=120, capture=True)
    assert result.returncode == 0, result.stderr
    assert result.returncodes == [0, 0]
    for rank in (0, 1):
        line = next(line for line in result.stdout if line.startswith(f"[{rank}] hello"))
        assert f"rank={rank} size=2 local={rank}/2 cross=0/1 extra=x" in line
        assert f"[{rank}] to stderr {rank}" in result.stderr
    assert len({line.split("job=")[1] for line in result.stdout}) == 1
    assert sorted((e.rank, e.epoch, e.metrics["acc"]) for e in result.events) == [(0, 1, 0.5), (1, 1, 0.5)]


def test_failing_rank_stops_the_others_with_its_exit_code(tmp_path):
    script = _script(tmp_path, """
        import os, sys, time
        rank = int(os.environ["SPARK_HVD_RANK"])
        if rank == 1:
            print("rank 1 is about to fail", file=sys.stderr)
            sys.exit(7)
        time.sleep(600)
    """)
    result = run_local([sys.executable, script], 3, timeout=300, capture=True, grace_s=5)
    assert result.returncode == 7
    assert result.failure is not None and result.failure.rank == 1
    assert "rank 1 is about to fail" in result.failure.stderr_tail
    assert result.returncodes[1] == 7
    assert all(code is not None and code != 0 for r, code in enumerate(result.returncodes) if r != 1)


def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    script = _script(tmp_path, """
        import os, signal, sys, time
        rank = int(os.environ["SPARK_HVD_RANK"])
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        if rank == 0:
            time.sleep(0.5)
            sys.exit(3)
        time.sleep(600)
    """)
    result = run_local([sys.executable, script], 2, timeout=300, capture=True, grace_s=1)
    assert result.returncode == 3 and result.failure.rank == 0
    assert result.returncodes[1] == -9


def test_timeout_stops_every_rank(tmp_path):
    script = _script(tmp_path, "import time\ntime.sleep(600)\n")
    result = run_local([sys.executable, script], 2, timeout=2, capture=True, grace_s=5)
    assert result.timed_out and result.returncode == 124
    assert all(code is not None for code in result.returncodes)


def test_command_line_exit_code_and_stderr_tail(tmp_path):
    script = _script(tmp_path, """
        import os, sys
        rank = int(os.environ["SPARK_HVD_RANK"])
        print(f"out {rank}")
        if rank == 1:
            print("fatal: something broke", file=sys.stderr)
            sys.exit(5)
    """)
    proc = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "2", "--timeout", "120", "--grace", "5",
                           sys.executable, script], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 5, proc.stderr
    assert "[0] out 0" in proc.stdout or "[1] out 1" in proc.stdout
    assert "rank 1 exited with code 5" in proc.stderr
    assert "    fatal: something broke" in proc.stderr


def test_console_script_success_and_timeout(tmp_path):
    exe = Path(sys.executable).with_name("spark-hvd-run")
    if not exe.exists():
        pytest.skip(f"console script not installed next to {sys.executable}")
    ok = subprocess.run([str(exe), "-np", "2", sys.executable, "-c",
                         "import os; print('rank', os.environ['SPARK_HVD_RANK'])"],
                        capture_output=True, text=True, timeout=180)
    assert ok.returncode == 0, ok.stderr
    assert "[0] rank 0" in ok.stdout and "[1] rank 1" in ok.stdout
    slow = subprocess.run([str(exe), "-np", "2", "--timeout", "1", "--grace", "5", sys.executable, "-c",
                           "import time; time.sleep(600)"], capture_output=True, text=True, timeout=180)
    assert slow.returncode == 124
    assert "--timeout 1 s" in slow.stderr


def test_launched_ranks_join_the_core_and_allreduce(tmp_path):
    script = _script(tmp_path, """
        import json
        import numpy as np
        import spark_hvd.core as hvd
        from spark_hvd.core.backend import ReduceOp
        hvd.init()
        data = np.random.default_rng(100 + hvd.rank()).standard_normal(1001)
        out = hvd.allreduce(data.copy(), op=ReduceOp.SUM)
        print("RESULT " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "sum": out.tolist()}))
        hvd.shutdown()
    """)
    result = run_local([sys.executable, script], 3, timeout=240, capture=True)
    assert result.returncode == 0, "\n".join(result.stderr[-30:])
    found = {}
    for line in result.stdout:
        rank, _, text = line.partition(" ")
        if text.startswith("RESULT "):
            found[int(rank.strip("[]"))] = json.loads(text[len("RESULT "):])
    assert sorted(found) == [0, 1, 2] and all(r["size"] == 3 for r in found.values())
    expected = sum(np.random.default_rng(100 + r).standard_normal(1001) for r in range(3))
    for r in found.values():
        np.testing.assert_allclose(r["sum"], expected, rtol=1e-12)
