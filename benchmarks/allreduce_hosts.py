"""``benchmarks/allreduce.py --hosts H --link RATE``: the same interleaved comparison with ranks on simulated hosts.

``H`` hosts (``tests/multihost/simhosts.py``: a network + UTS namespace each, one bridge, ``tc tbf`` at ``RATE`` on
both directions of every link; needs root) hold the ranks, ``N / H`` per host in host order; the benchmark's driver
(control connections, the KV rendezvous) runs on a host of its own. Every implementation gets the same placement:
``api`` (``spark_hvd.torch.allreduce_``: with several ranks per host the hierarchical path, found by itself),
``ring`` (the bare backend), ``gloo`` (torch.distributed, its flat ring; ``GLOO_SOCKET_IFNAME=eth0``) and ``mpi``
(Open MPI, started through ``--mca plm_rsh_agent`` = the hosts' ssh stand-in; left out with a note where it does not
start). The table adds each implementation's bus bandwidth as a fraction of the link rate: on one link per host the
ring's bus bandwidth can reach the link rate.

This module only places processes: ``allreduce.py`` calls ``enter(hosts, rate)`` once (it re-runs the benchmark's
driver inside the driver host) and asks ``prefix(rank, n)`` for each worker.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_STATE_ENV = "BENCH_SIMHOSTS"  # set in the driver host: "<tag>|<rate>|<host prefixes as json>"


def _simhosts():
    sys.path.insert(0, str(ROOT / "tests" / "multihost"))
    import simhosts

    return simhosts


def rate_bits(rate: str) -> float:
    """``"2gbit"`` -> 2e9."""
    return _simhosts()._rate_bits(rate)


def inside() -> bool:
    """Whether this process is the benchmark's driver inside its simulated host."""
    return _STATE_ENV in os.environ


def enter(hosts: int, rate: str, argv: list[str]) -> int:
    """Build ``hosts`` rank hosts + one driver host, re-run this benchmark (``argv``) as the driver inside the
    driver host, tear everything down, and return its exit code."""
    import json

    sim_mod = _simhosts()
    reason = sim_mod.unavailable_reason()
    if reason is not None:
        sys.stderr.write(f"allreduce.py --hosts: {reason}\n")
        return 2
    sim_mod.sweep_stale()
    sim_mod.install_teardown()
    with sim_mod.SimHosts(hosts + 1, rate=rate) as sim:
        driver, ranks = sim.hosts[0], sim.hosts[1:]
        state = {"rate": rate, "ssh": sim.ssh_command(), "driver": driver.address,
                 "hosts": [{"address": h.address, "prefix": h.prefix()} for h in ranks]}
        env = dict(os.environ, **{_STATE_ENV: json.dumps(state)})
        env.pop("SPARK_HVD_IFACE_ADDR", None)
        return driver.popen([sys.executable, *argv], env=env, start_new_session=False).wait()


def _state() -> dict:
    import json

    return json.loads(os.environ[_STATE_ENV])


def driver_address() -> str:
    """The address the driver's listeners bind (inside the driver host)."""
    return _state()["driver"]


def link_rate() -> str:
    return _state()["rate"]


def host_of(rank: int, n: int) -> dict:
    hosts = _state()["hosts"]
    per = max(1, n // len(hosts))
    return hosts[min(rank // per, len(hosts) - 1)]


def prefix(rank: int, n: int) -> list[str]:
    """The argv prefix that starts rank ``rank`` of ``n`` on its host."""
    return list(host_of(rank, n)["prefix"])


def mpirun_args(n: int) -> list[str]:
    """Open MPI's placement over the hosts through the ssh stand-in, on the hosts' eth0."""
    hosts = _state()["hosts"]
    per = max(1, n // len(hosts))
    spec = ",".join(f"{h['address']}:{per}" for h in hosts[: max(1, n // per)])
    return ["-H", spec, "--mca", "plm_rsh_agent", _state()["ssh"], "--mca", "btl_tcp_if_include", "eth0",
            "--mca", "oob_tcp_if_include", "eth0", "--mca", "btl", "self,vader,tcp"]
