"""The torch.distributed rendezvous over spark_hvd's authenticated KV (``spark_hvd.core.backends.torch_store``).

Store semantics with threads as ranks, the secret check on both services that carry it (the launcher's
``KVStoreServer`` and the Spark driver service), and a gloo process group initialised on it by two spawned ranks
with ``torch.distributed.TCPStore`` made to raise. The device path and ``SPARK_HVD_BACKEND=torch`` run on it in
``test_device_path.py`` (also with TCPStore raising).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import numpy as np
import pytest
from helpers.net import wait_until
from helpers.ranks import run_ranks

from spark_hvd.core.errors import AuthenticationError, PeerFailureError
from spark_hvd.core.jobenv import JobEnv
from spark_hvd.core.transport.rendezvous import KVClient
from spark_hvd.core.transport.wire import make_secret
from spark_hvd.runner.service import DriverService

pytest.importorskip("torch")


def _open_pair(name: str = "g", timeout_s: float = 10.0, **where):
    """Rank 0's and rank 1's store of one group, opened in turn: rank 1's exchange hands it what rank 0 published."""
    from spark_hvd.core.backends.torch_store import open_store

    published: list[bytes] = []

    def exchange(mine: bytes) -> list[bytes]:
        if mine:
            published.append(mine)
        return [published[0]]

    return tuple(open_store(name, rank, 2, timedelta(seconds=timeout_s), exchange=exchange, **where)
                 for rank in (0, 1))


def _launched(address: str, secret: bytes, name: str = "g"):
    return _open_pair(name, secret=secret, job=None, job_id="j", kv_address=address)


def test_store_operations_between_two_ranks(kv_server):
    import torch.distributed as dist

    _, address, secret = kv_server
    a, b = _launched(address, secret)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(b.get("late")))  # get blocks until the key is set
    reader.start()
    a.set("late", b"value")
    reader.join(30)
    assert got == [b"value"]
    assert [a.add("n", 3), b.add("n", -1), a.add("n", 0)] == [3, 2, 2] and b.get("n") == b"2"
    assert a.compare_set("c", b"", b"first") == b"first"  # unset and expected empty: set
    assert b.compare_set("c", b"other", b"x") == b"first"  # mismatch: unchanged, the current value
    assert b.compare_set("c", b"first", b"second") == b"second" and a.get("c") == b"second"
    assert a.compare_set("unset", b"exp", b"x") == b"exp" and not a.check(["unset"])
    assert a.check(["late", "n"]) and not a.check(["late", "none"])
    assert a.num_keys() == 3
    assert a.delete_key("c") and not b.delete_key("c") and b.num_keys() == 2
    with pytest.raises(dist.DistStoreError, match=r"\['never'\] not set within 0s"):
        a.wait(["never"], timedelta(seconds=0.2))
    a.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match="'never' not set"):
        a.get("never")
    # torch's PrefixStore (as init_process_group wraps it) forwards to the Python store
    prefixed = dist.PrefixStore("pg", b)
    prefixed.set("k", b"v")
    assert prefixed.get("k") == b"v" and prefixed.add("m", 5) == 5 and prefixed.check(["k"])
    prefixed.wait(["k"], timedelta(seconds=1))
    for store in (a, b):
        store.close()


def test_two_groups_never_share_keys(kv_server):
    _, address, secret = kv_server
    first, again, other = _launched(address, secret), _launched(address, secret), _launched(address, secret, "h")
    first[0].set("k", b"1")
    assert [p.prefix for p in first] == ["j/torch/0/g/1/"] * 2 and [p.prefix for p in again] == ["j/torch/0/g/2/"] * 2
    assert [p.prefix for p in other] == ["j/torch/0/h/1/"] * 2
    assert first[1].check(["k"]) and not again[1].check(["k"]) and not other[1].check(["k"])
    for store in (*first, *again, *other):
        store.close()


def test_a_client_without_the_secret_can_neither_read_nor_write(kv_server):
    server, address, secret = kv_server
    honest, _ = _launched(address, secret)
    honest.set("k", b"secret value")
    stranger = make_secret()
    for attempt in (lambda: KVClient(address, stranger, timeout_s=5), lambda: _launched(address, stranger)):
        with pytest.raises((AuthenticationError, PeerFailureError)):
            attempt()
    assert honest.get("k") == b"secret value" and wait_until(lambda: server.rejected >= 2)
    honest.close()


