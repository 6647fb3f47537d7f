"""``spark_hvd.torch.DistributedOptimizer(..., op=Adasum)``, Horovod's delta optimizer, against a single-process
computation of the same thing: every rank's model and optimizer (its own state) simulated in this process, each
rank's local step from the same parameters on its own batches, the changes combined per parameter with the numpy
Adasum tree (``helpers.adasum``), for N = 2, 3 and 4 ranks, ``backward_passes_per_step=2``, fp16 compression, and a
process set (the ranks outside it keep their own steps)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers.adasum import tree
from helpers.ranks import run_ranks

torch = pytest.importorskip("torch")

STEPS = 3
ENV = {"SPARK_HVD_TIMEOUT": "60"}


def _model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":  # per-rank moments: the delta is not a linear function of the gradient
        return torch.optim.Adam(model.parameters(), lr=0.05)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batch(rank: int, step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``k``-th batch of step ``step`` (ranks' inputs differ in mean: correlated gradients)."""
    g = np.random.default_rng([rank, step, k])
    x = g.normal(loc=0.3 * rank, size=(8, 5))
    y = g.normal(size=(8, 3))
    return torch.from_numpy(x), torch.from_numpy(y)


def _loss(model: torch.nn.Module, rank: int, step: int, k: int, unused: bool = False) -> torch.Tensor:
    """The loss of that batch; ``unused``: rank 1 leaves the last bias out (no gradient for it there)."""
    x, y = _batch(rank, step, k)
    if unused and rank == 1:
        return torch.nn.functional.mse_loss(model[1](model[0](x)) @ model[2].weight.T, y)
    return torch.nn.functional.mse_loss(model(x), y)


def _train(hvd, kind: str, passes: int, fp16: bool, members: list[int] | None, unused: bool) -> dict:
    """This rank trains STEPS steps with the Adasum optimizer: its final parameters and what it observed."""
    r = hvd.rank()
    pset = hvd.add_process_set(members) if members is not None else hvd.global_process_set
    model = _model()
    opt = hvd.DistributedOptimizer(_optimizer(kind, model), named_parameters=model.named_parameters(),
                                   op=hvd.Adasum, backward_passes_per_step=passes, process_set=pset,
                                   compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none)
    in_flight_after_backward = []
    for s in range(STEPS):
        opt.zero_grad()
        for k in range(passes):
            _loss(model, r, s, k, unused).backward()
        in_flight_after_backward.append(len(getattr(opt, "_hvd_handles", {})))
        opt.step()
    if members is not None:
        hvd.remove_process_set(pset)
    return {"params": [p.detach().numpy().copy() for p in model.parameters()],
            "in_flight": in_flight_after_backward, "class": type(opt).__name__,
            "isinstance": isinstance(opt, type(_optimizer(kind, _model())))}


def _job(n: int) -> dict:
    """One rank of an N-rank launch: every case of that N, then (N = 2) the refusals."""
    import spark_hvd.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    try:
        out = {case: _train(hvd, kind, passes, fp16, members, unused)
               for case, (kind, passes, size, fp16, members, unused) in CASES.items() if size == n}
        if n == 2:
            out["errors"] = _errors(hvd)
        return out
    finally:
        hvd.shutdown()


@functools.cache
def _launch(n: int) -> list[dict]:
    """The results of one N-rank launch by rank (one launch per N for the whole module)."""
    return run_ranks(_job, n, env=ENV, args=(n,), timeout=400)


def _reference(kind: str, passes: int, n: int, fp16: bool, members: list[int] | None,
               unused: bool = False) -> list[list[np.ndarray]]:
    """Every rank's parameters after STEPS steps, computed in this process."""
    members = list(range(n)) if members is None else members
    models = [_model() for _ in range(n)]
    opts = [_optimizer(kind, m) for m in models]
    for s in range(STEPS):
        before = [[p.detach().clone() for p in m.parameters()] for m in models]
        deltas = []
        for r in range(n):
            opts[r].zero_grad()
            for k in range(passes):
                _loss(models[r], r, s, k, unused).backward()  # summed in p.grad, as torch accumulates
            opts[r].step()
            d = [(p.detach() - b).numpy() for p, b in zip(models[r].parameters(), before[r], strict=True)]
            deltas.append([x.astype(np.float16).astype(np.float64) if fp16 else x for x in d])
        start = before[members[0]]  # the members start every step from the same parameters
        for i in range(len(start)):
            combined = tree([deltas[r][i].reshape(-1) for r in members]).reshape(start[i].shape)
            for r in members:
                with torch.no_grad():
                    list(models[r].parameters())[i].copy_(start[i] + torch.from_numpy(combined))
    return [[p.detach().numpy().copy() for p in m.parameters()] for m in models]


CASES = {  # id: (optimizer, backward_passes_per_step, ranks, fp16 compression, process set, a bias unused on rank 1)
    "adam-np2": ("adam", 1, 2, False, None, False),
    "sgd-bpps2-np2": ("sgd", 2, 2, False, None, False),
    "sgd-fp16-np2": ("sgd", 1, 2, True, None, False),
    "adam-unused-np2": ("adam", 1, 2, False, None, True),  # step() steps and submits the parameter without a hook
    "adam-bpps2-np3": ("adam", 2, 3, False, None, False),
    "adam-bpps2-pset02-np3": ("adam", 2, 3, False, [0, 2], False),
    "adam-np4": ("adam", 1, 4, False, None, False),
}


