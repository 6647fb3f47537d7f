"""The secret's way to a Ray actor (``spark_hvd.ray.secret``), without Ray: a claim gets the secret once, a second
presentation of the same claim gets nothing and is recorded, an unknown claim or a wrong bootstrap key gets nothing,
and what travels on the wire does not contain the secret. Also the rank order and GPU policy of
``spark_hvd.ray.placement``."""

from __future__ import annotations

import dataclasses
import socket
import threading

import pytest

from spark_hvd.core.errors import AuthenticationError, PeerFailureError
from spark_hvd.core.transport.wire import make_secret
from spark_hvd.ray.placement import gpu_assignment, rank_order
from spark_hvd.ray.secret import SecretClaimError, SecretHandout, fetch_secret


@pytest.fixture
def handout():
    secret = make_secret()
    service = SecretHandout(secret, "job1")
    yield service, secret
    service.close()


def test_a_claim_gets_the_secret_once_and_a_second_presentation_is_recorded(handout):
    service, secret = handout
    claim = service.claim("worker 0")
    assert secret.hex() not in repr(claim) and secret not in claim.bootstrap_key
    assert fetch_secret(claim, timeout_s=10) == secret
    assert service.claimed("worker 0")
    with pytest.raises(SecretClaimError, match="already used"):
        fetch_secret(claim, timeout_s=10)
    assert service.reused == ["worker 0"]


def test_an_unknown_claim_or_another_job_gets_nothing(handout):
    service, _ = handout
    claim = service.claim("worker 0")
    with pytest.raises(SecretClaimError, match="unknown claim"):
        fetch_secret(dataclasses.replace(claim, claim_id="0" * 32), timeout_s=10)
    with pytest.raises(SecretClaimError, match="unknown claim"):
        fetch_secret(dataclasses.replace(claim, job_id="job2"), timeout_s=10)
    assert service.unknown == 2 and not service.claimed("worker 0")


def test_a_wrong_bootstrap_key_is_refused_before_any_claim(handout):
    service, _ = handout
    claim = dataclasses.replace(service.claim("worker 0"), bootstrap_key=b"x" * 32)
    with pytest.raises((AuthenticationError, PeerFailureError)):
        fetch_secret(claim, timeout_s=10)
    assert not service.claimed("worker 0")


def test_the_secret_is_not_on_the_wire(handout):
    """A relay records both directions of a claim: the secret's bytes are in neither (sealed by the X25519 key)."""
    service, secret = handout
    listener = socket.create_server(("127.0.0.1", 0))
    recorded: list[bytes] = []

    def relay() -> None:
        conn, _ = listener.accept()
        upstream = socket.create_connection(service.address)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            while data := src.recv(65536):
                recorded.append(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=pump, args=(upstream, conn), daemon=True)
        back.start()
        pump(conn, upstream)
        back.join(10)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    claim = dataclasses.replace(service.claim("worker 0"), address=listener.getsockname()[:2])
    assert fetch_secret(claim, timeout_s=10) == secret
    thread.join(10)
    listener.close()
    wire = b"".join(recorded)
    assert len(wire) > 100 and secret not in wire and secret.hex().encode() not in wire


def test_closed_handout_serves_no_claim(handout):
    service, _ = handout
    claim = service.claim("worker 0")
    service.close()
    with pytest.raises((OSError, PeerFailureError, SecretClaimError)):
        fetch_secret(claim, timeout_s=2)
    with pytest.raises(SecretClaimError, match="closed"):
        service.claim("worker 1")


def test_ranks_are_numbered_node_by_node():
    assert rank_order(["a", "b", "a", "c", "b"]) == [0, 2, 1, 4, 3]
    assert rank_order(["n", "n"]) == [0, 1]


def test_gpus_of_a_node_are_visible_to_its_workers_in_local_rank_order():
    assert gpu_assignment(["a", "a", "b"], [["3"], ["1"], ["0"]]) == [("3,1", "0"), ("3,1", "1"), ("0", "0")]
    assert gpu_assignment(["a", "a"], [[], []]) == [(None, None), (None, None)]
    with pytest.raises(ValueError, match="same GPU"):
        gpu_assignment(["a", "a"], [["0"], ["0"]])


def test_importing_spark_hvd_ray_imports_no_ray_or_framework():
    import subprocess
    import sys

    code = ("import sys, spark_hvd.ray\n"
            "print(','.join(m for m in ('ray', 'torch', 'tensorflow', 'pyspark') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_constructor_checks_like_horovods():
    from spark_hvd.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=5, placement_group_timeout_s=5, nics={"lo"})
    assert (settings.timeout_s, settings.placement_group_timeout_s, settings.nics) == (5, 5, frozenset({"lo"}))
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(settings, num_workers=2, num_hosts=1)
    with pytest.raises(ValueError, match="min_workers"):
        RayExecutor(settings, max_workers=2)
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="min_workers <= max_workers"):
        RayExecutor(settings, min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="give num_workers"):
        RayExecutor(settings)
    assert RayExecutor(settings, num_hosts=2, num_workers_per_host=None).num_workers == 2  # Horovod's tests
    elastic = RayExecutor(settings, min_workers=1, cooldown_range=[3, 9], elastic_timeout=7).elastic
    assert (elastic.min_workers, elastic.max_workers, elastic.cooldown_s, elastic.elastic_timeout) == (1, 1 << 30, 3.0,
                                                                                                        7.0)
