"""A scaling model on paper: how spark_hvd's TCP ring would scale across 2-128 hosts, from measured costs.

The ring allreduce of ``G`` bytes over ``N`` hosts takes ``2(N-1)`` steps, each sending ``G/N`` bytes (reduce-scatter,
then allgather). With a per-message latency ``alpha`` and a per-byte cost ``beta`` (the alpha-beta model)::

    T_allreduce(N) = 2(N-1) * alpha  +  2(N-1)/N * G * beta

``alpha`` and ``beta`` of the implementation come from a least-squares fit (relative error) of measured N=2 times
(``--points``; the default is the quiet ``api-tcp`` row of benchmarks/RESULTS.md, session 4, over loopback on this
project's 2-core machine). On a real network a message also pays the wire's latency (``--wire-latency-us``), and a
byte costs ``max(1 / bandwidth, beta)``: the ring is pipelined (sub-chunks), so the host's work per byte (copy,
MAC, reduce) and the wire overlap, and the slower of the two sets the pace. The ring's theoretical bound is the same
formula with no latency and the wire alone: ``2(N-1)/N * G / bandwidth``.

A training step is ``step_s`` of computation (forward + backward, one third + two thirds) plus the exposed part of
the communication, which runs in ``rounds`` negotiation rounds per step (each round: one small negotiation
collective and one data collective, so ``2 rounds`` latency terms). Two cases bracket reality:

- no overlap: ``step = compute + T_comm`` (a pessimistic bound);
- overlap with backward (what DistributedOptimizer does: gradients are reduced while earlier layers' backward
  runs): ``step = compute + max(T_comm - backward, T_comm / rounds)``; the last round (the first layers'
  gradients, ready at the very end) can never overlap.

Scaling efficiency is ``compute / step`` (throughput per host relative to one host, which needs no communication).

The re-fit (docs/scaling.md) measures every algorithm the engine chooses through the public API at N = 2, 4, 8 and
fits alpha and beta per algorithm (``--measure``, benchmarks/scaling_measure.py, writes
benchmarks/scaling_measured.json), then predicts ResNet-101 on 2..128 hosts of 4 GPUs with the engine's fusion,
overlap with backward and algorithm choice simulated (``--predict``, benchmarks/scaling_predict.py)::

    .venv/bin/python benchmarks/scaling_model.py --measure --predict  # both (~10 min here, simulated hosts as root)
    .venv/bin/python benchmarks/scaling_model.py --predict            # from the committed measurement
    .venv/bin/python benchmarks/scaling_model.py --predict --wire-us 50

Without either flag it prints session 4's model (one N=2 fit, a fixed number of rounds per step)::

    .venv/bin/python benchmarks/scaling_model.py                      # session 4's tables
    .venv/bin/python benchmarks/scaling_model.py --points 4096:0.30e-3,16777216:40.9e-3 --wire-latency-us 50
    .venv/bin/python benchmarks/scaling_model.py --beta-ns 0.5        # what a faster host path would give
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: ``--measure`` writes, ``--predict`` reads: the committed measurement behind docs/scaling.md.
MEASURED = ROOT / "benchmarks" / "scaling_measured.json"

#: Quiet ``api-tcp`` N=2 figures (bytes, seconds per allreduce: ``spark_hvd.torch.allreduce_`` over the TCP ring, what
#: a user pays) of benchmarks/RESULTS.md, session 4.
DEFAULT_POINTS = ((4096, 0.198e-3), (1 << 20, 1.598e-3), (16 << 20, 16.669e-3), (64 << 20, 68.315e-3))
HOSTS = (2, 4, 8, 16, 32, 64, 128)
#: Link speeds in bytes/s, at 94% of the line rate (TCP/IP goodput on Ethernet with a 1500-byte MTU).
NETWORKS = {"10GbE": 0.94 * 10e9 / 8, "25GbE": 0.94 * 25e9 / 8, "100GbE": 0.94 * 100e9 / 8}


@dataclass(frozen=True)
class Model:
    """A model's gradient and the computation of one step on one host (fp32 gradients)."""

    name: str
    params: float
    step_s: float
    note: str

    @property
    def grad_bytes(self) -> float:
        return 4.0 * self.params


