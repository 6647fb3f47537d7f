"""Where ``spark-hvd-run`` places ranks: ``-H host1:2,host2:2`` or a ``--hostfile``, in host order.

A hostfile has one host per line, as Horovod and Open MPI write them: ``host slots=N`` (``host:N`` and a bare
``host``, one slot, are accepted too); ``#`` starts a comment. Ranks fill the first host's slots, then the next
host's, and so on; ``-np`` defaults to the sum of the slots and may not exceed it.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from spark_hvd.core.transport.addresses import interfaces, is_loopback

_SLOTS = re.compile(r"^slots\s*=\s*(\d+)$")


@dataclass(frozen=True)
class Placement:
    """One rank's place: its host, its local rank and size there, and the host's index (cross rank)."""

    rank: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``"host1:2,host2"`` -> ``[("host1", 2), ("host2", 1)]``; ``ValueError`` naming the bad entry."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, slots = item.rpartition(":") if item.count(":") == 1 else ("", "", item)
        if not sep:
            host, slots = item, "1"
        if not host or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H entry {item!r} is not of the form host:slots (slots a positive integer)")
        hosts.append((host, int(slots)))
    if not hosts:
        raise ValueError("-H names no host")
    return _merge(hosts, "-H")


def parse_hostfile(text: str, path: str = "hostfile") -> list[tuple[str, int]]:
    """The ``(host, slots)`` lines of a hostfile (``host slots=N``, ``host:N`` or ``host``)."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        host, slots = words[0], 1
        if ":" in host and len(words) == 1:
            host, _, count = host.rpartition(":")
            if not count.isdigit():
                raise ValueError(f"{path}:{number}: {raw.strip()!r}: slots after ':' must be a positive integer")
            slots = int(count)
        for word in words[1:]:
            found = _SLOTS.match(word)
            if found is None:
                if word.startswith("max_slots="):
                    continue
                raise ValueError(f"{path}:{number}: {raw.strip()!r}: expected 'host slots=N'")
            slots = int(found.group(1))
        if slots < 1:
            raise ValueError(f"{path}:{number}: {raw.strip()!r}: slots must be at least 1")
        hosts.append((host, slots))
    if not hosts:
        raise ValueError(f"{path} names no host")
    return _merge(hosts, path)


def _merge(hosts: Sequence[tuple[str, int]], where: str) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    for host, _ in hosts:
        if host in seen:
            raise ValueError(f"{where}: host {host!r} is listed twice; give it once with all its slots")
        seen[host] = 1
    return list(hosts)


def place(hosts: Sequence[tuple[str, int]], np: int | None = None) -> list[Placement]:
    """Ranks ``0..np-1`` placed in host order (the first host's slots first). ``np`` defaults to all slots."""
    total = sum(slots for _, slots in hosts)
    np = total if np is None else np
    if np < 1:
        raise ValueError(f"-np must be >= 1, got {np}")
    if np > total:
        listed = ", ".join(f"{h}:{s}" for h, s in hosts)
        raise ValueError(f"-np {np} is more than the {total} slot(s) of the hosts ({listed})")
    used: list[tuple[str, int]] = []
    left = np
    for host, slots in hosts:
        if left == 0:
            break
        take = min(slots, left)
        used.append((host, take))
        left -= take
    placements = []
    for cross_rank, (host, count) in enumerate(used):
        for local_rank in range(count):
            placements.append(Placement(len(placements), host, local_rank, count, cross_rank, len(used)))
    return placements


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (``localhost``, this host name, or an address of one of its
    interfaces): its ranks are started directly, without ssh."""
    if host in ("localhost", socket.gethostname()) or is_loopback(host):
        return True
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return False
    if is_loopback(ip):
        return True
    try:
        mine = {address for address, _, _ in interfaces().values()}
    except OSError:
        return False
    return ip in mine
