"""Which address a rank listens on and publishes, and which host it is on.

A rank's peers must be able to reach the address it publishes, with no configuration on an ordinary cluster. In
order of precedence (``listen_address``):

1. ``SPARK_HVD_IFACE_ADDR=ADDRESS``: that address, as given (the override kept from earlier releases);
2. ``SPARK_HVD_NETWORK_INTERFACE=eth1`` (or a comma-separated list; Horovod's ``HOROVOD_GLOO_IFACE`` is accepted
   as an alias, and ``spark-hvd-run --network-interface`` sets it): the IPv4 address of the first named interface
   this host has. NCCL and gloo groups of the device path are told the same interfaces
   (``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME``, unless the user set those, ``device_group_env``);
3. the address the kernel routes towards the job's meeting point: the launcher's rendezvous service, or on Spark the
   driver's service (``spark.driver.host``); a UDP ``connect`` picks the route and sends nothing;
4. else a non-loopback address of an interface that is up (the host name's address when it is not loopback:
   Debian-style ``/etc/hosts`` map the host name to 127.0.1.1, which no other host can reach).

Loopback is published only where the meeting point itself is on loopback (every rank on one host) or the host has
no other address; ``check_reachable`` then turns a loopback address in a job that spans machines into an error
naming the host and the remedy, instead of a connection timeout.

Host identity (``host_identity``) decides which ranks share memory: the host name, the kernel's boot id and the
network namespace, so two machines (or two containers / network namespaces of one machine, which cannot all reach
each other's loopback) are never taken for one. ``SPARK_HVD_HOST_ID`` overrides it (tests fake several hosts).
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from spark_hvd.core.errors import SparkHvdError

IFACE_ENV = "SPARK_HVD_IFACE_ADDR"
NETWORK_INTERFACE_ENV = "SPARK_HVD_NETWORK_INTERFACE"
#: Horovod's name for the interface(s) its gloo controller uses.
NETWORK_INTERFACE_ALIAS = "HOROVOD_GLOO_IFACE"
#: Overrides the host identity (tests use it to make ranks of one machine look like several hosts).
HOST_ID_ENV = "SPARK_HVD_HOST_ID"

_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


class AddressError(SparkHvdError):
    """No usable address: a named interface missing, or loopback in a job that spans hosts."""


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP literal) is a loopback address; host names are not resolved."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _ioctl(sock: socket.socket, request: int, name: str) -> bytes:
    buf = array.array("B", struct.pack("256s", name.encode()[:15]))
    fcntl.ioctl(sock.fileno(), request, buf, True)
    return buf.tobytes()


def interfaces() -> dict[str, tuple[str, bool, bool]]:
    """``{name: (ipv4 address, up, loopback)}`` of this network namespace's interfaces that have an IPv4 address."""
    found: dict[str, tuple[str, bool, bool]] = {}
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                address = socket.inet_ntoa(_ioctl(probe, _SIOCGIFADDR, name)[20:24])
                flags = struct.unpack("H", _ioctl(probe, _SIOCGIFFLAGS, name)[16:18])[0]
            except OSError:  # no IPv4 address on it
                continue
            found[name] = (address, bool(flags & _IFF_UP), bool(flags & _IFF_LOOPBACK))
    finally:
        probe.close()
    return found


def named_interfaces(environ: Mapping[str, str] | None = None) -> list[str]:
    """The interfaces named by ``SPARK_HVD_NETWORK_INTERFACE`` (or ``HOROVOD_GLOO_IFACE``), in order."""
    env = os.environ if environ is None else environ
    raw = env.get(NETWORK_INTERFACE_ENV) or env.get(NETWORK_INTERFACE_ALIAS) or ""
    return [name.strip() for name in raw.split(",") if name.strip()]


def interface_address(names: Sequence[str]) -> str:
    """The IPv4 address of the first of ``names`` this host has; ``AddressError`` naming them and the host's
    interfaces when it has none of them."""
    have = interfaces()
    for name in names:
        if name in have:
            return have[name][0]
    listed = ", ".join(f"{n} ({a})" for n, (a, _, _) in sorted(have.items())) or "none with an IPv4 address"
    raise AddressError(f"host {socket.gethostname()} has none of the network interfaces named by "
                       f"{NETWORK_INTERFACE_ENV} ({', '.join(names)}); its interfaces: {listed}")