#: Step times: one step of one host at a common per-GPU batch (V100-class GPU, fp32), from published throughput:
#: ResNet-50 ~360 img/s at batch 64, ResNet-101 ~210 img/s at batch 64, BERT-base ~110 seq/s at batch 32, length 128.
MODELS = (
    Model("ResNet-50", 25.6e6, 64 / 360, "batch 64/GPU"),
    Model("ResNet-101", 44.5e6, 64 / 210, "batch 64/GPU"),
    Model("BERT-base", 110e6, 32 / 110, "batch 32/GPU, seq 128"),
)


@dataclass(frozen=True)
class Ring:
    """The implementation's costs: seconds per message step and per byte (host side), plus the wire's latency."""

    alpha_s: float
    beta_s: float
    wire_latency_s: float = 25e-6
    rounds: int = 8

    def allreduce_s(self, nbytes: float, hosts: int, bandwidth: float) -> float:
        """One step's communication: ``rounds`` rounds of a negotiation and a data collective."""
        if hosts < 2:
            return 0.0
        hops = 2 * (hosts - 1)
        latency = 2 * self.rounds * hops * (self.alpha_s + self.wire_latency_s)
        return latency + hops / hosts * nbytes * max(1.0 / bandwidth, self.beta_s)


def bound_s(nbytes: float, hosts: int, bandwidth: float) -> float:
    """The ring's theoretical bound: bandwidth-optimal traffic on the wire, no latency, no host cost."""
    return 2 * (hosts - 1) / hosts * nbytes / bandwidth if hosts > 1 else 0.0


def fit_alpha_beta(points: Sequence[tuple[float, float]], hosts: int = 2) -> tuple[float, float]:
    """Least-squares (relative error) ``alpha, beta`` of ``t = 2(N-1) alpha + 2(N-1)/N n beta`` for (n, t)."""
    if len(points) < 2:
        raise ValueError("fit_alpha_beta needs at least two (bytes, seconds) points")
    a_coef = 2 * (hosts - 1)
    b_coef = 2 * (hosts - 1) / hosts
    # minimise sum(((a x + b y) / t - 1)^2) over x = alpha, y = beta: 2x2 normal equations
    s_aa = s_ab = s_bb = s_a = s_b = 0.0
    for n, t in points:
        u, v = a_coef / t, b_coef * n / t
        s_aa += u * u
        s_ab += u * v
        s_bb += v * v
        s_a += u
        s_b += v
    det = s_aa * s_bb - s_ab * s_ab
    if det <= 0:
        raise ValueError("the points do not determine alpha and beta (use sizes far apart)")
    alpha = (s_a * s_bb - s_b * s_ab) / det
    beta = (s_b * s_aa - s_a * s_ab) / det
    if alpha < 0 or beta <= 0:
        raise ValueError(f"the fit gave alpha={alpha:.3g} s, beta={beta:.3g} s/B: the points are not alpha-beta like")
    return alpha, beta


def efficiency(model: Model, hosts: int, bandwidth: float, ring: Ring, overlap: bool, bound: bool = False) -> float:
    """Throughput per host at ``hosts`` relative to one host (``bound``: the ring's theoretical bound instead of
    ``ring``'s costs, with the same overlap)."""
    if bound:
        comm = bound_s(model.grad_bytes, hosts, bandwidth)
    else:
        comm = ring.allreduce_s(model.grad_bytes, hosts, bandwidth)
    exposed = max(comm - model.step_s * 2 / 3, comm / ring.rounds) if overlap else comm
    return model.step_s / (model.step_s + exposed)


