"""One rank of the Horovod-compatibility checks of spark_hvd.torch; run as
``spark-hvd-run -np N python torch_compat_worker.py OUT_DIR``. Every check runs on every rank in the same order;
results ("ok" or the traceback) go to ``OUT_DIR/torch-rank<r>.json``.

Gradients through collectives are checked against Horovod's backward definitions written out in numpy (every
rank regenerates every rank's data from its seed); forward values against numpy on the same data.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
import torch

torch.set_num_threads(1)

from checks import expect_errors, make_check  # noqa: E402 - the scripts' directory is on sys.path

import spark_hvd.torch as hvd  # noqa: E402

RESULTS: dict[str, str] = {}


check = make_check(RESULTS)


hvd.init()
R, N = hvd.rank(), hvd.size()


def rnd(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape)


def leaf(a: np.ndarray) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


def close(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-10, atol=1e-12, err_msg=what)


# ------------------------------------------------------------------------------------------------- gradients
@check("grad_allgather")
def _grad_allgather() -> None:
    rows = [r + 2 for r in range(N)]  # the first dimension differs by rank
    x = leaf(rnd(10 + R, rows[R], 3))
    w = [rnd(20 + q, sum(rows), 3) for q in range(N)]  # each rank's loss weights of the gathered tensor
    gathered = hvd.allgather(x)
    close(gathered, np.concatenate([rnd(10 + r, rows[r], 3) for r in range(N)]), "allgather forward")
    (gathered * torch.from_numpy(w[R])).sum().backward()
    start = sum(rows[:R])
    close(x.grad, np.mean(w, axis=0)[start:start + rows[R]], "allgather grad (Horovod: average over ranks)")


@check("grad_grouped_allgather")
def _grad_grouped_allgather() -> None:
    rows = [[r + 1, 2 * r + 1] for r in range(N)]
    xs = [leaf(rnd(30 + 2 * R + i, rows[R][i], 2)) for i in range(2)]
    outs = hvd.grouped_allgather(xs)
    w = [[rnd(40 + 2 * q + i, sum(r[i] for r in rows), 2) for i in range(2)] for q in range(N)]
    sum((o * torch.from_numpy(w[R][i])).sum() for i, o in enumerate(outs)).backward()
    for i in range(2):
        close(outs[i], np.concatenate([rnd(30 + 2 * r + i, rows[r][i], 2) for r in range(N)]), f"forward {i}")
        start = sum(r[i] for r in rows[:R])
        close(xs[i].grad, np.mean([w[q][i] for q in range(N)], axis=0)[start:start + rows[R][i]], f"grad {i}")


@check("grad_broadcast")
def _grad_broadcast() -> None:
    for root in range(N):
        x = leaf(rnd(50 + R, 4, 2))
        w = [rnd(60 + q, 4, 2) for q in range(N)]
        out = hvd.broadcast(x, root)
        close(out, rnd(50 + root, 4, 2), f"broadcast forward root {root}")
        (out * torch.from_numpy(w[R])).sum().backward()
        want = np.mean(w, axis=0) if R == root else np.zeros((4, 2))
        close(x.grad, want, f"broadcast grad root {root} (Horovod: average on the root, zeros elsewhere)")


def _splits(r: int) -> list[int]:
    return [int(v) for v in np.random.default_rng(70 + r).integers(0, 4, size=N)]


@check("grad_alltoall")
def _grad_alltoall() -> None:
    splits = [_splits(r) for r in range(N)]
    xs = [rnd(80 + r, sum(splits[r]), 3) for r in range(N)]
    x = leaf(xs[R])
    out, received = hvd.alltoall(x, torch.tensor(splits[R], dtype=torch.int32))
    assert received.tolist() == [splits[s][R] for s in range(N)], received

    def block(s: int, q: int, arr: np.ndarray) -> np.ndarray:  # rows that rank s sends to rank q
        start = sum(splits[s][:q])
        return arr[start:start + splits[s][q]]
    close(out, np.concatenate([block(s, R, xs[s]) for s in range(N)]), "alltoall forward")
    w = [rnd(90 + q, sum(splits[s][q] for s in range(N)), 3) for q in range(N)]
    (out * torch.from_numpy(w[R])).sum().backward()

    def received_block(q: int, s: int) -> np.ndarray:  # rows of rank q's output that came from rank s
        start = sum(splits[p][q] for p in range(s))
        return w[q][start:start + splits[s][q]]
    close(x.grad, np.concatenate([received_block(q, R) for q in range(N)]), "alltoall grad (alltoall back)")
    # no splits: an even split, the plain tensor returned
    y = leaf(rnd(95 + R, 2 * N, 2))
    even = hvd.alltoall(y)
    assert isinstance(even, torch.Tensor) and even.shape == (2 * N, 2)
    even.sum().backward()
    close(y.grad, np.ones((2 * N, 2)), "even alltoall grad")


def _parts(rows: int) -> list[tuple[int, int]]:
    per, extra = divmod(rows, N)
    bounds, start = [], 0
    for r in range(N):
        n = per + (1 if r < extra else 0)
        bounds.append((start, start + n))
        start += n
    return bounds


@check("grad_reducescatter")
def _grad_reducescatter() -> None:
    rows = 2 * N + 1  # uneven on purpose
    lo, hi = _parts(rows)[R]
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0), (hvd.Average, 2.0, 0.25)):
        x = leaf(rnd(100 + R, rows, 3))
        out = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
        stack = np.stack([rnd(100 + r, rows, 3) for r in range(N)])
        total = (stack * pre).sum(0) * post / (N if op == hvd.Average else 1)
        close(out, total[lo:hi], f"reducescatter forward {op} {pre} {post}")
        w = [rnd(110 + q, *(_parts(rows)[q][1] - _parts(rows)[q][0], 3)) for q in range(N)]
        (out * torch.from_numpy(w[R])).sum().backward()
        factor = (N if op == hvd.Sum else 1) * pre * post
        close(x.grad, np.concatenate(w) * factor, f"reducescatter grad {op} {pre} {post} (Horovod's definition)")


@check("grad_grouped_reducescatter")
def _grad_grouped_reducescatter() -> None:
    shapes = [(N, 2), (2 * N + 1, 1)]
    xs = [leaf(rnd(120 + 2 * R + i, *s)) for i, s in enumerate(shapes)]
    outs = hvd.grouped_reducescatter(xs, op=hvd.Sum)
    loss = 0
    for i, s in enumerate(shapes):
        lo, hi = _parts(s[0])[R]
        close(outs[i], np.sum([rnd(120 + 2 * r + i, *s) for r in range(N)], axis=0)[lo:hi], f"forward {i}")
        loss = loss + outs[i].sum()
    loss.backward()
    for i, s in enumerate(shapes):
        close(xs[i].grad, np.full(s, float(N)), f"grouped reducescatter grad {i}")


@check("grad_grouped_allreduce")
def _grad_grouped_allreduce() -> None:
    for op in (hvd.Average, hvd.Sum):
        xs = [leaf(rnd(130 + 2 * R + i, 3, i + 1)) for i in range(2)]
        w = [[rnd(140 + 2 * q + i, 3, i + 1) for i in range(2)] for q in range(N)]
        outs = hvd.grouped_allreduce(xs, op=op)
        sum((o * torch.from_numpy(w[R][i])).sum() for i, o in enumerate(outs)).backward()
        for i in range(2):
            stack = np.stack([rnd(130 + 2 * r + i, 3, i + 1) for r in range(N)])
            close(outs[i], stack.mean(0) if op == hvd.Average else stack.sum(0), f"forward {op} {i}")
            ws = np.stack([w[q][i] for q in range(N)])
            close(xs[i].grad, ws.mean(0) if op == hvd.Average else ws.sum(0), f"grad {op} {i}")


# ------------------------------------------------------------------------------------------------- values
@check("grouped_async_and_scaled_values")
def _grouped_async() -> None:
    a = [torch.from_numpy(rnd(150 + R, r + 1, 2)) for r in range(2)]
    h = hvd.grouped_allgather_async(a, name="ga")
    got = hvd.synchronize(h)
    assert hvd.poll(h)
    for i in range(2):
        close(got[i], np.concatenate([rnd(150 + r, i + 1, 2) for r in range(N)]), f"grouped_allgather_async {i}")
    b = [torch.from_numpy(rnd(160 + R, N * 2, 3)), torch.from_numpy(rnd(170 + R, N, 1))]
    got = hvd.synchronize(hvd.grouped_reducescatter_async(b, op=hvd.Average, postscale_factor=3.0))
    for i, (seed, rows) in enumerate(((160, N * 2), (170, N))):
        lo, hi = _parts(rows)[R]
        cols = 3 if i == 0 else 1
        want = np.mean([rnd(seed + r, rows, cols) for r in range(N)], axis=0)[lo:hi] * 3.0
        close(got[i], want, f"grouped_reducescatter_async {i}")
    # float16 reducescatter with a prescale: scaled in float32, rounded once, then summed
    h16 = torch.from_numpy(rnd(180 + R, N, 4).astype(np.float16))
    out = hvd.reducescatter(h16, op=hvd.Sum, prescale_factor=0.37)
    assert out.dtype == torch.float16
    scaled = [(rnd(180 + r, N, 4).astype(np.float16).astype(np.float32) * np.float32(0.37)).astype(np.float16)
              for r in range(N)]
    want16 = np.sum([s.astype(np.float64) for s in scaled], axis=0)[R:R + 1]
    np.testing.assert_allclose(out.numpy().astype(np.float64), want16, rtol=2e-3, atol=2e-3)


@check("sparse_allreduce_async")
def _sparse() -> None:
    idx = [sorted(set(np.random.default_rng(190 + r).integers(0, 6, size=3).tolist())) for r in range(N)]
    vals = [rnd(200 + r, len(idx[r])) for r in range(N)]
    s = torch.sparse_coo_tensor([idx[R]], torch.from_numpy(vals[R]), (6,))
    want = np.zeros(6)
    for r in range(N):
        np.add.at(want, idx[r], vals[r])
    close(hvd.synchronize(hvd.sparse_allreduce_async(s, op=hvd.Sum)).to_dense(), want, "sparse sum")
    close(hvd.sparse_allreduce_async(s)().to_dense(), want / N, "sparse average (a callable handle, as Horovod's)")


# ------------------------------------------------------------------------------------------------- errors
@check("bad_input_errors_keep_the_engine")
def _errors() -> None:
    expect_errors(((lambda: hvd.alltoall(torch.ones(N), torch.ones(N)), "integer tensor"),
                   (lambda: hvd.alltoall(torch.ones(N), [0.5] * N), "integers"),
                   (lambda: hvd.reducescatter(torch.tensor(1.0)), "at least one dimension"),
                   (lambda: hvd.allgather(torch.tensor(1.0)), "at least one dimension")))
    # the engine still works on every rank
    close(hvd.allreduce(torch.ones(2, dtype=torch.float64) * R, op=hvd.Sum), np.full(2, N * (N - 1) / 2), "after")


# ------------------------------------------------------------------------------------------------- optimizer
@check("sparse_gradients_match_single_process")
def _sparse_gradients() -> None:
    rng = np.random.default_rng(210)
    tokens = torch.from_numpy(rng.integers(0, 10, size=(4 * N, 3)))
    target = torch.from_numpy(rng.normal(size=(4 * N, 4)).astype(np.float32))

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4, mode="sum", sparse=True), torch.nn.Linear(4, 4))

    mine = slice(4 * R, 4 * R + 4)
    for sparse_as_dense in (True, False):  # densified, or Horovod's sparse allreduce (gradients stay sparse)
        dist, ref = model(), model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(dist.parameters(), lr=0.1), sparse_as_dense=sparse_as_dense,
                                       named_parameters=dist.named_parameters())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(dist(tokens[mine]), target[mine]).backward()
            opt.step()
            assert dist[0].weight.grad.is_sparse, dist[0].weight.grad.layout  # sparse again for the update
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(tokens), target).backward()
            ref_opt.step()
        for (n, a), b in zip(dist.named_parameters(), ref.parameters(), strict=True):
            np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{n} sparse_as_dense={sparse_as_dense}")
        opt.remove_hooks()
    assert set(opt._parameter_names.values()) == {n for n, _ in dist.named_parameters()}  # Horovod's attribute


@check("broadcast_optimizer_state_zero_grads")
def _zero_grads() -> None:
    a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
    b = torch.nn.Parameter(torch.from_numpy(rnd(220 + R, 4)))
    opt = torch.optim.SGD([a, b], lr=0.01, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert a.grad is None, "a parameter without requires_grad got a gradient"
    assert b.grad is not None and torch.count_nonzero(b.grad) == 0, b.grad
    close(b, rnd(220 + R, 4), "no parameter moved")


@check("sync_batch_norm_matches_single_process")
def _sync_bn() -> None:
    rows = [r + 3 for r in range(N)]  # uneven per-rank batches
    xs = [rnd(230 + r, rows[r], 3, 4) for r in range(N)]
    ws = [rnd(240 + r, rows[r], 3, 4) for r in range(N)]

    def bn(cls: type) -> torch.nn.Module:
        m = cls(3, momentum=0.3).double()
        with torch.no_grad():
            m.weight.copy_(torch.from_numpy(rnd(250, 3)))
            m.bias.copy_(torch.from_numpy(rnd(251, 3)))
        return m

    sync, ref = bn(hvd.SyncBatchNorm), bn(torch.nn.BatchNorm1d)
    x = leaf(xs[R])
    out = sync(x)
    (out * torch.from_numpy(ws[R])).sum().backward()
    full = leaf(np.concatenate(xs))
    ref_out = ref(full)
    (ref_out * torch.from_numpy(np.concatenate(ws))).sum().backward()  # the sum of every rank's loss
    start = sum(rows[:R])
    close(out, ref_out.detach().numpy()[start:start + rows[R]], "output")
    close(x.grad, full.grad.numpy()[start:start + rows[R]], "input gradient")
    for name in ("weight", "bias"):
        local = getattr(sync, name).grad
        close(hvd.allreduce(local, op=hvd.Sum), getattr(ref, name).grad.numpy(), f"{name} gradient summed")
    close(sync.running_mean, ref.running_mean.numpy(), "running_mean")
    close(sync.running_var, ref.running_var.numpy(), "running_var")
    sync.eval()
    ref.eval()
    close(sync(x.detach()), ref(x.detach()).detach().numpy(), "eval mode")


# ------------------------------------------------------------------------------------------------- process API
@check("build_queries")
def _queries() -> None:
    assert hvd.nccl_built() == 0 and isinstance(hvd.nccl_built(), int)  # no CUDA here: Horovod's "not built"
    assert hvd.ccl_built() is False and hvd.ddl_built() is False
    assert hvd.gloo_built() and hvd.gloo_enabled() and not hvd.mpi_enabled()
    assert hvd.cuda_built() == (torch.version.cuda is not None)
    assert hvd.is_homogeneous()


@check("start_stop_timeline")
def _timeline() -> None:
    path = os.path.join(tempfile.gettempdir(), f"spark_hvd_tl_{os.getppid()}_{{rank}}.json")
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(3), name="timeline.probe")
    hvd.barrier()
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(3), name="timeline.after")  # after stop: not recorded, nothing breaks
    mine = path.replace("{rank}", str(R))
    with open(mine) as f:
        events = json.load(f)
    names = {e.get("args", {}).get("name") for e in events if e.get("ph") == "M"}
    assert "timeline.probe" in names and "timeline.after" not in names, names
    os.remove(mine)


@check("join_rejects_all_but_allreduce")
def _join_rejects() -> None:
    # each rank in turn joins first; on the others allgather, broadcast, alltoall and reducescatter raise naming
    # it, an allreduce then sums the active ranks (the joined rank adds zeros), and the next join returns one
    # rank, the same everywhere, never the first to join
    for first in range(N):
        if R == first:
            last = hvd.join()
        else:
            root = min(set(range(N)) - {first})  # a root that has not joined
            calls = {
                "allgather": lambda: hvd.allgather(torch.ones(2, 3), name="jr.ag"),
                "broadcast": lambda root=root: hvd.broadcast(torch.ones(4), root_rank=root, name="jr.bc"),
                "alltoall": lambda: hvd.alltoall(torch.ones(N, 2), name="jr.a2a"),
                "reducescatter": lambda: hvd.reducescatter(torch.ones(2 * N, 2), name="jr.rs"),
            }
            for kind, call in calls.items():
                try:
                    call()
                except RuntimeError as exc:
                    assert f"{kind} of 'jr." in str(exc) and f"rank {first} has called join()" in str(exc), str(exc)
                else:
                    raise AssertionError(f"{kind} while rank {first} had joined did not raise")
                mine = rnd(100 + first, 4) * (R + 1)
                want = sum(rnd(100 + first, 4) * (q + 1) for q in range(N) if q != first)
                close(hvd.allreduce(torch.tensor(mine), op=hvd.Sum, name=f"jr.after.{kind}"), want,
                      f"allreduce after a failed {kind}")
            last = hvd.join()
        assert last != first, f"join returned the first rank to join ({first})"
        assert hvd.allgather_object(last) == [last] * N, "join returned different ranks"


@check("init_after_failure")
def _reinit() -> None:
    # the last rank leaves while the others still work: their engines stop on the error; init() on every rank
    # then gives a working job again
    if R == N - 1:
        hvd.shutdown()
    else:
        try:
            hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="orphan"))
        except Exception as e:  # noqa: BLE001 - any error naming the shutdown
            assert "shut down" in str(e), str(e)
        else:
            raise AssertionError("an allreduce with a rank gone succeeded")
    hvd.init()
    assert (hvd.rank(), hvd.size()) == (R, N)
    close(hvd.allreduce(torch.ones(3, dtype=torch.float64) * (R + 1), op=hvd.Sum), np.full(3, N * (N + 1) / 2),
          "allreduce after init()")


out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
with open(os.path.join(out_dir, f"torch-rank{R}.json"), "w") as f:
    json.dump({"rank": R, "size": N, "results": RESULTS}, f)
hvd.shutdown()
