"""``spark-hvd-run -H`` through a real OpenSSH server on each of two simulated hosts (key authentication, a
non-default port, ``-i``; a host asking for a password behind a custom ``--ssh-command``), skipped where ``sshd`` is
not installed or cannot start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import simhosts

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("rank_worker.py"))
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
PORT = 2222
PASSWORD_PORT = 2223


def _sshd_config(tmp: Path) -> Path:
    for kind in ("ed25519",):
        subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(tmp / f"host_{kind}")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "client")], check=True)
    (tmp / "authorized_keys").write_text((tmp / "client.pub").read_text())
    config = tmp / "sshd_config"
    # PASSWORD_PORT: the same server asking for a password (a host the launcher was not given a key for)
    config.write_text(f"Port {PORT}\nPort {PASSWORD_PORT}\nHostKey {tmp / 'host_ed25519'}\n"
                      f"AuthorizedKeysFile {tmp / 'authorized_keys'}\n"
                      "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                      f"UsePAM no\nStrictModes no\nPidFile {tmp / 'sshd.pid'}\nLogLevel ERROR\n"
                      f"Match LocalPort {PASSWORD_PORT}\n  PermitRootLogin yes\n  PasswordAuthentication yes\n"
                      "  KbdInteractiveAuthentication yes\n  PubkeyAuthentication no\n")
    return config


@pytest.fixture(scope="module")
def sshd_hosts(simhosts_ready, tmp_path_factory):
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None or shutil.which("ssh") is None:
        pytest.skip("OpenSSH (sshd, ssh, ssh-keygen) is not installed: apt-get install openssh-server")
    tmp = tmp_path_factory.mktemp("sshd")
    config = _sshd_config(tmp)
    os.makedirs("/run/sshd", exist_ok=True)
    sim = simhosts.SimHosts(3)
    try:
        servers = []
        for h in sim.hosts[1:]:
            servers.append(h.popen([SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE))
        probe = [sys.executable, "-c", "import socket,sys;socket.create_connection((sys.argv[1], int(sys.argv[2])),1)"]
        for h, server in zip(sim.hosts[1:], servers, strict=True):
            deadline = time.monotonic() + 15
            while sim.hosts[0].run([*probe, h.address, str(PORT)]).returncode != 0:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"sshd could not start in a simulated host: {server.stderr.read()[-500:]!r}")
                time.sleep(0.2)
        yield sim, tmp
    finally:
        sim.close()


def test_two_hosts_through_sshd(sshd_hosts):
    sim, tmp = sshd_hosts
    h1, h2 = sim.hosts[1], sim.hosts[2]
    ssh = f"ssh -o UserKnownHostsFile={tmp / 'known_hosts'} -o LogLevel=ERROR"
    argv = [sys.executable, "-m", "spark_hvd.runner", "-np", "4", "-H", f"{h1.address}:2,{h2.address}:2",
            "-p", str(PORT), "-i", str(tmp / "client"), "--ssh-command", ssh, "-x", "PYTHONPATH",
            "-x", "OMP_NUM_THREADS=1", sys.executable, WORKER, "check"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SPARK_HVD_IFACE_ADDR", None)
    done = sim.hosts[0].run(argv, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    rows = {int(line.split(" ", 1)[0].strip("[]")): json.loads(line.split(" ", 1)[1])
            for line in done.stdout.splitlines()}
    assert sorted(rows) == [0, 1, 2, 3]
    for rank, row in rows.items():
        assert row["hostname"] == (h1 if rank < 2 else h2).name
        assert (row["local_rank"], row["local_size"], row["cross_rank"], row["cross_size"]) == \
            (rank % 2, 2, rank // 2, 2)
        assert row["allreduce"] and row["allgather"] and row["broadcast"], row


def _ranks_on(sim: simhosts.SimHosts) -> list[str]:
    """Live processes of the rank hosts other than sshd itself."""
    found = []
    for h in sim.hosts[1:]:
        for pid in simhosts._ip("netns", "pids", h.name, check=False).stdout.split():
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
            except OSError:
                continue
            if state != "Z" and "sshd" not in cmd:
                found.append(f"{h.name}: {pid} {cmd}")
    return found


def test_ctrl_c_through_sshd_leaves_no_rank_behind(sshd_hosts):
    """The launcher's Ctrl-C ends the ssh clients; sshd closes the remote command's stdin, which stops the rank."""
    import signal

    sim, tmp = sshd_hosts
    h1, h2 = sim.hosts[1], sim.hosts[2]
    ssh = f"ssh -o UserKnownHostsFile={tmp / 'known_hosts'} -o LogLevel=ERROR"
    argv = [sys.executable, "-m", "spark_hvd.runner", "-H", f"{h1.address}:1,{h2.address}:1", "-p", str(PORT),
            "-i", str(tmp / "client"), "--ssh-command", ssh, "-x", "PYTHONPATH", "--grace", "2",
            sys.executable, WORKER, "hang"]
    proc = sim.hosts[0].popen(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sum("rank_worker" in p for p in _ranks_on(sim)) < 2:
        time.sleep(0.2)
    assert sum("rank_worker" in p for p in _ranks_on(sim)) == 2, _ranks_on(sim)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _ranks_on(sim):
        time.sleep(0.2)
    assert not _ranks_on(sim)


def test_host_asking_for_a_password_behind_a_custom_command_fails_fast_naming_it(sshd_hosts, tmp_path):
    """A wrapper around ssh gets no ``-o BatchMode``; the host asks for a password, and a graphical askpass program
    that would wait for ever is configured (``DISPLAY``, ``SSH_ASKPASS``): the launcher's remote shell has no
    terminal and ``SSH_ASKPASS_REQUIRE=never``, so ssh gives up at once and the host is named, well before the
    connect timeout (60 s here, so only an immediate failure passes)."""
    sim, tmp = sshd_hosts
    h1 = sim.hosts[1]
    wrapper = tmp_path / "my-rsh"
    wrapper.write_text(f"#!/bin/sh\nexec ssh -o UserKnownHostsFile={tmp / 'known_hosts'} "
                       "-o StrictHostKeyChecking=accept-new -o LogLevel=ERROR \"$@\"\n")
    askpass = tmp_path / "askpass"
    askpass.write_text("#!/bin/sh\nsleep 300\n")
    for f in (wrapper, askpass):
        f.chmod(0o700)
    argv = [sys.executable, "-m", "spark_hvd.runner", "-H", f"{h1.address}:1", "-p", str(PASSWORD_PORT),
            "--ssh-command", str(wrapper), "--ssh-connect-timeout", "60", "--start-timeout", "120", "--grace", "1",
            sys.executable, WORKER, "check"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DISPLAY": ":99", "SSH_ASKPASS": str(askpass)}
    env.pop("SSH_ASKPASS_REQUIRE", None)
    start = time.monotonic()
    done = sim.hosts[0].run(argv, timeout=120, env=env)
    assert done.returncode == 255, done.stderr
    assert f"could not be started on host {h1.address} ({wrapper} exited with code 255)" in done.stderr, done.stderr
    assert time.monotonic() - start < 30
    assert not _ranks_on(sim)
