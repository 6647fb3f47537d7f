"""``spark-hvd-run -H`` across simulated hosts (network + UTS namespaces), through ``--ssh-command``: topology and
collectives against numpy, failures named by rank and host with nothing left running, an unreachable host, Ctrl-C,
a link taken down mid-allreduce, and the data interface named with ``--network-interface``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import simhosts

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("rank_worker.py"))


def _launch(sim: simhosts.SimHosts, hosts: str, mode: list[str], *extra: str, env: dict | None = None,
            **popen: object) -> subprocess.Popen:
    """``spark-hvd-run -H hosts ... rank_worker.py MODE`` started inside host 0."""
    argv = [sys.executable, "-m", "spark_hvd.runner", "-H", hosts, "--ssh-command", sim.ssh_command(),
            "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS=1", "-x", "SPARK_HVD_TIMEOUT", "-x", "SPARK_HVD_BACKEND",
            "--grace", "3", *extra,
            sys.executable, WORKER, *mode]
    child_env = {**os.environ, "PYTHONPATH": str(REPO), "SPARK_HVD_TIMEOUT": "8", **(env or {})}
    child_env.pop("SPARK_HVD_IFACE_ADDR", None)
    return sim.hosts[0].popen(argv, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              **popen)


def _left_running(sim: simhosts.SimHosts, first: int = 1) -> list[str]:
    """Processes still alive in the rank hosts' namespaces (zombies aside); ``first=0``: the launcher's host too."""
    found = []
    for h in sim.hosts[first:]:
        for pid in simhosts._ip("netns", "pids", h.name, check=False).stdout.split():
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
            except OSError:
                continue
            if state != "Z":
                found.append(f"{h.name}: {pid} {cmd}")
    return found


def _wait_none_left(sim: simhosts.SimHosts, within_s: float = 10.0, first: int = 1) -> list[str]:
    deadline = time.monotonic() + within_s
    left = _left_running(sim, first)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _left_running(sim, first)
    return left


def test_two_hosts_two_ranks_topology_and_collectives(sim):
    h1, h2 = sim.hosts[1], sim.hosts[2]
    proc = _launch(sim, f"{h1.address}:2,{h2.address}:2", ["check"])
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    rows = {}
    for line in out.splitlines():
        prefix, _, body = line.partition(" ")
        rows[int(prefix.strip("[]"))] = json.loads(body)
    assert sorted(rows) == [0, 1, 2, 3]
    for rank, row in rows.items():
        host = h1 if rank < 2 else h2
        assert row["hostname"] == host.name  # ranks placed in host order
        assert (row["rank"], row["size"]) == (rank, 4)
        assert (row["local_rank"], row["local_size"]) == (rank % 2, 2)
        assert (row["cross_rank"], row["cross_size"]) == (rank // 2, 2)
        assert row["transport"] == "hier"  # shared memory within a host, TCP between the two
        assert row["torchrun"] == {"RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4",
                                   "MASTER_ADDR": h1.address}
        assert row["allreduce"] and row["allgather"] and row["broadcast"], row
    assert not _wait_none_left(sim)


def test_failed_rank_stops_every_rank_and_is_named_with_its_host(sim):
    h1, h2 = sim.hosts[1], sim.hosts[2]
    start = time.monotonic()
    proc = _launch(sim, f"{h1.address}:2,{h2.address}:2", ["fail", "3"])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 5, err
    assert f"rank 3 on host {h2.address} exited with code 5, the first rank to fail" in err
    assert "[3] rank 3 fails on purpose" in err
    assert time.monotonic() - start < 60
    assert not _wait_none_left(sim)


def test_unreachable_host_is_a_clear_error_in_bounded_time(sim):
    h1 = sim.hosts[1]
    start = time.monotonic()
    proc = _launch(sim, f"{h1.address}:1,198.18.0.250:1", ["check"])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 255, err
    assert "could not be started on host 198.18.0.250" in err
    assert time.monotonic() - start < 30
    assert not _wait_none_left(sim)


def test_custom_command_that_never_answers_is_named_within_the_connect_timeout(sim, tmp_path):
    """A remote-shell command that hangs (a host that does not answer, a prompt nobody sees) gets no ssh option
    from the launcher, yet fails within ``--ssh-connect-timeout`` naming the host, long before ``--start-timeout``."""
    h1 = sim.hosts[1]
    silent = tmp_path / "silent-rsh"
    silent.write_text("#!/bin/sh\nsleep 300\n")
    silent.chmod(0o700)
    argv = [sys.executable, "-m", "spark_hvd.runner", "-H", f"{h1.address}:1", "--ssh-command", str(silent),
            "--ssh-connect-timeout", "3", "--start-timeout", "300", "--grace", "1", sys.executable, WORKER, "check"]
    start = time.monotonic()
    done = sim.hosts[0].run(argv, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 255, done.stderr
    assert (f"could not be started on host {h1.address} (its remote shell did not answer within 3 s "
            "(--ssh-connect-timeout))") in done.stderr
    assert time.monotonic() - start < 30


def test_remote_shell_that_answers_but_never_starts_the_rank_hits_the_start_timeout(sim, tmp_path):
    """The remote shell answers (its first line arrives) but the rank never starts: ``--start-timeout`` names
    the host."""
    h1 = sim.hosts[1]
    stuck = tmp_path / "stuck-rsh"
    stuck.write_text("#!/bin/sh\nprintf '\\037spark-hvd-run: remote shell answered\\037\\n' >&2\nsleep 300\n")
    stuck.chmod(0o700)
    argv = [sys.executable, "-m", "spark_hvd.runner", "-H", f"{h1.address}:1", "--ssh-command", str(stuck),
            "--ssh-connect-timeout", "60", "--start-timeout", "3", "--grace", "1", sys.executable, WORKER, "check"]
    start = time.monotonic()
    done = sim.hosts[0].run(argv, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 255, done.stderr
    assert f"could not be started on host {h1.address} (its rank did not start within 3 s)" in done.stderr
    assert time.monotonic() - start < 30


def test_ctrl_c_stops_every_remote_rank(sim):
    h1, h2 = sim.hosts[1], sim.hosts[2]
    proc = _launch(sim, f"{h1.address}:1,{h2.address}:1", ["hang"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(_left_running(sim)) < 2:
        time.sleep(0.2)
    assert len(_left_running(sim)) >= 2
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted; all ranks stopped" in err
    assert not _wait_none_left(sim)


def test_link_down_mid_allreduce_fails_the_others_naming_the_rank(sim):
    h1, h2 = sim.hosts[1], sim.hosts[2]
    proc = _launch(sim, f"{h1.address}:1,{h2.address}:1", ["loop"])
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and "looping" not in line:
            line = proc.stdout.readline()
        assert "looping" in line
        time.sleep(1.0)
        h2.link(False)
        start = time.monotonic()
        _, err = proc.communicate(timeout=90)
        took = time.monotonic() - start
    finally:
        h2.link(True)
    assert proc.returncode == 3, err
    # a rank names the rank it lost and where that rank runs (in the allreduce, or in the engine's negotiation, an
    # allgather, if the link went down between two). Both sides of the cut time out together, and here (unlike over
    # real ssh, whose channel the cut would take too) the cut rank's output still reaches the launcher, which stops
    # the job at the first report: either side's report may come first
    failed = r"FAILED CollectiveTimeoutError: (allreduce|allgather): rank {} on host {} \({}\) sent nothing"
    assert (re.search(r"\[0\] " + failed.format(1, h2.name, re.escape(h2.address)), err)
            or re.search(r"\[1\] " + failed.format(0, h1.name, re.escape(h1.address)), err)), err
    assert took < 8 + 20  # SPARK_HVD_TIMEOUT=8, then the launcher's stop
    assert not _wait_none_left(sim)


def test_named_data_interface_carries_the_traffic(simhosts_ready):
    with simhosts.SimHosts(3, rate="1gbit") as two:
        for k in (0, 1, 2):
            two.add_interface(k, "eth1")
        h1, h2 = two.hosts[1], two.hosts[2]
        before = {k: (two.hosts[k].counters("eth0"), two.hosts[k].counters("eth1")) for k in (1, 2)}
        proc = _launch(two, f"{h1.address}:1,{h2.address}:1", ["check"], "--network-interface", "eth1")
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        assert all(json.loads(line.partition(" ")[2])["allreduce"] for line in out.splitlines())
        for k in (1, 2):
            (e0_tx, _), (e1_tx, _) = before[k]
            (n0_tx, _), (n1_tx, _) = two.hosts[k].counters("eth0"), two.hosts[k].counters("eth1")
            data, control = n1_tx - e1_tx, n0_tx - e0_tx
            # the 8 MiB allreduce went over eth1; eth0 carried only ssh-less control (rendezvous, driver service)
            assert data > 8 * 1024 * 1024, (k, data, control)
            assert control < data / 10, (k, data, control)
        # torch.distributed gloo (the device path's kind of group) is told the same interface (GLOO_SOCKET_IFNAME):
        # without it gloo would take the host name's address, 127.0.1.1 here, and never connect
        before = {k: two.hosts[k].counters("eth1")[0] for k in (1, 2)}
        proc = _launch(two, f"{h1.address}:1,{h2.address}:1", ["check"], "--network-interface", "eth1",
                       env={"SPARK_HVD_BACKEND": "torch"})
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        assert all(json.loads(line.partition(" ")[2])["allreduce"] for line in out.splitlines())
        for k in (1, 2):
            assert two.hosts[k].counters("eth1")[0] - before[k] > 8 * 1024 * 1024


def _marked(marks: set[str]) -> list[str]:
    """Live processes anywhere on this machine whose environment carries one of ``marks`` (SPARK_HVD_RANK_MARK)."""
    needles = [f"\0SPARK_HVD_RANK_MARK={m}\0".encode() for m in marks]
    found = []
    for entry in os.listdir("/proc"):
        try:
            environ = b"\0" + Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if state != "Z" and any(n in environ for n in needles):
            found.append(entry)
    return found


def test_processes_that_left_the_ranks_group_are_stopped_with_the_job(sim):
    """Each rank starts a sleeper in a session of its own and a double-forked one (``setsid -f``); rank 1 fails.
    Rank 0 runs on the launcher's own host (``localhost``), rank 1 on another: both remote ends find them (their
    process tree, which the orphan re-joins as a subreaper's child, and the rank's marker in their environment) and
    kill them, naming them with ``--verbose 2``."""
    h2 = sim.hosts[2]
    proc = _launch(sim, f"localhost:1,{h2.address}:1", ["orphan", "1"], "--verbose", "2")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 5, err
    assert f"rank 1 on host {h2.address} exited with code 5, the first rank to fail" in err
    rows = [json.loads(line.partition(" ")[2]) for line in out.splitlines() if line.partition(" ")[2].startswith("{")]
    marks = {row["mark"] for row in rows}
    assert len(marks) == 2 and None not in marks, out
    for rank in (0, 1):  # the rank's own child (a session of its own) among what its host killed
        child = next(row["child"] for row in rows if row["mark"].split(".")[1] == str(rank))
        assert re.search(rf"\[{rank}\] spark-hvd-run: rank {rank}: (stopping, SIGTERM|SIGKILL) to \d+ process\(es\): "
                         rf".*\b{child} \(sleep\)", err), err
    # two sleepers per rank, the double-forked one too (named setsid if it had not exec'd sleep yet)
    assert err.count("(sleep)") + err.count("(setsid)") >= 4, err
    assert not _wait_none_left(sim, first=0)  # the launcher's host too (the launcher itself has exited)
    assert not _marked(marks)


def _hiding_rsh(sim: simhosts.SimHosts, tmp: Path, hidden: Path, paths: dict[str, Path]) -> str:
    """An ``--ssh-command`` for hosts without the launcher's interpreter: ``hidden`` is an empty tmpfs there (a
    mount namespace of the command's own), the remote shell's PATH is ``paths[host]`` alone and PYTHONPATH unset,
    as a login shell on another machine would have them."""
    rsh = tmp / f"hiding-rsh-{len(list(tmp.glob('hiding-rsh-*')))}"
    table = {host: str(path) for host, path in paths.items()}
    rsh.write_text(f"""#!{sys.executable}
