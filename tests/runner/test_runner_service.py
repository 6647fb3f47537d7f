"""Driver service and barrier rendezvous without Spark: HMAC checks, forged frames dropped, topology."""

from __future__ import annotations

import logging
import socket
import threading

import pytest
from helpers.net import RecordingRelay, wait_until

from spark_hvd.core import errors as core_errors
from spark_hvd.core.errors import AuthenticationError
from spark_hvd.core.jobenv import topology
from spark_hvd.core.transport.rendezvous import KVRendezvous
from spark_hvd.core.transport.wire import FramedSocket, make_secret
from spark_hvd.runner import client as client_module
from spark_hvd.runner.barrier_task import assigned_gpu, task_gpus
from spark_hvd.runner.client import ServiceClient
from spark_hvd.runner.errors import RunnerError
from spark_hvd.runner.service import DriverService


def test_forged_frame_is_dropped_and_logged_and_genuine_client_works(caplog):
    secret = make_secret()
    service = DriverService(secret, 2, job_id="job1", verbose=0, bind_host="127.0.0.1")
    _, port = service.start()
    try:
        with caplog.at_level(logging.WARNING, logger="spark_hvd"):
            forged = FramedSocket(socket.create_connection(("127.0.0.1", port), timeout=10), make_secret(), "test")
            with pytest.raises(AuthenticationError):
                forged.send_object(("hello", "job1", 0, "rank"))
            forged.close()
            assert wait_until(lambda: service.rejected == 1)
        assert any("before authentication" in r.getMessage() for r in caplog.records)
        assert service.started == set()

        client = ServiceClient(f"127.0.0.1:{port}", secret, "job1", 1)
        client.send_event(2, 10, {"loss": 0.25})
        client.send_done()
        assert service.wait_finished(30.0, only_started=True)
        assert wait_until(lambda: 1 in service.finished)
        client.close()
        assert [(e.rank, e.epoch, e.step, e.metrics) for e in service.events] == [(1, 2, 10, {"loss": 0.25})]
        assert service.failures == []
    finally:
        service.stop()


def test_wrong_job_id_and_lost_connection():
    secret = make_secret()
    failures = []
    service = DriverService(secret, 2, job_id="job2", verbose=0, bind_host="127.0.0.1", on_failure=failures.append)
    _, port = service.start()
    try:
        other = ServiceClient(f"127.0.0.1:{port}", secret, "another-job", 0)
        lost = ServiceClient(f"127.0.0.1:{port}", secret, "job2", 1)
        assert wait_until(lambda: service.started == {1})
        lost.close()  # closes without "done": the rank counts as lost
        assert wait_until(lambda: bool(failures))
        assert failures[0].rank == 1 and failures[0].type_name == "ProcessLost"
        other.close()
    finally:
        service.stop()


class CollectiveTimeoutError(Exception):
    """Stands in for the core's (the service sees the type's name only)."""


def test_a_silent_rank_is_blamed_when_every_failure_is_a_consequence():
    """Ranks 0 and 1 time out on each other (consequences, as in a ring around a host whose link went down) while
    rank 2 neither finishes nor closes its connection: ``blame_silent`` makes rank 2, with its host, the cause."""
    secret = make_secret()
    service = DriverService(secret, 3, job_id="job5", verbose=0, bind_host="127.0.0.1")
    _, port = service.start()
    clients = [ServiceClient(f"127.0.0.1:{port}", secret, "job5", r) for r in range(3)]
    try:
        assert wait_until(lambda: service.started == {0, 1, 2})
        assert service.blame_silent() is None  # nothing failed yet
        clients[0].send_error(CollectiveTimeoutError("allreduce: rank 1 on host h2 sent nothing for 30s"))
        clients[1].send_error(CollectiveTimeoutError("allreduce: rank 2 on host h3 sent nothing for 30s"))
        assert wait_until(lambda: service.finished == {0, 1})
        assert service.silent() == [2]
        blamed = service.blame_silent()
        assert blamed is not None and service.root_failure() is blamed
        assert (blamed.rank, blamed.kind, blamed.type_name) == (2, "lost", "ProcessUnreachable")
        assert "rank 2's process on host 127.0.0.1 stopped answering" in blamed.message
    finally:
        for c in clients:
            c.close()
        service.stop()


