"""One rank of the process-set checks of spark_hvd.torch; run as
``spark-hvd-run -np 3 python psets_worker.py OUT_DIR``. Every check runs on every rank in the same order; results
("ok" or the traceback) go to ``OUT_DIR/psets-rank<r>.json``.

Set {0, 2} works while rank 1 does nothing or works in its own set {1}; values are checked against numpy on the
same data (every rank regenerates every rank's data from its seed), gradients against Horovod's backward
definitions written out in numpy, the optimizer against a single-process step on the members' averaged gradient.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

torch.set_num_threads(1)

from checks import make_check  # noqa: E402 - the scripts' directory is on sys.path

import spark_hvd.torch as hvd  # noqa: E402

RESULTS: dict[str, str] = {}


check = make_check(RESULTS, after=hvd.barrier)  # every check starts together, whatever the last one did


hvd.init()
R, N = hvd.rank(), hvd.size()
assert N == 3, "these checks need 3 ranks"
MEMBERS = [0, 2]
PAIR = hvd.add_process_set(MEMBERS)
SOLO = hvd.add_process_set([1])
IN = R in MEMBERS


def rnd(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape)


def close(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-10, atol=1e-12, err_msg=what)


@check("registration")
def _registration() -> None:
    assert hvd.global_process_set.process_set_id == 0
    assert (PAIR.process_set_id, SOLO.process_set_id) == (1, 2), (PAIR, SOLO)
    assert PAIR.size() == 2 and SOLO.size() == 1
    assert PAIR.included() is IN and SOLO.included() is (R == 1)
    if IN:
        assert PAIR.rank() == MEMBERS.index(R)
    else:
        try:
            PAIR.rank()
        except ValueError as e:
            assert "rank 1" in str(e), str(e)
        else:
            raise AssertionError("rank() of a non-member did not raise")
    for bad, words in (([0, 2], "duplicate"), ([0, 1, 2], "duplicate"), ([0, 5], "not ranks of a job")):
        try:
            hvd.add_process_set(bad)
        except ValueError as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"add_process_set({bad}) did not raise")
    assert hvd.remove_process_set(hvd.global_process_set) is False


@check("allreduce")
def _allreduce() -> None:
    data = {q: rnd(100 + q, 4, 3) for q in range(N)}
    if IN:
        total = data[0] + data[2]
        close(hvd.allreduce(torch.tensor(data[R]), op=hvd.Sum, process_set=PAIR), total, "sum over {0,2}")
        close(hvd.allreduce(torch.tensor(data[R]), process_set=PAIR), total / 2, "average divides by the set size")
        t = torch.tensor(data[R])
        hvd.allreduce_(t, op=hvd.Sum, process_set=PAIR)
        close(t, total, "allreduce_ in place")
        outs = hvd.grouped_allreduce([torch.tensor(data[R]), torch.tensor(2 * data[R])], op=hvd.Sum,
                                     process_set=PAIR)
        close(outs[1], 2 * total, "grouped_allreduce")
        h = hvd.allreduce_async(torch.tensor(data[R]), op=hvd.Max, process_set=PAIR)
        close(hvd.synchronize(h), np.maximum(data[0], data[2]), "async max")
    else:  # rank 1 meanwhile uses its own set
        close(hvd.allreduce(torch.tensor(data[1]), op=hvd.Sum, process_set=SOLO), data[1], "set of one")


@check("allgather_broadcast_alltoall_reducescatter")
def _others() -> None:
    if not IN:
        return  # rank 1 does nothing while the pair works
    rows = {0: 2, 2: 5}
    x = {q: rnd(200 + q, rows[q], 3) for q in MEMBERS}
    close(hvd.allgather(torch.tensor(x[R]), process_set=PAIR), np.concatenate([x[0], x[2]]), "allgather")
    b = hvd.broadcast(torch.tensor(x[R][:2]), root_rank=2, process_set=PAIR)
    close(b, x[2][:2], "broadcast from global rank 2")
    t = torch.tensor(x[R][:2])
    hvd.broadcast_(t, root_rank=0, process_set=PAIR)
    close(t, x[0][:2], "broadcast_ from rank 0")
    sent = {q: np.arange(4.0) + 10 * q for q in MEMBERS}
    out, splits = hvd.alltoall(torch.tensor(sent[R]), splits=[1, 3], process_set=PAIR)
    i = MEMBERS.index(R)
    want = np.concatenate([sent[0][:1], sent[2][:1]]) if i == 0 else np.concatenate([sent[0][1:], sent[2][1:]])
    close(out, want, "alltoall")
    assert splits.tolist() == ([1, 1] if i == 0 else [3, 3]), splits
    y = {q: rnd(300 + q, 5, 2) for q in MEMBERS}
    part = hvd.reducescatter(torch.tensor(y[R]), op=hvd.Sum, process_set=PAIR)
    close(part, (y[0] + y[2])[:3] if i == 0 else (y[0] + y[2])[3:], "reducescatter")
    obj = hvd.broadcast_object({"from": R} if R == 2 else None, root_rank=2, process_set=PAIR)
    assert obj == {"from": 2}, obj
    assert hvd.allgather_object(R, process_set=PAIR) == MEMBERS
    hvd.barrier(process_set=PAIR)


@check("non_member_errors")
def _non_member_errors() -> None:
    if IN:
        try:
            hvd.broadcast(torch.ones(2), root_rank=1, process_set=PAIR)
        except ValueError as e:
            assert "root_rank 1" in str(e), str(e)
        else:
            raise AssertionError("a root outside the set did not raise")
        return
    calls = {
        "allreduce": lambda: hvd.allreduce(torch.ones(2), process_set=PAIR),
        "allgather": lambda: hvd.allgather(torch.ones(2), process_set=PAIR),
        "broadcast": lambda: hvd.broadcast(torch.ones(2), 0, process_set=PAIR),
        "alltoall": lambda: hvd.alltoall(torch.ones(2), process_set=PAIR),
        "reducescatter": lambda: hvd.reducescatter(torch.ones(2), process_set=PAIR),
        "barrier": lambda: hvd.barrier(process_set=PAIR),
        "broadcast_object": lambda: hvd.broadcast_object(1, 0, process_set=PAIR),
    }
    for what, call in calls.items():
        try:
            call()
        except ValueError as e:
            assert "rank 1 is not a member" in str(e), (what, str(e))
        else:
            raise AssertionError(f"{what} on a set without this rank did not raise")


@check("gradients")
def _gradients() -> None:
    if not IN:
        return
    x = {q: rnd(400 + q, 3, 2) for q in MEMBERS}
    w = {q: rnd(500 + q, 6, 2) for q in MEMBERS}  # each member's loss weights on the gathered tensor
    xt = torch.tensor(x[R], requires_grad=True)
    (hvd.allgather(xt, process_set=PAIR) * torch.tensor(w[R])).sum().backward()
    i = MEMBERS.index(R)
    close(xt.grad, ((w[0] + w[2]) / 2)[3 * i:3 * i + 3], "allgather backward: averaged, own rows")
    xt = torch.tensor(x[R], requires_grad=True)
    (hvd.allreduce(xt, op=hvd.Sum, process_set=PAIR) * torch.tensor(w[R][:3])).sum().backward()
    close(xt.grad, w[0][:3] + w[2][:3], "allreduce(Sum) backward")


@check("optimizer")
def _optimizer() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), process_set=PAIR)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    xs = {q: torch.tensor(rnd(600 + q, 8, 3)) for q in range(N)}

    def grads(q: int) -> list[torch.Tensor]:
        ref = torch.nn.Linear(3, 2).double()
        ref.load_state_dict(start)
        ref(xs[q]).pow(2).sum().backward()
        return [ref.weight.grad, ref.bias.grad]
    model(xs[R]).pow(2).sum().backward()
    opt.step()
    if IN:
        want = [(a + b) / 2 for a, b in zip(grads(0), grads(2), strict=True)]
    else:
        want = grads(1)  # outside the set: its own gradient, unreduced
    close(model.weight, (start["weight"] - 0.5 * want[0]).numpy(), "weight after a step")
    close(model.bias, (start["bias"] - 0.5 * want[1]).numpy(), "bias after a step")


@check("remove_and_init_process_sets")
def _remove_and_init() -> None:
    later = hvd.ProcessSet([1, 2])
    hvd.init(process_sets=[later])  # already initialised: registers the set
    assert later.process_set_id == 3, later
    if R in (1, 2):
        close(hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum, process_set=later), np.array([3.0]), "{1,2}")
    assert hvd.remove_process_set(later) is True
    assert later.process_set_id is None and hvd.remove_process_set(later) is False
    try:
        hvd.allreduce(torch.ones(1), process_set=later)
    except ValueError as e:
        assert "not registered" in str(e), str(e)
    else:
        raise AssertionError("a removed set still worked")
    close(hvd.allreduce(torch.ones(1), op=hvd.Sum), np.array([3.0]), "global set after a removal")


out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
with open(os.path.join(out_dir, f"psets-rank{R}.json"), "w") as f:
    json.dump({"rank": R, "size": N, "results": RESULTS}, f)
hvd.shutdown()
