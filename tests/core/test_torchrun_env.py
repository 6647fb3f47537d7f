"""torchrun's contract in a rank (``spark_hvd.core.torchrun``): the variables from a ``JobEnv``, the GPU policy,
and ``env://`` over the job's authenticated KV store: two ranks (threads) meet through it; a client without the
secret is refused; outside a job torch's own handler answers; the import hook installs the handler."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
from helpers.net import wait_until

from spark_hvd.core import torchrun
from spark_hvd.core.errors import AuthenticationError, PeerFailureError
from spark_hvd.core.jobenv import JobEnv
from spark_hvd.core.transport.wire import make_secret


def test_torchrun_variables_follow_the_job():
    job = JobEnv(rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2, job_id="j1", attempt=2)
    env = torchrun.torchrun_env(job, "10.0.0.5", 29500)
    assert env == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                   "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default",
                   "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "j1",
                   "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "0"}
    assert set(env) == set(torchrun.TORCHRUN_VARS)


def test_spark_gpus_become_the_visible_devices_in_local_rank_order(monkeypatch):
    monkeypatch.setattr(torchrun, "_cuda_visible", None)
    job = JobEnv(rank=1, size=2, local_rank=1, local_size=2, gpu="3")
    pinned, env = torchrun.pin_visible_devices(job, ["5", "3"])
    assert env == {"CUDA_VISIBLE_DEVICES": "5,3"} and pinned.gpu == "1"  # cuda:LOCAL_RANK is Spark's GPU 3
    assert torchrun.pin_visible_devices(job, ["5", None]) == (job, {})  # not every local rank has one: left alone
    assert torchrun.visible_devices([]) is None


def _job_env(monkeypatch, address: str, secret: bytes, rank: int = 0) -> JobEnv:
    job = JobEnv(rank=rank, size=2, job_id="jt", secret=secret, rendezvous=address)
    for key, value in job.to_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(torchrun.STORE_ENV, raising=False)
    return job


def test_env_rendezvous_meets_over_the_job_store(kv_server, monkeypatch):
    server, address, secret = kv_server
    _job_env(monkeypatch, address, secret)
    got: dict[int, bytes] = {}
    stores = {}
    for r in (0, 1):  # the env:// handler with the rank in the URL, as init_process_group(rank=) gives it
        torchrun._generations.clear()  # each rank is a process of its own: its first env:// group
        store, got_rank, world = next(torchrun.env_rendezvous(f"env://?rank={r}&world_size=2",
                                                              timeout=timedelta(seconds=10)))
        assert type(store).__name__ == "KVTorchStore" and (got_rank, world) == (r, 2)
        stores[r] = store

    def rank(r: int) -> None:
        stores[r].set(f"from{r}", f"hello {r}")
        got[r] = stores[r].get(f"from{1 - r}")
        stores[r].close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {0: b"hello 1", 1: b"hello 0"}
    assert server.rejected == 0


def test_env_rendezvous_refuses_a_client_without_the_secret(kv_server, monkeypatch):
    server, address, secret = kv_server
    _job_env(monkeypatch, address, make_secret())  # this "rank" holds another secret
    store, _, _ = next(torchrun.env_rendezvous("env://", timeout=timedelta(seconds=2)))
    with pytest.raises((AuthenticationError, PeerFailureError)):
        store.set("k", b"v")
    assert wait_until(lambda: server.rejected >= 1)  # the server logged and dropped it


def test_outside_a_job_or_with_tcp_torch_answers(monkeypatch):
    import torch.distributed  # noqa: F401

    torchrun.install()
    assert sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers["env"] is torchrun.env_rendezvous
    for key in ("SPARK_HVD_RANK", "SPARK_HVD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(torchrun.master_address("127.0.0.1:1")[1]))
    store, rank, world = next(torchrun.env_rendezvous("env://?rank=0&world_size=1", timeout=timedelta(seconds=5)))
    assert type(store).__name__ == "TCPStore" and (rank, world) == (0, 1)
    monkeypatch.setenv(torchrun.STORE_ENV, "sometimes")
    with pytest.raises(ValueError, match="SPARK_HVD_TORCH_STORE"):
        next(torchrun.env_rendezvous("env://"))


def test_the_import_hook_installs_the_handler_when_torch_distributed_loads():
    code = ("import sys; from spark_hvd.core import torchrun; torchrun.install(); "
            "assert 'torch' not in sys.modules; import torch.distributed as dist; "
            "r = sys.modules['torch.distributed.rendezvous']; assert r._rendezvous_handlers['env'] is "
            "torchrun.env_rendezvous; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
