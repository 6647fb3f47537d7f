"""The ring backend's plans (``spark_hvd.core.backends.ring_plans``): which one a topology gets, and what it says."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from spark_hvd.core.backends import ring_plans
from spark_hvd.core.backends.ring_plans import Hierarchical, ShmHost, Solo, TcpRing


def test_a_plan_is_chosen_from_the_hosts_once():
    assert ring_plans.choose(0, 1, ["a"], True) == Solo()
    assert ring_plans.choose(1, 3, ["a", "b", "c"], True) == TcpRing()  # one rank per host
    assert ring_plans.choose(1, 2, ["a", "a"], False) == TcpRing()  # shared memory off on some rank
    assert ring_plans.choose(2, 3, ["a", "a", "a"], True) == ShmHost(local_ranks=(0, 1, 2))
    # hosts in order of their first rank; leaders are local rank 0; ring i joins local rank i of every host
    assert ring_plans.choose(1, 4, ["b", "a", "b", "a"], True) == Hierarchical(
        local_ranks=(1, 3), leaders=(0, 1), cross_rings=((0, 1), (2, 3)))
    # uneven hosts: no split rings; a rank alone on its host still plans the hierarchy
    assert ring_plans.choose(2, 3, ["a", "a", "b"], True) == Hierarchical(local_ranks=(2,), leaders=(0, 2))


def test_plans_say_what_the_backend_asks_them():
    assert [p.name for p in (Solo(), TcpRing(), ShmHost(), Hierarchical())] == ["none", "tcp", "shm", "hier"]
    assert TcpRing().agrees_in_band(2) and not TcpRing().agrees_in_band(3) and not ShmHost().agrees_in_band(2)
    assert ShmHost.fuses_in_place and Solo.fuses_in_place and not TcpRing.fuses_in_place
    # a reducescatter: the reduce-scatter half over TCP and on one host's slots; an allreduce and a slice across both
    assert Hierarchical.scatters_by_allreduce
    assert not ShmHost.scatters_by_allreduce and not TcpRing.scatters_by_allreduce
    job = SimpleNamespace(size=6, cross_size=3)  # what the TCP leg runs among (autotune's halving-doubling)
    assert [p.tcp_ring_size(job) for p in (Solo(), TcpRing(), ShmHost(), Hierarchical())] == [0, 6, 0, 3]


def test_the_tcp_plans_pack_a_fused_allreduce_into_one_array():
    seen = []

    class Ring(TcpRing):
        def allreduce(self, backend, flat, op, bfloat16, operation):
            seen.append(flat.copy())
            flat *= 2

    a, b = np.arange(3, dtype=np.float32), np.arange(2, dtype=np.float32)
    # where the compiled loop does not reduce them where they lie (``RingBackend._tcp_allreduce_fused``)
    backend = SimpleNamespace(_tcp_allreduce_fused=lambda *args: False)
    Ring().allreduce_fused(backend, [a, b], None, False, "allreduce")
    np.testing.assert_array_equal(seen[0], [0, 1, 2, 0, 1])
    np.testing.assert_array_equal(a, [0, 2, 4])
    np.testing.assert_array_equal(b, [0, 2])