def test_driver_service_serves_the_store_to_its_job_only():
    secret = make_secret()
    service = DriverService(secret, 2, job_id="jd", verbose=0, bind_host="127.0.0.1")
    host, port = service.start()
    try:
        job = JobEnv(rank=0, size=2, job_id="jd", secret=secret, service_address=f"{host}:{port}")
        stores = _open_pair(secret=None, job=job)
        assert stores[0].address == f"{host}:{port}" and stores[1].prefix == "jd/torch/0/g/1/"
        stores[0].set("k", b"v")
        assert stores[1].get("k") == b"v" and stores[1].add("n", 2) == 2
        with pytest.raises((AuthenticationError, PeerFailureError)):
            KVClient(f"{host}:{port}", make_secret(), timeout_s=5, hello=("hello", "jd", 0, "kv"))
        assert wait_until(lambda: service.rejected >= 1)
        assert not service.failures and not service.started  # no rank was counted, none lost
        for store in stores:
            store.close()
    finally:
        service.stop()


def _gloo_on_the_store() -> list[float]:
    import torch
    import torch.distributed as dist

    def no_tcpstore(*args, **kwargs):
        raise AssertionError("a torch.distributed.TCPStore was created")

    dist.TCPStore = no_tcpstore
    from spark_hvd.core.backends.torch_store import KVTorchStore, open_store
    from spark_hvd.core.transport.rendezvous import KVClient

    job = JobEnv.from_env()

    def exchange(mine: bytes) -> list[bytes]:  # rank 0's bytes, through the driver service's KV as well
        kv = KVClient(job.service_address, job.secret, 60, hello=("hello", job.job_id, job.rank, "kv"))
        try:
            if job.rank == 0:
                kv.set("test/published", mine)
            return [kv.get("test/published", 60)]
        finally:
            kv.close()

    store = open_store("test", job.rank, job.size, timedelta(seconds=60), job=job, secret=None, exchange=exchange)
    assert isinstance(store, KVTorchStore) and store.address == job.service_address
    dist.init_process_group("gloo", store=store, rank=job.rank, world_size=job.size, timeout=timedelta(seconds=60))
    try:
        t = torch.arange(4, dtype=torch.float64) * (job.rank + 1)
        dist.all_reduce(t)
        pair = dist.new_group([0, 1])
        u = torch.full((2,), float(job.rank + 1))
        dist.all_reduce(u, group=pair)
        dist.barrier()
        return t.tolist() + u.tolist()
    finally:
        dist.destroy_process_group()
        store.close()


@pytest.mark.slow
def test_gloo_process_group_on_the_store_without_tcpstore():
    # the ranks find the store through the Spark driver service (no launcher KV), as under the Spark runner
    secret = make_secret()
    service = DriverService(secret, 2, job_id="jg", verbose=0, bind_host="127.0.0.1")
    host, port = service.start()
    env = {"SPARK_HVD_RENDEZVOUS": "", "SPARK_HVD_DRIVER_SERVICE": f"{host}:{port}", "SPARK_HVD_SECRET": secret.hex()}
    try:
        results = run_ranks(_gloo_on_the_store, 2, env=env, job_id="jg", timeout=120)
    finally:
        service.stop()
    expected = np.concatenate([np.arange(4) * 1 + np.arange(4) * 2, np.full(2, 3.0)])
    for result in results:
        np.testing.assert_array_equal(result, expected)


def test_without_a_job_service_rank_0_serves_an_authenticated_store():
    secret = make_secret()
    a, b = _open_pair(secret=secret, job=None, job_id="jf")
    try:
        assert a.address == b.address and a._server is not None and b._server is None
        a.set("k", b"v")
        assert b.get("k") == b"v"
        with pytest.raises((AuthenticationError, PeerFailureError)):
            KVClient(a.address, make_secret(), timeout_s=5)
    finally:
        b.close()
        a.close()
    # with no job secret either (mpirun): a fresh one travels with the address
    c, d = _open_pair(secret=None, job=None)
    try:
        c.set("k", b"w")
        assert d.get("k") == b"w" and c._secret == d._secret and len(c._secret) >= 16
    finally:
        d.close()
        c.close()
