"""Fixtures of the multi-host tests: simulated hosts (``simhosts.SimHosts``), skipped with the reason where
network namespaces cannot be made; every test here is marked ``multihost`` so the suite's time on them is visible
(``pytest -m multihost``, ``--durations``)."""

from __future__ import annotations

import os

import pytest
import simhosts  # beside this conftest, whose folder pytest puts on the path
from standalone import Standalone


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.multihost)


@pytest.fixture(scope="session")
def simhosts_ready() -> None:
    """Skip (with the reason) where simulated hosts cannot be made; else sweep stale ones and arm teardown."""
    reason = simhosts.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    simhosts.sweep_stale()
    simhosts.install_teardown()


@pytest.fixture(scope="module")
def sim(simhosts_ready):
    """Three simulated hosts on 1 Gbit/s links: host 0 runs the launcher (or the driver), hosts 1 and 2 the ranks."""
    hosts = simhosts.SimHosts(3, rate="1gbit")
    try:
        yield hosts
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def standalone_cluster(simhosts_ready, tmp_path_factory):
    """Spark standalone on four simulated hosts (1 Gbit/s links): the master on host 0 (where the tests' drivers run
    too), a one-core worker on each of hosts 1-3 (``standalone.Standalone``)."""
    logs = tmp_path_factory.mktemp("standalone")
    sim = simhosts.SimHosts(4, rate="1gbit")
    spark = None
    try:
        spark = Standalone(sim, logs, workers=(1, 2, 3))
        yield spark
    finally:
        if spark is not None:
            spark.close()
        sim.close()
