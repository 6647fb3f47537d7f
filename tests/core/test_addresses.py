"""Which address a rank publishes (``spark_hvd.core.transport.addresses``) and the loopback check of a multi-host
job."""

from __future__ import annotations

import json
import os
import socket

import pytest

from spark_hvd.core.backends.ring import RingBackend
from spark_hvd.core.jobenv import JobEnv
from spark_hvd.core.transport import addresses
from spark_hvd.core.transport.addresses import (
    AddressError,
    check_reachable,
    device_group_env,
    listen_address,
    meeting_host,
)
from spark_hvd.core.transport.rendezvous import KVRendezvous, StaticRendezvous
from spark_hvd.core.transport.wire import make_secret


def _non_loopback() -> str | None:
    for address, up, loopback in addresses.interfaces().values():
        if up and not loopback:
            return address
    return None


def test_interfaces_lists_loopback():
    found = addresses.interfaces()
    assert found["lo"] == ("127.0.0.1", True, True)


def test_override_wins():
    assert listen_address("127.0.0.1", {"SPARK_HVD_IFACE_ADDR": "10.1.2.3",
                                        "SPARK_HVD_NETWORK_INTERFACE": "lo"}) == ("10.1.2.3", "10.1.2.3")


def test_named_interface_first_present_one_and_horovod_alias():
    assert listen_address(None, {"SPARK_HVD_NETWORK_INTERFACE": "nosuch0, lo"}) == ("127.0.0.1", "127.0.0.1")
    assert listen_address(None, {"HOROVOD_GLOO_IFACE": "lo"}) == ("127.0.0.1", "127.0.0.1")


def test_missing_interface_names_host_and_interfaces():
    with pytest.raises(AddressError) as err:
        listen_address(None, {"SPARK_HVD_NETWORK_INTERFACE": "nosuch0,nosuch1"})
    text = str(err.value)
    assert socket.gethostname() in text and "nosuch0, nosuch1" in text and "lo (127.0.0.1)" in text


def test_routes_towards_meeting_point():
    assert listen_address("127.0.0.1", {}) == ("127.0.0.1", "127.0.0.1")
    assert listen_address("localhost", {}) == ("127.0.0.1", "127.0.0.1")
    other = _non_loopback()
    if other is None:
        pytest.skip("this host has no non-loopback IPv4 interface")
    assert listen_address(other, {}) == (other, other)


def test_without_meeting_point_never_loopback_when_host_has_another_address():
    other = _non_loopback()
    if other is None:
        pytest.skip("this host has no non-loopback IPv4 interface")
    bind, publish = listen_address(None, {})
    assert bind == "0.0.0.0"
    assert not addresses.is_loopback(publish)
    # an unresolvable meeting point falls back the same way
    assert not addresses.is_loopback(listen_address("no-such-host.invalid", {})[1])


def test_meeting_host_from_rendezvous_then_driver_service():
    secret = make_secret()
    assert meeting_host(KVRendezvous("198.18.0.7:4000", secret)) == "198.18.0.7"
    job = JobEnv(rank=0, size=2, service_address="driver.example:1234")
    assert meeting_host(None, job) == "driver.example"
    job = JobEnv(rank=0, size=2, rendezvous="[::1]:99", service_address="driver.example:1234")
    assert meeting_host(None, job) == "::1"
    assert meeting_host(StaticRendezvous([b""]), None) is None


def test_check_reachable():
    check_reachable([("127.0.0.1", "a/1/1"), ("127.0.0.1", "a/1/1")])  # one machine: loopback is fine
    check_reachable([("198.18.0.1", "a/1/1"), ("198.18.0.2", "b/2/2")])
    with pytest.raises(AddressError) as err:
        check_reachable([("198.18.0.1", "a/1/1"), ("127.0.1.1", "hostb/2/2")])
    text = str(err.value)
    assert "rank 1 on host hostb" in text and "127.0.1.1" in text and "SPARK_HVD_NETWORK_INTERFACE" in text


def test_host_identity_includes_network_namespace(monkeypatch):
    monkeypatch.delenv("SPARK_HVD_HOST_ID", raising=False)
    ident = addresses.host_identity()
    assert ident.startswith(socket.gethostname() + "/")
    assert ident.endswith("/" + str(os.stat("/proc/self/ns/net").st_ino))
    monkeypatch.setenv("SPARK_HVD_HOST_ID", "fake")
    assert addresses.host_identity() == "fake"
    assert addresses.machine_identity() == ident


def test_device_group_env():
    assert device_group_env({}) == {}
    assert device_group_env({"SPARK_HVD_NETWORK_INTERFACE": "eth1,eth2"}) == {
        "NCCL_SOCKET_IFNAME": "eth1,eth2", "GLOO_SOCKET_IFNAME": "eth1,eth2"}
    assert device_group_env({"SPARK_HVD_NETWORK_INTERFACE": "eth1", "NCCL_SOCKET_IFNAME": "ib0"}) == {
        "GLOO_SOCKET_IFNAME": "eth1"}


def test_ring_refuses_loopback_peer_on_another_machine(monkeypatch):
    """A rank that publishes loopback (its interface named: lo) while a peer is on another machine: an error
    naming the rank and its host at once, not a connect timeout."""
    monkeypatch.delenv("SPARK_HVD_IFACE_ADDR", raising=False)

    def exchange(rank: int, size: int, value: bytes) -> list[bytes]:
        peer = dict(json.loads(value), host="198.18.0.2", port=9, machine="hostb/other-boot/1")
        return [value, json.dumps(peer).encode()]

    monkeypatch.setenv("SPARK_HVD_NETWORK_INTERFACE", "lo")
    expected = f"rank 0 on host {socket.gethostname()} published the loopback address 127.0.0.1"
    with pytest.raises(AddressError, match=expected):
        RingBackend(0, 2, StaticRendezvous(exchange), make_secret(), job_id="t-loop")


def test_torchrun_master_address_follows_the_same_policy(monkeypatch):
    from spark_hvd.core import torchrun

    monkeypatch.delenv("SPARK_HVD_IFACE_ADDR", raising=False)
    monkeypatch.setenv("SPARK_HVD_NETWORK_INTERFACE", "lo")
    assert torchrun.master_address("198.18.0.1:5000")[0] == "127.0.0.1"  # the named interface wins over the route
    monkeypatch.delenv("SPARK_HVD_NETWORK_INTERFACE")
    other = _non_loopback()
    if other is not None:
        assert torchrun.master_address(f"{other}:5000")[0] == other
