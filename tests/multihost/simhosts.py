"""Simulated hosts on one Linux machine: a network namespace and a UTS namespace per host.

``SimHosts(n, rate="2gbit")`` builds ``n`` hosts ``<tag>h0 ... `` each with

* its own network namespace (``/run/netns/<name>``) holding ``lo`` and ``eth0`` with an address in the benchmark
  range 198.18.0.0/15 (``198.18.0.<k+1>/24``; no default route: nothing can leave the simulated network);
* its own UTS namespace (bind-mounted under ``/run/spark-hvd-simhosts/``) whose host name is the host's name, so
  spark_hvd never takes two of them for one host;
* its own ``/etc/hosts`` (``/etc/netns/<name>/hosts``, mounted by ``ip netns exec``) mapping the host name to
  127.0.1.1 as Debian and Ubuntu do: the trap that made ranks publish a loopback address;
* ``eth0`` plugged into one bridge that lives in a namespace of its own (``<tag>br``): the root namespace's
  interfaces, routes and netfilter are not touched;
* with ``rate``: a ``tc tbf`` shaper on both directions of each host's link (this kernel has no ``netem``).

``add_interface(k, "eth1")`` gives a host a second link on a second bridge (198.19.0.<k+1>/24).

Names carry this process's pid (``shv<pid>x<random>``), so concurrent test runs never collide, and ``sweep_stale()``
removes the namespaces of test runs whose process is gone. ``close()`` kills every process left in the hosts'
namespaces and removes everything; it runs from ``atexit``, from the test fixture's finalizer and on SIGTERM/SIGINT
(``install_teardown``).

``host.popen(argv, ...)`` / ``host.run(argv)`` start a process inside a host; ``ssh_command()`` writes a small
script that is called as ``ssh`` is (``CMD [ssh options] HOST 'shell command'``) and runs the shell command inside
that host, standing in for ssh in ``spark-hvd-run --ssh-command``.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PREFIX = "shv"
UTS_DIR = "/run/spark-hvd-simhosts"
_LIVE: list[SimHosts] = []


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def unavailable_reason() -> str | None:
    """Why simulated hosts cannot be made here (None when they can)."""
    if sys.platform != "linux":
        return "simulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (ip netns add, unshare --uts)"
    for tool in ("ip", "tc", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool!r} (iproute2 / util-linux)"
    probe = f"{PREFIX}{os.getpid()}xprobe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _kill_netns_processes(ns: str) -> None:
    found = _ip("netns", "pids", ns, check=False)
    for pid in found.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove_uts(path: str) -> None:
    subprocess.run(["umount", path], capture_output=True, timeout=30)
    try:
        os.unlink(path)
    except OSError:
        pass


def sweep_stale() -> list[str]:
    """Remove the namespaces (and UTS files) of earlier runs whose owning process no longer exists."""
    removed = []
    listing = _ip("netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in listing if line.strip()]
    uts = os.listdir(UTS_DIR) if os.path.isdir(UTS_DIR) else []
    for name in names + uts:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("x", 1)[0]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        if name in uts:
            _remove_uts(os.path.join(UTS_DIR, name))
        else:
            _kill_netns_processes(name)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        removed.append(name)
    return removed


@dataclass
class SimHost:
    """One simulated host: ``name`` (its host name and network namespace), ``address`` (of ``eth0``)."""

    name: str
    address: str
    uts: str
    interfaces: dict[str, str] = field(default_factory=dict)

    def prefix(self) -> list[str]:
        """The argv prefix that runs a command inside this host (``ip netns exec`` also mounts this namespace's
        ``/sys`` and the host's ``/etc/netns/<name>/hosts`` over ``/etc/hosts``)."""
        return ["ip", "netns", "exec", self.name, "nsenter", f"--uts={self.uts}", "--"]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside this host (a session of its own unless told otherwise)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen([*self.prefix(), *argv], **kwargs)

    def run(self, argv: Sequence[str], timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host and wait for it (output captured as text)."""
        return subprocess.run([*self.prefix(), *argv], capture_output=True, text=True, timeout=timeout, **kwargs)

    def counters(self, iface: str = "eth0") -> tuple[int, int]:
        """``(tx_bytes, rx_bytes)`` of one of this host's interfaces (``/sys`` outside ``ip netns exec`` shows the
        root namespace's, so ask ``ip -s``)."""
        out = json.loads(_ip("-s", "-j", "-n", self.name, "link", "show", "dev", iface).stdout)[0]["stats64"]
        return int(out["tx"]["bytes"]), int(out["rx"]["bytes"])

    def link(self, up: bool, iface: str = "eth0") -> None:
        """Take one of this host's links down or up."""
        _ip("-n", self.name, "link", "set", iface, "up" if up else "down")


class SimHosts:
    """``n`` simulated hosts on one bridge; see the module docstring."""

    def __init__(self, n: int, rate: str | None = None, *, tag: str | None = None) -> None:
        self.tag = tag or f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.rate = rate
        self.bridges: list[str] = []
        self.hosts: list[SimHost] = []
        self.tmp = tempfile.mkdtemp(prefix=f"{self.tag}-")
        self._closed = False
        _LIVE.append(self)
        try:
            os.makedirs(UTS_DIR, exist_ok=True)
            self._add_bridge()
            for k in range(n):
                self._add_host(k)
        except BaseException:
            self.close()
            raise

    # -- building ----------------------------------------------------------------------------------------------
    def _add_bridge(self) -> str:
        ns = f"{self.tag}b{len(self.bridges)}"
        _ip("netns", "add", ns)
        self.bridges.append(ns)
        _ip("-n", ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", ns, "link", "set", "br0", "up")
        return ns

    def _shape(self, ns: str, dev: str) -> None:
        if not self.rate:
            return
        bits = _rate_bits(self.rate)
        burst = max(256 * 1024, int(bits / 8 * 0.004))
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                        self.rate, "burst", str(burst), "latency", "50ms"], check=True, capture_output=True,
                       timeout=30)

    def _plug(self, host: str, k: int, bridge: str, iface: str, subnet: int) -> str:
        port = f"p{k}{iface}"[:15]
        _ip("-n", host, "link", "add", iface, "type", "veth", "peer", "name", port, "netns", bridge)
        _ip("-n", bridge, "link", "set", port, "master", "br0")
        _ip("-n", bridge, "link", "set", port, "up")
        address = f"198.{18 + subnet}.0.{k + 1}"
        _ip("-n", host, "addr", "add", f"{address}/24", "dev", iface)
        _ip("-n", host, "link", "set", iface, "up")
        self._shape(host, iface)
        self._shape(bridge, port)
        return address

    def _add_host(self, k: int) -> None:
        name = f"{self.tag}h{k}"
        _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")
        uts = os.path.join(UTS_DIR, name)
        open(uts, "w").close()
        subprocess.run(["unshare", f"--uts={uts}", "hostname", name], check=True, capture_output=True, timeout=30)
        # Debian/Ubuntu's /etc/hosts: the host name resolves to 127.0.1.1, which no other host can reach
        os.makedirs(f"/etc/netns/{name}", exist_ok=True)
        with open(f"/etc/netns/{name}/hosts", "w") as f:
            f.write(f"127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n")
        address = self._plug(name, k, self.bridges[0], "eth0", 0)
        self.hosts.append(SimHost(name, address, uts, {"eth0": address}))

    def add_interface(self, k: int, iface: str = "eth1") -> str:
        """A second link for host ``k`` on a second bridge (198.19.0.<k+1>/24, shaped like the first)."""
        if len(self.bridges) < 2:
            self._add_bridge()
        host = self.hosts[k]
        address = self._plug(host.name, k, self.bridges[1], iface, 1)
        host.interfaces[iface] = address
        return address

    # -- using -------------------------------------------------------------------------------------------------
    def ssh_command(self) -> str:
        """A script called as ssh is (``CMD [options] HOST 'command'``) that runs the command inside HOST (a host
        name or address of these hosts) with stdin, stdout and stderr passed through."""
        table = {}
        for h in self.hosts:
            for key in (h.name, *h.interfaces.values()):
                table[key] = h.prefix()
        path = os.path.join(self.tmp, "netns-ssh")
        with open(path, "w") as f:
            f.write(_SSH_SCRIPT.format(python=sys.executable, table=json.dumps(table)))
        os.chmod(path, stat.S_IRWXU)
        return path

    def close(self) -> None:
        """Kill every process in the hosts' namespaces and remove them, their UTS files and the bridges."""
        if self._closed:
            return
        self._closed = True
        names = [h.name for h in self.hosts] + self.bridges
        for ns in names:
            _kill_netns_processes(ns)
        time.sleep(0.05)
        for ns in names:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        for h in self.hosts:
            _remove_uts(h.uts)
        uts_left = os.path.join(UTS_DIR, f"{self.tag}h{len(self.hosts)}")  # a host that failed half-built
        if os.path.exists(uts_left):
            _remove_uts(uts_left)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self in _LIVE:
            _LIVE.remove(self)

    def __enter__(self) -> SimHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: give it as tc does, e.g. 2gbit or 500mbit")


def close_all() -> None:
    """Tear down every ``SimHosts`` of this process (``atexit`` and the signal handlers call it)."""
    for sim in list(_LIVE):
        sim.close()


_installed = False


def install_teardown() -> None:
    """Tear down on interpreter exit and on SIGTERM / SIGINT / SIGHUP (then the previous handler runs)."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(close_all)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        previous = signal.getsignal(signum)

        def handler(sig: int, frame: Any, previous: Any = previous) -> None:
            close_all()
            if callable(previous):
                previous(sig, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)

        signal.signal(signum, handler)


_SSH_SCRIPT = '''#!{python}
"""Stands in for ssh: CMD [ssh options] HOST 'shell command' runs the command inside the simulated HOST."""
import os, sys
TABLE = {table}
WITH_VALUE = set("bcDEeFIiJLlmOoPpRSWw")
args = sys.argv[1:]
while args and args[0].startswith("-"):
    opt = args.pop(0)
    if opt == "--":
        break
    if len(opt) == 2 and opt[1] in WITH_VALUE and args:
        args.pop(0)
if len(args) < 2:
    sys.stderr.write("netns-ssh: usage: netns-ssh [options] HOST COMMAND\\n")
    sys.exit(255)
host, command = args[0], " ".join(args[1:])
if host not in TABLE:
    sys.stderr.write(f"netns-ssh: connect to host {{host}}: No route to host\\n")
    sys.exit(255)
os.execvp(TABLE[host][0], TABLE[host] + ["sh", "-c", command])
'''