def route_towards(target: str) -> str | None:
    """The local address the kernel would use to reach ``target`` (a host name or IP); None when it does not
    resolve or has no route. No packet is sent (a UDP ``connect`` only picks the route)."""
    try:
        ip = socket.gethostbyname(target)
    except OSError:
        return None
    if is_loopback(ip):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((ip, 9))
        return str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()


def non_loopback_address() -> str:
    """This host's address for peers when there is no meeting point to route towards: the host name's address if
    it is not loopback, else the first interface that is up and not loopback, else 127.0.0.1."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
        if not is_loopback(ip):
            return ip
    except OSError:
        pass
    try:
        found = interfaces()
    except OSError:
        found = {}
    for _, (address, up, loopback) in sorted(found.items()):
        if up and not loopback and not is_loopback(address):
            return address
    return "127.0.0.1"


def listen_address(towards: str | None = None, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """``(address to bind, address to publish)`` for this rank's listener, by the precedence of the module
    docstring; ``towards`` is the host of the job's meeting point (rendezvous or driver service), if known."""
    env = os.environ if environ is None else environ
    override = env.get(IFACE_ENV)
    if override:
        return override, override
    names = named_interfaces(env)
    if names:
        address = interface_address(names)
        return address, address
    if towards:
        address = route_towards(towards)
        if address is not None:
            return address, address
    return "0.0.0.0", non_loopback_address()


def meeting_host(rendezvous: Any = None, job: Any = None) -> str | None:
    """The host this rank meets its job through: the rendezvous service's (``rendezvous.host`` or
    ``job.rendezvous``), else the driver service's (``job.service_address``, the Spark runner's); None if none."""
    host = getattr(rendezvous, "host", None)
    if host:
        return str(host)
    for address in (getattr(job, "rendezvous", None), getattr(job, "service_address", None)):
        if address:
            found, sep, port = str(address).rpartition(":")
            if sep and port.isdigit():
                return found.strip("[]")
    return None


def machine_identity() -> str:
    """The real identity of this host, never overridden: host name, boot id and network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = ""
    return f"{socket.gethostname()}/{boot}/{netns}"


def host_identity() -> str:
    """Equal exactly for processes on one host (``machine_identity``), unless ``SPARK_HVD_HOST_ID`` is set."""
    return os.environ.get(HOST_ID_ENV) or machine_identity()


def check_reachable(published: Sequence[tuple[str, str]]) -> None:
    """Raise ``AddressError`` when a rank published a loopback address in a job whose ranks are on more than one
    machine. ``published[r]`` is rank r's ``(address, machine_identity())``."""
    machines = {machine for _, machine in published}
    if len(machines) < 2:
        return
    for rank, (address, machine) in enumerate(published):
        if is_loopback(address):
            host = machine.split("/", 1)[0]
            raise AddressError(
                f"rank {rank} on host {host} published the loopback address {address}, but the job's ranks are on "
                f"{len(machines)} hosts, which cannot reach it. Name the interface the hosts share: "
                f"{NETWORK_INTERFACE_ENV}=eth0 (a list is allowed; spark-hvd-run --network-interface; on Spark "
                f"spark.executorEnv.{NETWORK_INTERFACE_ENV}), or give the address with {IFACE_ENV}; check that "
                f"{host}'s host name does not resolve to a loopback address and that spark.driver.host / the "
                "rendezvous address is not one")


def device_group_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables that point NCCL and gloo at the named interfaces (``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``),
    for those the user did not set; empty when no interface is named."""
    env = os.environ if environ is None else environ
    names = named_interfaces(env)
    if not names:
        return {}
    out = {}
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if not env.get(var):
            out[var] = ",".join(names)
    return out


def apply_device_group_env() -> None:
    """Set ``device_group_env()`` in this process's environment (before a torch.distributed group is made)."""
    os.environ.update(device_group_env())
