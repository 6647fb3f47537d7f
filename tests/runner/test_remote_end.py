"""The remote end of ``spark-hvd-run -H`` run on this machine through ``sh`` (as ssh would run it): the interpreter
it picks, or the line naming what is missing, and every process of a rank stopped with it, even one that left the
rank's process group and session. No network and no root needed (the simulated-host tests in tests/multihost run
the same code across hosts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spark_hvd.runner.rank_tree import MARK_ENV
from spark_hvd.runner.remote import (
    CONNECTED_MARK,
    EXIT_MARK,
    GO,
    NO_IMPORT_MARK,
    NO_PYTHON_MARK,
    READY_MARK,
    STARTED_MARK,
    python_candidates,
    remote_command,
    request,
)

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="the remote end reads /proc (Linux)"),
              pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid (util-linux)")]


def _start(pythons: list[str], argv: list[str], tmp_path: Path, verbose: int = 2) -> subprocess.Popen:
    proc = subprocess.Popen(["sh", "-c", remote_command(pythons, str(tmp_path))], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.stdin is not None
    try:
        proc.stdin.write(request(argv, {"SPARK_HVD_RANK": "3", "SPARK_HVD_JOB_ID": "cafe"}, str(tmp_path), 2.0,
                                 [str(REPO)], verbose).decode())
        proc.stdin.flush()
    except BrokenPipeError:  # a shell that found no interpreter may exit before the request is written
        pass
    return proc


def _finish(proc: subprocess.Popen) -> str:
    """Wait for the remote end (its output is a few lines: the pipes cannot fill) and return its stderr."""
    proc.wait(timeout=60)
    assert proc.stderr is not None and proc.stdin is not None
    try:
        proc.stdin.close()
    except BrokenPipeError:  # the request was never read
        pass
    return proc.stderr.read()


def _marked(mark: str) -> list[int]:
    needle = f"\0{MARK_ENV}={mark}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            environ = b"\0" + Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and needle in environ:
            found.append(int(entry))
    return found


def _command(pid: int) -> str:
    """``pid``'s command line (for a failure's message), or "gone"."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80]
    except OSError:
        return "gone"


def test_candidates_the_named_interpreter_alone_else_the_launchers_then_python3():
    assert python_candidates("/opt/py/bin/python", "/venv/bin/python") == ["/opt/py/bin/python"]
    assert python_candidates(None, "/venv/bin/python") == ["/venv/bin/python", "python3"]


def test_no_interpreter_there_is_one_marked_line_naming_what_was_tried(tmp_path):
    not_python = tmp_path / "not-python"
    not_python.write_text("data, not a program\n")  # exists, not executable: not taken
    proc = _start([str(tmp_path / "missing" / "python"), str(not_python), "no-such-python-here"], ["true"], tmp_path)
    err = _finish(proc)
    assert proc.returncode == 127
    assert err.splitlines() == [f"{NO_PYTHON_MARK} {tmp_path / 'missing' / 'python'} {not_python} "
                                "no-such-python-here"]


def test_an_interpreter_that_cannot_import_spark_hvd_is_named(tmp_path):
    nosite = tmp_path / "python-nosite"  # an interpreter without its site-packages: no numpy, so no spark_hvd
    nosite.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    nosite.chmod(0o755)
    proc = _start([str(tmp_path / "missing-python"), str(nosite)], ["true"], tmp_path)
    err = _finish(proc)
    assert proc.returncode == 127
    lines = err.splitlines()
    assert lines[0] == CONNECTED_MARK
    assert lines[1].startswith(f"{NO_IMPORT_MARK} {sys.executable}: ModuleNotFoundError: No module named "), err


def test_stopping_a_rank_stops_the_processes_that_left_its_group(tmp_path):
    """The rank starts a sleeper in a session of its own and a double-forked one, prints its marker, and waits;
    closing stdin (what the launcher does to stop a rank) leaves none of them alive, and each is named."""
    script = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
              "subprocess.run(['setsid', '-f', 'sleep', '601'], check=True)\n"
              f"print(os.environ['{MARK_ENV}'], child.pid, flush=True)\n"
              "time.sleep(600)\n")
    proc = _start([sys.executable], [sys.executable, "-c", script], tmp_path)
    assert proc.stdout is not None and proc.stdin is not None
    mark, child = proc.stdout.readline().split()
    assert mark.startswith("cafe.3.")
    # the rank and its two sleepers (``setsid -f`` returns before its child runs: give it the time it takes)
    deadline = time.monotonic() + 30
    while len(_marked(mark)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = {pid: _command(pid) for pid in _marked(mark)}
    assert len(seen) >= 3, f"marked {mark} after 30 s (the rank, sleep 600, sleep 601 expected): {seen}"
    proc.stdin.close()
    err = _finish(proc)
    assert proc.returncode == 143, err  # SIGTERM
    assert "spark-hvd-run: rank 3: stopping, SIGTERM to 3 process(es): " in err and f"{child} (sleep)" in err, err
    assert STARTED_MARK in err and f"{EXIT_MARK} 143 " in err
    deadline = time.monotonic() + 10
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _marked(mark)


def test_processes_a_rank_left_behind_when_it_exits_are_killed(tmp_path):
    script = ("import os, subprocess\n"
              "subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
              "subprocess.run(['setsid', '-f', 'sleep', '601'], check=True)\n"
              f"print(os.environ['{MARK_ENV}'], flush=True)\n"
              "os._exit(4)\n")
    proc = _start([sys.executable], [sys.executable, "-c", script], tmp_path)
    assert proc.stdout is not None
    mark = proc.stdout.readline().strip()
    err = _finish(proc)  # stdin kept open: the rank's own exit ends it
    assert proc.returncode == 4, err
    assert "spark-hvd-run: rank 3: SIGKILL to 2 process(es): " in err and " it left" in err, err
    assert not _marked(mark)


def test_a_gated_rank_starts_only_on_go_and_not_at_all_when_stdin_ends(tmp_path):
    """With ``gate`` the remote end says it is ready and waits: end of file (the launcher gave up on another host)
    exits 0 with nothing started; ``go`` starts the rank."""
    flag = tmp_path / "started"
    argv = [sys.executable, "-c", f"open({str(flag)!r}, 'w').close()"]
    for go in (False, True):
        proc = subprocess.Popen(["sh", "-c", remote_command([sys.executable], str(tmp_path))],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.write(request(argv, {"SPARK_HVD_RANK": "0"}, str(tmp_path), 2.0, [str(REPO)], gate=True))
        proc.stdin.flush()
        assert proc.stderr.readline().rstrip(b"\n").decode() == CONNECTED_MARK
        assert proc.stderr.readline().rstrip(b"\n").decode() == READY_MARK
        assert not flag.exists()
        if go:
            proc.stdin.write(GO)
            proc.stdin.flush()
            assert proc.wait(timeout=60) == 0
            assert flag.exists()
        else:
            proc.stdin.close()
            assert proc.wait(timeout=60) == 0
            assert not flag.exists()
        proc.stdin.close()
        proc.stderr.close()
        assert proc.stdout is not None
        proc.stdout.close()