@pytest.mark.slow
@pytest.mark.timeout(450)
@pytest.mark.parametrize("case", list(CASES))
def test_adasum_optimizer_matches_single_process(case):
    kind, passes, n, fp16, members, unused = CASES[case]
    results = [by_case[case] for by_case in _launch(n)]
    want = _reference(kind, passes, n, fp16, members, unused)
    rtol = 5e-3 if fp16 else 1e-10
    inside = list(range(n)) if members is None else members
    for r, res in enumerate(results):
        assert res["isinstance"], res["class"]
        for i, (got, exp) in enumerate(zip(res["params"], want[r], strict=True)):
            np.testing.assert_allclose(got, exp, rtol=rtol, atol=rtol * np.abs(exp).max(),
                                       err_msg=f"rank {r} parameter {i}")
        # each delta's Adasum starts in the gradient hook, during backward: one in flight per parameter
        hooked = 0 if r not in inside else 3 if unused and r == 1 else 4
        assert res["in_flight"] == [hooked] * STEPS, res["in_flight"]
    for r in inside:  # the members agree bit for bit
        for got, first in zip(results[r]["params"], results[inside[0]]["params"], strict=True):
            np.testing.assert_array_equal(got, first)
    # the ranks outside the set trained alone: their parameters differ from the members'
    for r in set(range(n)) - set(inside):
        assert not np.allclose(results[r]["params"][0], results[inside[0]]["params"][0])


def test_reference_is_not_averaging_or_summing():
    """The single-process reference with Adasum differs from averaging or summing the deltas (so the comparison
    above can fail), and from training one rank alone."""
    vectors = [np.array([1.0, 0.2, -0.5]), np.array([0.4, 1.0, 0.3])]
    combined = tree(vectors)
    assert not np.allclose(combined, sum(vectors) / 2) and not np.allclose(combined, sum(vectors))
    alone = _reference("adam", 1, 1, False, None)
    together = _reference("adam", 1, 2, False, None)
    assert not np.allclose(alone[0][0], together[0][0])
    np.testing.assert_array_equal(together[0][0], together[1][0])


def _errors(hvd) -> dict[str, str]:
    """Horovod's refusals, each as "ExceptionType: message"."""
    out: dict[str, str] = {}
    model = _model()

    def attempt(key: str, fn) -> None:
        try:
            fn()
            out[key] = "no error"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[key] = f"{type(exc).__name__}: {exc}"

    attempt("predivide", lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum, gradient_predivide_factor=2.0))
    twice_named = list(model.named_parameters()) + [("0.weight", torch.nn.Parameter(torch.ones(2)))]
    for op in ("Adasum", "Average"):  # Horovod's test_duplicate_names, with and without Adasum
        attempt(f"duplicates {op}", lambda op=op: hvd.DistributedOptimizer(
            torch.optim.SGD([p for _, p in twice_named], lr=0.1), named_parameters=twice_named,
            op=getattr(hvd, op)))
    attempt("unnamed", lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=list(model.named_parameters())[:2],
        op=hvd.Adasum))
    attempt("passes", lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum, backward_passes_per_step=0))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)

    def skip() -> None:
        with opt.skip_synchronize():
            pass

    attempt("skip_synchronize", skip)
    attempt("rewrap", lambda: hvd.DistributedOptimizer(opt, op=hvd.Adasum))
    _loss(model, hvd.rank(), 0, 0).backward()
    attempt("zero_grad", opt.zero_grad)
    opt.step()  # the step of that backward still completes on every rank
    _loss(model, hvd.rank(), 1, 0).backward()
    attempt("twice", lambda: _loss(model, hvd.rank(), 2, 0).backward())
    opt.step()
    opt.zero_grad()
    return out


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_adasum_optimizer_errors():
    """Horovod's refusals, with its exception types (checked in the 2-rank launch)."""
    out = _launch(2)[0]["errors"]
    assert out["predivide"].startswith("ValueError: gradient_predivide_factor needs op=Average"), out
    for op in ("Adasum", "Average"):
        assert out[f"duplicates {op}"] == ("ValueError: parameter names in named_parameters are not unique: "
                                           "['0.weight']"), out
    assert out["unnamed"].startswith("ValueError: named_parameters does not cover every parameter"), out
    assert out["rewrap"] == "ValueError: optimizer is already a DistributedOptimizer", out
    assert out["passes"].startswith("ValueError: backward_passes_per_step must be >= 1"), out
    assert out["skip_synchronize"] == ("AssertionError: Skipping synchronization is not supported when using "
                                       "Adasum optimizer."), out
    assert out["zero_grad"].startswith("AssertionError: optimizer.zero_grad() was called after loss.backward()"), out
    assert out["twice"].startswith("AssertionError: gradient of parameter '2."), out  # the last layer's: first
    assert "was computed more than backward_passes_per_step=1 times" in out["twice"], out