def table(ring: Ring, models: Sequence[Model] = MODELS, hosts: Sequence[int] = HOSTS) -> str:
    """Markdown: per model and network, efficiency at each host count (no overlap / with overlap / bound)."""
    head = ["model", "network", *[f"N={n}" for n in hosts]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models:
        for net, bandwidth in NETWORKS.items():
            cells = []
            for n in hosts:
                lo = efficiency(model, n, bandwidth, ring, overlap=False)
                hi = efficiency(model, n, bandwidth, ring, overlap=True)
                best = efficiency(model, n, bandwidth, ring, overlap=True, bound=True)
                cells.append(f"{lo:.0%} / {hi:.0%} / {best:.0%}")
            lines.append(f"| {model.name} | {net} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _points(text: str) -> list[tuple[float, float]]:
    out = []
    for item in text.split(","):
        n, t = item.split(":")
        out.append((float(n), float(t)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=_points, default=list(DEFAULT_POINTS),
                        help="measured N=2 allreduce times as bytes:seconds,... (default: RESULTS.md ring-tcp)")
    parser.add_argument("--alpha-us", type=float, default=None, help="override the fitted per-message latency")
    parser.add_argument("--beta-ns", type=float, default=None, help="override the fitted per-byte cost")
    parser.add_argument("--wire-latency-us", type=float, default=25.0,
                        help="the network's one-way latency per message (default 25 us, TCP in one data centre)")
    parser.add_argument("--rounds", type=int, default=8, help="negotiation rounds per training step (default 8)")
    parser.add_argument("--measure", action="store_true",
                        help="time each allreduce algorithm through spark_hvd.torch.allreduce_ at N=2, 4, 8 and write "
                             "the records and the alpha-beta fits to --json (benchmarks/scaling_measure.py)")
    parser.add_argument("--predict", action="store_true",
                        help="the re-fitted model from --json: ResNet-101 on 2..128 hosts of 4 GPUs "
                             "(benchmarks/scaling_predict.py)")
    parser.add_argument("--json", type=Path, default=MEASURED, help=f"default {MEASURED.relative_to(ROOT)}")
    parser.add_argument("--quick", action="store_true", help="--measure: N=2, 4 only, 4 sizes, 2 rounds")
    parser.add_argument("--hosts", choices=("auto", "sim", "loopback"), default="auto",
                        help="--measure: simulated hosts where they can be made (auto), or required, or loopback TCP")
    parser.add_argument("--link", default="25gbit", help="--measure on simulated hosts: each link's tbf rate")
    parser.add_argument("--wire-us", type=float, default=None,
                        help="--predict: wire latency added to every message step (default 20 us)")
    args = parser.parse_args(argv)
    if args.measure or args.predict:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        if args.measure:
            import scaling_measure

            rc, elsewhere = scaling_measure.run(args.json, args.quick, args.hosts, args.link,
                                                list(argv if argv is not None else sys.argv[1:]))
            if rc or elsewhere or not args.predict:
                return rc  # run inside a simulated driver host, which printed any prediction itself
        import scaling_predict

        return scaling_predict.main(args.json, args.wire_us)
    alpha, beta = fit_alpha_beta(args.points)
    if args.alpha_us is not None:
        alpha = args.alpha_us * 1e-6
    if args.beta_ns is not None:
        beta = args.beta_ns * 1e-9
    ring = Ring(alpha, beta, args.wire_latency_us * 1e-6, args.rounds)
    print(f"alpha = {alpha * 1e6:.1f} us per message step, beta = {beta * 1e9:.3f} ns/B "
          f"({1 / beta / 1e9:.2f} GB/s host-side), wire latency {ring.wire_latency_s * 1e6:.0f} us, "
          f"{ring.rounds} rounds per step")
    for net, bandwidth in NETWORKS.items():
        bound = "the host" if beta > 1 / bandwidth else "the wire"
        print(f"{net}: {bandwidth / 1e9:.2f} GB/s goodput; per-byte pace set by {bound}")
    print("\nscaling efficiency: no overlap / overlap with backward / ring bound (overlap, wire only)\n")
    print(table(ring))
    for model in MODELS:
        print(f"- {model.name}: {model.grad_bytes / 1e6:.0f} MB of fp32 gradients, step {model.step_s * 1e3:.0f} ms "
              f"({model.note})")
    horovod = Model("ResNet-101 on 4 P100 per server", 44.5e6, 64 / 110, "Horovod's benchmark setting")
    eff = efficiency(horovod, 128, NETWORKS["25GbE"], ring, overlap=True)
    lo = efficiency(horovod, 128, NETWORKS["25GbE"], ring, overlap=False)
    print(f"\nHorovod's published setting (128 servers x 4 P100, 25 Gbit/s RoCE, ResNet-101: 90% at 512 GPUs): "
          f"this model predicts {lo:.0%} (no overlap) to {eff:.0%} (overlap) for spark_hvd's TCP ring")
    return 0


if __name__ == "__main__":
    sys.exit(main())
