"""spark-hvd-run / run_local: rank environment, [rank] prefixes, failure propagation, exit codes, timeout."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
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


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to see which processes live")
def test_sigkilled_rank_is_blamed_its_children_die_and_the_launcher_exits_promptly(tmp_path):
    """Rank 1 starts a child process, then is SIGKILLed while both ranks are inside allreduce: rank 0 fails a
    moment later with a closed socket, yet rank 1 is the one reported, with SIGKILL; the child does not survive and
    the launcher returns within seconds. Five times, since the order of the two exits is a race."""
    script = _script(tmp_path, """
        import os, signal, subprocess, sys, threading, time
        import numpy as np
        import spark_hvd.core as hvd
        out = sys.argv[1]
        hvd.init()
        if hvd.rank() == 1:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            with open(os.path.join(out, "child.pid"), "w") as f:
                f.write(str(child.pid))
            def die():
                time.sleep(1.0)
                with open(os.path.join(out, "killed_at"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Thread(target=die, daemon=True).start()
        data = np.ones(1 << 20)
        while True:
            hvd.allreduce(data, name="x")
    """)
    for attempt in range(5):
        out = tmp_path / f"run{attempt}"
        out.mkdir()
        result = run_local([sys.executable, script, str(out)], 2, timeout=120, capture=True, grace_s=5)
        returned = time.time()
        assert result.failure is not None, result.stderr[-20:]
        assert result.failure.rank == 1, (attempt, result.failure, result.returncodes)
        assert result.returncode == 128 + signal.SIGKILL
        assert "SIGKILL" in result.failure.description
        killed_at = float((out / "killed_at").read_text())
        assert returned - killed_at < 5.0, f"launcher returned {returned - killed_at:.1f} s after the kill"
        child = int((out / "child.pid").read_text())
        deadline = time.monotonic() + 2  # its reaper (not the launcher) may take a moment
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"rank 1's child {child} survived the job"


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("setsid") is None, reason="needs Linux and setsid")
def test_processes_that_left_the_ranks_group_do_not_outlive_the_job(tmp_path):
    """A rank starts a sleeper in a session of its own and a double-forked one (``setsid -f``), then exits 0: the
    launcher's end-of-job sweep (the job id in their environment) leaves neither alive."""
    script = _script(tmp_path, """
        import os, subprocess, sys, time
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)
        subprocess.run(["setsid", "-f", "sh", "-c", "echo $$ > " + sys.argv[1] + ".tmp; mv " + sys.argv[1]
                        + ".tmp " + sys.argv[1] + "; exec sleep 601"], check=True)
        while not os.path.exists(sys.argv[1]):  # the daemon is up before the rank exits
            time.sleep(0.01)
        print(child.pid, flush=True)
    """)
    pid_file = tmp_path / "daemon.pid"
    result = run_local([sys.executable, script, str(pid_file)], 1, timeout=120, capture=True, grace_s=2)
    assert result.returncode == 0, result.stderr
    child = int(result.stdout[0].split()[-1])
    daemon = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # killed before run_local returns; their reaper may take a moment
    while (_alive(child) or _alive(daemon)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child) and not _alive(daemon), (child, daemon)


def test_command_line_names_the_signal(tmp_path):
    script = _script(tmp_path, """
        import os, signal, time
        if os.environ["SPARK_HVD_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(600)
    """)
    proc = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "2", "--timeout", "120", "--grace", "5",
                           sys.executable, script], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "rank 1 was killed by SIGTERM" in proc.stderr


def test_bare_python_runs_the_launchers_interpreter(tmp_path):
    """``spark-hvd-run -np 1 python ...`` runs the interpreter spark_hvd is installed in, not PATH's, and says so."""
    import os

    other = tmp_path / "bin"
    other.mkdir()
    (other / "python").write_text("#!/bin/sh\necho PATH-python\n")
    (other / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{other}:{os.environ.get('PATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "1", "--timeout", "120", "python", "-c",
                           "import sys; print('exe', sys.executable)"], capture_output=True, text=True, timeout=180,
                          cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"[0] exe {sys.executable}" in proc.stdout and "PATH-python" not in proc.stdout
    assert f"running 'python' as the launcher's interpreter {sys.executable} (PATH's is {other}/python)" in proc.stderr
