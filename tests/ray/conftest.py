"""A local Ray cluster for the ``ray`` tests: started once per module on loopback with small resources (4 CPUs, an
80 MiB object store, no dashboard), stopped at the module's end. Tests that need Ray are skipped where it is not
installed; the test modules are pickled by value, so Ray's workers need not import them."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile

import pytest
from helpers.ray_start import start_ray

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves this machine
# Ray's node address is loopback (it otherwise replaces 127.0.0.1 by the host's routed address), read when ray is
# first imported; the workers inherit it
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray 2.60 authenticates its own connections with a token it otherwise writes to ~/.ray/auth_token: one per run
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


@pytest.fixture(scope="module")
def ray_cluster(request):
    """``ray`` itself, connected to a fresh local cluster for this module (its temporary directory, logs
    included, at ``ray.spark_hvd_temp_dir``)."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'spark_hvd[ray]')")
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[request.module.__name__])
    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="shvd-ray-")  # the session's logs and sockets, removed at the end

    def start(attempt_dir: str) -> None:
        ray.init(num_cpus=4, num_gpus=0, object_store_memory=80 * 1024**2, include_dashboard=False,
                 _node_ip_address="127.0.0.1", _temp_dir=attempt_dir, log_to_driver=True, configure_logging=False)

    def stop() -> None:
        ray.shutdown()

    ray.spark_hvd_temp_dir = start_ray(start, stop, temp_dir)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)

