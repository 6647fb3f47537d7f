"""benchmarks/scaling_model.py runs, fits alpha-beta, and its efficiencies obey basic sanity."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scaling_model.py"


@pytest.fixture(scope="module")
def sm():
    spec = importlib.util.spec_from_file_location("scaling_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scaling_model"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_fit_recovers_alpha_and_beta(sm):
    alpha, beta = 50e-6, 1.5e-9
    points = [(n, 2 * alpha + n * beta) for n in (4096, 1 << 20, 16 << 20, 64 << 20)]
    got_alpha, got_beta = sm.fit_alpha_beta(points)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_beta == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError, match="at least two"):
        sm.fit_alpha_beta(points[:1])


@pytest.mark.parametrize("overlap", [False, True])
def test_efficiency_is_a_fraction_that_falls_with_hosts_and_rises_with_bandwidth(sm, overlap):
    ring = sm.Ring(*sm.fit_alpha_beta(sm.DEFAULT_POINTS))
    fast_host = sm.Ring(30e-6, 0.05e-9)
    for model in sm.MODELS:
        for r in (ring, fast_host):
            for bound in (False, True):
                by_net = []
                for bandwidth in sm.NETWORKS.values():
                    effs = [sm.efficiency(model, n, bandwidth, r, overlap, bound) for n in sm.HOSTS]
                    assert all(0 < e <= 1 for e in effs), effs
                    assert all(a >= b for a, b in zip(effs, effs[1:], strict=False)), (model.name, effs)
                    by_net.append(effs)
                for slower, faster in zip(by_net, by_net[1:], strict=False):
                    assert all(f >= s for s, f in zip(slower, faster, strict=True)), (model.name, by_net)
            # the theoretical bound is never beaten, and the model's costs only add to it
            for bandwidth in sm.NETWORKS.values():
                for n in sm.HOSTS:
                    assert sm.efficiency(model, n, bandwidth, r, overlap) <= sm.efficiency(
                        model, n, bandwidth, r, overlap, bound=True) + 1e-12
    assert sm.efficiency(sm.MODELS[0], 1, 1e9, ring, overlap) == 1.0  # one host: nothing to communicate


def test_script_prints_the_tables():
    out = subprocess.run([sys.executable, str(SCRIPT), "--wire-latency-us", "40"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "alpha =" in out and "| ResNet-101 | 25GbE |" in out and "| BERT-base | 100GbE |" in out
    assert "90% at 512 GPUs" in out
