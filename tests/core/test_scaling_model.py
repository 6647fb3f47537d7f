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


@pytest.fixture(scope="module")
def re_fit():
    sys.path.insert(0, str(SCRIPT.parent))
    import scaling_measure
    import scaling_predict

    return scaling_measure, scaling_predict


def test_the_joint_fit_recovers_every_algorithms_costs(re_fit):
    measure, _ = re_fit
    c, f = 70e-6, 100e-6
    alpha = {"ring": 40e-6, "rd": 55e-6, "hd": 60e-6}
    beta = {"ring": 0.6e-9, "rd": 0.55e-9, "hd": 0.65e-9}
    records = []
    for name, _, _, ns in measure.CONFIGS:
        for ranks in ns:
            for nbytes in measure.SIZES:
                fam, steps, factor = measure.shape(name, ranks, nbytes)
                if name == "hier":
                    t = 200e-6 + 0.7e-9 * nbytes
                elif name == "bare":
                    t = 30e-6 + alpha["ring"] * steps + beta["ring"] * factor * nbytes
                else:
                    t = c + f * measure.fast_steps(ranks, nbytes) + alpha[fam] * steps + beta[fam] * factor * nbytes
                records.append({"config": name, "ranks": ranks, "nbytes": nbytes, "mode": "steady",
                                "time_s": [t, t * 1.01, t * 0.99], "cpu_s": [t]})
    got = measure.fit(records)
    api = got["api"]
    assert api["c_s"] == pytest.approx(c, rel=1e-6) and api["fast_round_step_s"] == pytest.approx(f, rel=1e-6)
    for fam in measure.FAMILIES:
        assert api[fam]["alpha_s"] == pytest.approx(alpha[fam], rel=1e-6)
        assert api[fam]["beta_s_per_byte"] == pytest.approx(beta[fam], rel=1e-6)
    assert api["residuals"]["max_abs"] < 1e-6
    assert got["bare_ring"]["alpha_s"] == pytest.approx(alpha["ring"], rel=1e-6)
    assert got["hier"]["8"]["beta_s_per_byte"] == pytest.approx(0.7e-9, rel=1e-6)


def test_resnet101_and_the_engine_simulation(re_fit):
    _, predict = re_fit
    blocks = predict.resnet_blocks()
    assert sum(p for _, p, _ in blocks) == 44_549_160  # torchvision's resnet101
    costs = predict.Costs(70e-6, 100e-6, {"ring": 40e-6, "rd": 55e-6, "hd": 60e-6},
                          {"ring": 0.6e-9, "rd": 0.55e-9, "hd": 0.65e-9})
    for hosts in (2, 16, 128):
        cl = predict.Cluster(hosts)
        exposed, groups = predict.simulate(cl, costs)
        assert sum(groups) == pytest.approx(4 * 44_549_160) and max(groups) <= cl.fusion and exposed >= 0
        eff = predict.efficiency(cl, costs)
        assert predict.efficiency(cl, costs, overlap=False) <= eff <= predict.bound_efficiency(cl) + 1e-12
    # at 128 hosts the ring's 254 steps cost more than halving-doubling's 14
    ring = predict.group_s(16 << 20, predict.Cluster(128), costs)
    assert predict.group_s(16 << 20, predict.Cluster(128, hd_bytes=1), costs) < ring


def test_predict_runs_from_the_committed_measurement():
    out = subprocess.run([sys.executable, str(SCRIPT), "--predict"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert "CPU-time fit" in out and "| engine defaults, CPU fit, overlap |" in out and "target >= 90%" in out