def test_a_rank_that_stops_saying_it_is_alive_is_blamed_and_not_waited_for(monkeypatch):
    """Every rank's connection says ``("alive",)`` every ``ALIVE_EVERY_S``; rank 2's stops while its connection
    stays open (what the driver sees of a host whose link is cut), rank 1 waits for the answer of a slow handler:
    ``check_liveness`` blames rank 2 alone, with its host, as unreachable, and nobody waits for it any more."""
    monkeypatch.setattr(client_module, "ALIVE_EVERY_S", 0.05)
    secret = make_secret()
    failures: list = []
    release = threading.Event()
    service = DriverService(secret, 3, job_id="job9", verbose=0, bind_host="127.0.0.1", on_failure=failures.append,
                            handlers={"slow": lambda rank, payload: release.wait(30)})
    _, port = service.start()
    clients = [ServiceClient(f"127.0.0.1:{port}", secret, "job9", r) for r in range(3)]
    asking = threading.Thread(target=clients[1].request, args=("slow",), daemon=True)
    try:
        assert wait_until(lambda: service.started == {0, 1, 2})
        clients[2]._closed.set()  # its keep-alive thread stops; the connection stays open
        asking.start()
        threading.Event().wait(1.3)
        found = service.check_liveness(1.0)
        assert [f.rank for f in found] == [2] and failures == found
        assert (found[0].kind, found[0].type_name) == ("lost", "ProcessUnreachable")
        assert "rank 2's process on host 127.0.0.1 stopped answering" in found[0].message
        assert service.unreachable == {2} and 2 in service.finished
        release.set()
        asking.join(10)
        for c in clients[:2]:
            c.send_done()
        assert service.wait_finished(10.0, only_started=True)
        assert service.root_failure() is found[0]
    finally:
        release.set()
        for c in clients:
            c.close()
        service.stop()


def test_a_rank_that_raised_is_not_replaced_by_a_silent_one():
    secret = make_secret()
    service = DriverService(secret, 2, job_id="job6", verbose=0, bind_host="127.0.0.1")
    _, port = service.start()
    clients = [ServiceClient(f"127.0.0.1:{port}", secret, "job6", r) for r in range(2)]
    try:
        assert wait_until(lambda: service.started == {0, 1})
        clients[0].send_error(ValueError("a bug of fn"))
        assert wait_until(lambda: service.finished == {0})
        assert service.blame_silent() is None and service.root_failure().type_name == "ValueError"
    finally:
        for c in clients:
            c.close()
        service.stop()


def test_replayed_hello_does_not_mark_a_live_rank_lost():
    secret = make_secret()
    failures = []
    service = DriverService(secret, 1, job_id="job4", verbose=0, bind_host="127.0.0.1", on_failure=failures.append)
    _, port = service.start()
    try:
        # record a legitimate rank 0's connection bytes through a relay
        relay = RecordingRelay(("127.0.0.1", port))
        rank0 = ServiceClient(relay.address, secret, "job4", 0)
        assert wait_until(lambda: service.started == {0})
        # the recorded hello replayed on a new connection, then closed: refused, rank 0 is not reported lost
        replay = socket.create_connection(("127.0.0.1", port), timeout=10)
        replay.sendall(bytes(relay.recorded))
        assert wait_until(lambda: service.rejected == 1)
        replay.close()
        assert not wait_until(lambda: bool(failures), timeout_s=1.0)
        rank0.send_done()
        assert wait_until(lambda: 0 in service.finished)
        rank0.close()
        relay.close()
    finally:
        service.stop()


def test_helper_connection_carries_events_without_lifecycle():
    secret = make_secret()
    failures = []
    service = DriverService(secret, 1, job_id="job3", verbose=0, bind_host="127.0.0.1", on_failure=failures.append)
    _, port = service.start()
    try:
        helper = ServiceClient(f"127.0.0.1:{port}", secret, "job3", 0, role="aux")
        helper.send_event(0, 1, {"x": 1})
        assert wait_until(lambda: len(service.events) == 1)
        helper.close()  # a helper going away is not a failure, and does not count as the rank starting
        assert not wait_until(lambda: bool(failures) or bool(service.started), timeout_s=1.0)
    finally:
        service.stop()