import os, sys
args = sys.argv[1:]
args[-1] = "PATH=" + {table!r}[args[-2]] + "; export PATH; unset PYTHONPATH; " + args[-1]
os.execvp("unshare", ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs hidden "$0" && exec "$@"',
                      "{hidden}", "{sim.ssh_command()}", *args])
""")
    rsh.chmod(0o700)
    return str(rsh)


def test_remote_python_found_on_the_hosts_path_or_a_clear_error_naming_the_host(sim, tmp_path):
    """The launcher runs from an environment the hosts do not have (its interpreter's path is missing there): the
    remote end starts with ``python3`` from the host's PATH; with no Python there, or one that cannot import
    spark_hvd (``SPARK_HVD_REMOTE_PYTHON``), the host is named before any rank starts."""
    h1, h2 = sim.hosts[1], sim.hosts[2]
    env_dir = tmp_path / "launcher-env"  # the launcher's interpreter: a venv at a path only this host has
    (env_dir / "bin").mkdir(parents=True)
    if sys.prefix != sys.base_prefix:
        (env_dir / "pyvenv.cfg").write_text((Path(sys.prefix) / "pyvenv.cfg").read_text())
        (env_dir / "lib").symlink_to(Path(sys.prefix) / "lib")
    launcher_python = env_dir / "bin" / "python"
    launcher_python.symlink_to(sys.executable)
    good, empty = tmp_path / "good-bin", tmp_path / "empty-bin"
    good.mkdir()
    empty.mkdir()
    (good / "python3").write_text(f"#!/bin/sh\nVIA=path-python3 exec {sys.executable} \"$@\"\n")
    (good / "python3").chmod(0o755)
    (good / "python-nosite").write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    (good / "python-nosite").chmod(0o755)
    probe = ("import os, sys; print(os.path.exists(sys.argv[1]), os.environ.get('VIA'), "
             "os.environ.get('SPARK_HVD_RANK'))")

    def launch(rsh: str, hosts: str = f"{h1.address}:1", env: dict | None = None) -> subprocess.CompletedProcess:
        argv = [str(launcher_python), "-m", "spark_hvd.runner", "-H", hosts, "--ssh-command", rsh,
                "-x", "PYTHONPATH", "--grace", "1", sys.executable, "-c", probe, str(launcher_python)]
        return sim.hosts[0].run(argv, timeout=120, cwd=str(tmp_path),
                                env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})

    done = launch(_hiding_rsh(sim, tmp_path, env_dir, {h1.address: good}))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0] False path-python3 0", (done.stdout, done.stderr)

    # rank 0's host has python3, rank 1's has none: rank 1's host is named, and rank 0 never started (it waits
    # until every host is ready)
    done = launch(_hiding_rsh(sim, tmp_path, env_dir, {h2.address: good, h1.address: empty}),
                  hosts=f"{h2.address}:1,{h1.address}:1")
    assert done.returncode == 127, done.stderr
    assert (f"could not be started on host {h1.address} (no Python interpreter there: tried {launcher_python}, "
            "python3): install spark_hvd there, or name an interpreter that has it with --remote-python PATH "
            "(or SPARK_HVD_REMOTE_PYTHON)") in done.stderr
    assert "[0]" not in done.stdout + done.stderr

    done = launch(_hiding_rsh(sim, tmp_path, env_dir, {h1.address: good}),
                  env={"SPARK_HVD_REMOTE_PYTHON": "python-nosite"})
    assert done.returncode == 127, done.stderr
    assert f"could not be started on host {h1.address} (cannot import spark_hvd with {sys.executable}: " \
        "ModuleNotFoundError: No module named " in done.stderr
    assert "[0]" not in done.stdout
    assert not _wait_none_left(sim)