def _exchange_all(port: int, secrets_by_rank: list[bytes], values: list[bytes], rounds: int = 1,
                  timeout_s: float = 30.0) -> list:
    """Each rank (a thread) meets the others ``rounds`` times in the driver service's KV table, as a barrier task
    does (``barrier_task.run_rank``): what each got, or the error it raised."""
    out: list = [None] * len(values)

    def body(rank: int) -> None:
        rdv = KVRendezvous(f"127.0.0.1:{port}", secrets_by_rank[rank], "jobx", timeout_s=timeout_s,
                           hello=("hello", "jobx", rank, "kv"))
        try:
            out[rank] = [rdv.exchange(rank, len(values), values[rank] + bytes([n])) for n in range(rounds)]
        except Exception as exc:  # collected for the assertions
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(values))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_barrier_tasks_rendezvous_in_the_driver_service():
    secret = make_secret()
    service = DriverService(secret, 3, job_id="jobx", verbose=0, bind_host="127.0.0.1")
    _, port = service.start()
    try:
        values = [b"alpha", b"\x00\x01binary", b""]
        out = _exchange_all(port, [secret] * 3, values, rounds=2)
        expected = [[v + bytes([n]) for v in values] for n in range(2)]  # round n meets round n, in rank order
        assert out == [expected] * 3
    finally:
        service.stop()


def test_barrier_rendezvous_refuses_another_secret():
    secret = make_secret()
    service = DriverService(secret, 2, job_id="jobx", verbose=0, bind_host="127.0.0.1")
    _, port = service.start()
    try:
        out = _exchange_all(port, [secret, make_secret()], [b"a", b"b"], timeout_s=0.5)
        assert isinstance(out[1], AuthenticationError)  # the handshake fails: its value never reaches the table
        assert isinstance(out[0], core_errors.CollectiveTimeoutError) and "rank(s) [1]" in str(out[0])
    finally:
        service.stop()


def test_topology_from_hosts():
    hosts = ["h1", "h2", "h1", "h2", "h3"]
    assert [topology(hosts, r) for r in range(5)] == [
        (0, 2, 0, 3), (0, 2, 1, 3), (1, 2, 0, 3), (1, 2, 1, 3), (0, 1, 2, 3)]


class _Resource:
    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses


class _Ctx:
    def __init__(self, resources: dict) -> None:
        self._resources = resources

    def resources(self) -> dict:
        return self._resources


def test_gpu_from_spark_resources_then_local_rank():
    assert assigned_gpu(_Ctx({"gpu": _Resource(["3", "5"])})) == "3"
    assert assigned_gpu(_Ctx({"gpu": _Resource([])})) is None
    assert assigned_gpu(_Ctx({})) is None
    hosts = ["h1", "h1", "h2"]
    assert task_gpus(hosts, ["3", "1", "0"], None) == ["3", "1", "0"]
    assert task_gpus(hosts, ["3", "1", "0"], True) == ["3", "1", "0"]
    assert task_gpus(hosts, ["3", "1", "0"], False) == [None, None, None]
    assert task_gpus(hosts, [None, None, None], None) == [None, None, None]
    assert task_gpus(hosts, [None, None, None], True) == ["0", "1", "0"]  # the local rank


def test_two_ranks_of_one_host_never_share_a_gpu():
    with pytest.raises(RunnerError, match="ranks 0 and 1 on host h1 were both given GPU 0"):
        task_gpus(["h1", "h1"], ["0", "0"], None)
    with pytest.raises(RunnerError, match="ranks 0 and 1 on host h1 were both given GPU 1"):
        task_gpus(["h1", "h1"], ["1", None], True)  # Spark's "1" and rank 1's local-rank fallback
    assert task_gpus(["h1", "h2"], ["0", "0"], None) == ["0", "0"]  # other hosts: other GPUs
