"""One rank of the torch binding checks; run as ``spark-hvd-run -np 2 python torch_worker.py OUT_DIR``
(or plainly, size 1). Every check runs on every rank in the same order; each result ("ok" or the error) goes
to ``OUT_DIR/torch-rank<r>.json`` so pytest reports the checks one by one."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import torch

torch.set_num_threads(1)

from checks import expect_errors, make_check  # noqa: E402 - the scripts' directory is on sys.path

import spark_hvd.torch as hvd  # noqa: E402

RESULTS: dict[str, str] = {}


# with "quick" as second argument only these run (the one-rank launch: the size-1 paths, not every feature)
QUICK = {"before_init_error", "collectives_float32", "collectives_bfloat16", "collectives_int64",
         "allreduce_autograd", "objects_barrier", "train_matches_single_process", "backward_passes_per_step_2",
         "broadcast_parameters", "broadcast_optimizer_state", "join_uneven_batches"}
ONLY_QUICK = len(sys.argv) > 2 and sys.argv[2] == "quick"


check = make_check(RESULTS, only=QUICK if ONLY_QUICK else None)


# --------------------------------------------------------------------------------------------- before init
def _before_init() -> None:
    calls = (hvd.rank, lambda: hvd.allreduce(torch.ones(2)), lambda: hvd.broadcast_parameters({}, 0),
             lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)))
    expect_errors([(call, "init()") for call in calls], hvd.NotInitializedError)


check("before_init_error")(_before_init)
hvd.init()
R, N = hvd.rank(), hvd.size()

# --------------------------------------------------------------------------------------------- collectives
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.int64: 0}


def _data(r: int, dtype: torch.dtype, rows: int = 6, cols: int = 5) -> torch.Tensor:
    rng = np.random.default_rng(1000 + r)
    if dtype == torch.int64:
        return torch.from_numpy(rng.integers(-50, 50, size=(rows, cols)).astype(np.int64))
    return torch.from_numpy(rng.uniform(-4, 4, size=(rows, cols)).astype(np.float32)).to(dtype)


def _close(got: torch.Tensor, want: np.ndarray, dtype: torch.dtype, what: str) -> None:
    assert got.dtype == dtype, f"{what}: dtype {got.dtype} != {dtype}"
    g = got.to(torch.float64).numpy() if dtype != torch.int64 else got.numpy()
    assert g.shape == want.shape, f"{what}: shape {g.shape} != {want.shape}"
    if TOL[dtype] == 0:
        np.testing.assert_array_equal(g, want, err_msg=what)
    else:
        np.testing.assert_allclose(g, want, rtol=TOL[dtype], atol=TOL[dtype] * 4, err_msg=what)


def _collectives(dtype: torch.dtype) -> None:
    mine = _data(R, dtype)
    alls = [_data(r, dtype).to(torch.float64).numpy() if dtype != torch.int64 else _data(r, dtype).numpy()
            for r in range(N)]
    stack = np.stack(alls)
    _close(hvd.allreduce(mine, op=hvd.Sum), stack.sum(0), dtype, "allreduce sum")
    _close(hvd.allreduce(mine, op=hvd.Min), stack.min(0), dtype, "allreduce min")
    _close(hvd.allreduce(mine, op=hvd.Max), stack.max(0), dtype, "allreduce max")
    if dtype != torch.int64:
        _close(hvd.allreduce(mine), stack.mean(0), dtype, "allreduce average")
        _close(hvd.allreduce(mine, average=True, prescale_factor=2.0), stack.mean(0) * 2, dtype, "prescale")
    if dtype == torch.float32:
        _close(hvd.allreduce(mine / 4, op=hvd.Product), np.prod(stack / 4, axis=0), dtype, "allreduce product")
        want16 = stack.astype(np.float16).astype(np.float64).sum(0).astype(np.float16).astype(np.float64)
        got16 = hvd.allreduce(mine, compression=hvd.Compression.fp16, op=hvd.Sum)
        np.testing.assert_allclose(got16.numpy(), want16, rtol=1e-3, atol=1e-3, err_msg="fp16 compressed")
        assert got16.dtype == torch.float32
        # Adasum: pairs a, b (neighbours, then pairs of pairs) combined as a + b scaled by their dot product over
        # each one's squared norm; one rank: its own tensor
        level = list(stack)
        while len(level) > 1:
            pairs = [(level[i], level[i + 1]) for i in range(0, len(level), 2)]
            level = [(1 - (a * b).sum() / (2 * (a * a).sum())) * a + (1 - (a * b).sum() / (2 * (b * b).sum())) * b
                     for a, b in pairs]
        _close(hvd.allreduce(mine, op=hvd.Adasum), level[0], dtype, "allreduce adasum")
        try:
            hvd.reducescatter(mine, op=hvd.Adasum)
        except RuntimeError as exc:  # Horovod's class (NotImplementedError is one)
            assert "Adasum" in str(exc), exc
        else:
            raise AssertionError("reducescatter with op=Adasum did not raise")
    # in place, async, poll
    t = mine.clone()
    h = hvd.allreduce_async_(t, op=hvd.Sum, name=f"inplace.{dtype}")
    out = hvd.synchronize(h)
    assert out is t and hvd.poll(h)
    _close(t, stack.sum(0), dtype, "allreduce_async_")
    before = mine.clone()
    _close(hvd.synchronize(hvd.allreduce_async(mine, op=hvd.Max)), stack.max(0), dtype, "allreduce_async")
    assert torch.equal(mine, before), "allreduce_async modified its input"
    # a non-contiguous view, reduced in place
    base = mine.clone()
    view = base.t()
    hvd.allreduce_(view, op=hvd.Sum)
    _close(base, stack.sum(0), dtype, "allreduce_ of a transposed view")
    # grouped
    other = _data(R + 7, dtype, rows=3, cols=2)
    other_all = np.stack([(_data(r + 7, dtype, 3, 2).to(torch.float64) if dtype != torch.int64
                           else _data(r + 7, dtype, 3, 2)).numpy() for r in range(N)])
    g = hvd.grouped_allreduce([mine, other], op=hvd.Sum)
    _close(g[0], stack.sum(0), dtype, "grouped 0")
    _close(g[1], other_all.sum(0), dtype, "grouped 1")
    # allgather with a first dimension that differs by rank
    rows = _data(R, dtype, rows=R + 1)
    want = np.concatenate([(_data(r, dtype, rows=r + 1).to(torch.float64) if dtype != torch.int64
                            else _data(r, dtype, rows=r + 1)).numpy() for r in range(N)])
    _close(hvd.allgather(rows), want, dtype, "allgather")
    # broadcast from the last rank
    root = N - 1
    _close(hvd.broadcast(mine, root), stack[root], dtype, "broadcast")
    b = mine.clone()
    hvd.broadcast_(b, root)
    _close(b, stack[root], dtype, "broadcast_")
    # alltoall with splits: rank r sends s+1 rows to rank s... rows = sum over s of (s + 1)
    splits = [s + 1 for s in range(N)]
    send = _data(R + 20, dtype, rows=sum(splits))
    out, rsplits = hvd.alltoall(send, splits=splits)
    parts = []
    for r in range(N):
        src = _data(r + 20, dtype, rows=sum(splits))
        src = src.to(torch.float64).numpy() if dtype != torch.int64 else src.numpy()
        start = sum(splits[:R])
        parts.append(src[start:start + splits[R]])
    _close(out, np.concatenate(parts), dtype, "alltoall")
    assert rsplits.tolist() == [splits[R]] * N, f"alltoall received splits {rsplits.tolist()}"
    even = _data(R + 30, dtype, rows=2 * N)
    want_even = np.concatenate([(_data(r + 30, dtype, rows=2 * N).to(torch.float64) if dtype != torch.int64
                                 else _data(r + 30, dtype, rows=2 * N)).numpy()[2 * R:2 * R + 2]
                                for r in range(N)])
    _close(hvd.alltoall(even), want_even, dtype, "alltoall even")
    # reducescatter: rows split evenly, the first rows % size ranks one more
    rs = _data(R + 40, dtype, rows=2 * N + 1)
    total = np.stack([(_data(r + 40, dtype, rows=2 * N + 1).to(torch.float64) if dtype != torch.int64
                       else _data(r + 40, dtype, rows=2 * N + 1)).numpy() for r in range(N)]).sum(0)
    counts = [(2 * N + 1) // N + (1 if r < (2 * N + 1) % N else 0) for r in range(N)]
    start = sum(counts[:R])
    _close(hvd.reducescatter(rs, op=hvd.Sum), total[start:start + counts[R]], dtype, "reducescatter")


for _dt in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
    check(f"collectives_{str(_dt).split('.')[-1]}")(lambda _dt=_dt: _collectives(_dt))


@check("allreduce_in_place_changed_tensor")
def _changed_tensor() -> None:
    """``allreduce_`` keeps a small tensor's numpy view between calls: one tensor moved to new memory, then
    shrunk in place, re-strided to a non-contiguous view, its data swapped for another dtype at
    the same address, set to require grad; tensors dying between calls (ids reused); each result against numpy."""
    def vals(r: int, step: int, n: int) -> np.ndarray:
        return np.random.default_rng(500 + 37 * r + step).uniform(-4, 4, n).astype(np.float32)

    def want(step: int, n: int) -> np.ndarray:
        return np.sum([vals(r, step, n).astype(np.float64) for r in range(N)], axis=0)

    def reduce(t: torch.Tensor, step: int) -> None:
        assert hvd.allreduce_(t, name=f"changed.{step}", op=hvd.Sum) is t
        got = t.to(torch.float64).numpy()
        np.testing.assert_allclose(got, want(step, got.size), rtol=1e-6, atol=1e-5, err_msg=f"step {step}")

    t = torch.from_numpy(vals(R, 0, 8))
    reduce(t, 0)
    t.copy_(torch.from_numpy(vals(R, 1, 8)))
    reduce(t, 1)  # the kept view
    assert id(t) in hvd.mpi_ops._VIEWS, "allreduce_ kept no view of a small contiguous tensor"
    t.set_(torch.from_numpy(vals(R, 2, 4096)).clone())  # new memory (``numpy()`` made the old not resizable)
    reduce(t, 2)
    t.resize_(16)  # same memory, fewer elements
    t.copy_(torch.from_numpy(vals(R, 3, 16)))
    reduce(t, 3)
    t.as_strided_((8,), (2,))  # same address, every other element: staged and written back
    t.copy_(torch.from_numpy(vals(R, 4, 8)))
    whole = torch.empty(0).set_(t.untyped_storage(), 0, (16,))
    gaps = whole[1::2].clone()
    reduce(t, 4)
    assert torch.equal(whole[1::2], gaps), "elements outside the strided view changed"
    u = torch.from_numpy(vals(R, 5, 8))
    reduce(u, 5)
    u.data = u.data.view(torch.int32)  # same address, another dtype
    ints = torch.arange(8, dtype=torch.int32) * (R + 1)
    u.copy_(ints)
    assert hvd.allreduce_(u, name="changed.ints", op=hvd.Sum) is u
    np.testing.assert_array_equal(u.numpy(), np.arange(8) * (N * (N + 1) // 2))
    v = torch.from_numpy(vals(R, 6, 8))
    reduce(v, 6)
    v.requires_grad_()
    with torch.no_grad():
        v.copy_(torch.from_numpy(vals(R, 7, 8)))
    assert hvd.allreduce_(v, name="changed.grad", op=hvd.Min) is v
    np.testing.assert_array_equal(v.detach().numpy(), np.min([vals(r, 7, 8) for r in range(N)], axis=0))
    for step in range(8, 14):  # each tensor dies before the next: its id (and maybe its memory) is reused
        reduce(torch.from_numpy(vals(R, step, 8)), step)


@check("allreduce_autograd")
def _autograd() -> None:
    x = torch.full((3,), float(R + 1), requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum)
    (y * torch.arange(3.0)).sum().backward()
    np.testing.assert_allclose(y.detach().numpy(), [N * (N + 1) / 2] * 3)
    np.testing.assert_allclose(x.grad.numpy(), np.arange(3.0) * N)


@check("objects_barrier")
def _objects() -> None:
    assert hvd.broadcast_object({"rank": R}, root_rank=0) == {"rank": 0}
    assert hvd.allgather_object(("r", R)) == [("r", r) for r in range(N)]
    hvd.barrier()


# --------------------------------------------------------------------------------------------- training
IN, OUT_F, B, STEPS = 10, 3, 16, 8


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, 24), torch.nn.Tanh(), torch.nn.Linear(24, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, OUT_F))


def batches(global_batch: int, steps: int = STEPS, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(IN, OUT_F, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(global_batch, IN, generator=g)
        out.append((x, torch.tanh(x @ w) + 0.1 * torch.randn(global_batch, OUT_F, generator=g)))
    return out


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def train_reference(data, clip: float | None = None) -> tuple[torch.nn.Module, float]:
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = math.nan
    for x, y in data:
        opt.zero_grad()
        loss_t = loss_fn(model, x, y)
        loss_t.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        loss = loss_t.item()
    return model, loss


def train_distributed(data, k: int = 1, clip: float | None = None, **opt_kwargs) -> tuple[torch.nn.Module, float]:
    """Rank r takes its share of each global batch; with k passes, k micro-batches (loss scaled by 1/k)."""
    model = make_model(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=k,
                                   **opt_kwargs)
    loss = math.nan
    for x, y in data:
        opt.zero_grad()
        chunk = x.shape[0] // (N * k)
        total = 0.0
        for j in range(k):
            lo = (R * k + j) * chunk
            loss_t = loss_fn(model, x[lo:lo + chunk], y[lo:lo + chunk]) / k
            loss_t.backward()
            total += loss_t.item()
        if clip is not None:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        loss = float(hvd.allreduce(torch.tensor([total])).item())
    return model, loss


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, rtol: float = 1e-5) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.detach(), pb.detach(), rtol=rtol, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def assert_equal_on_all_ranks(model: torch.nn.Module) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    for r in range(N):
        assert torch.equal(gathered[r], flat), f"weights of rank {r} differ from rank {R}'s"


@check("train_matches_single_process")
def _train_equal() -> None:
    data = batches(B)
    dist, _ = train_distributed(data)
    ref, _ = train_reference(data)
    assert_same_weights(dist, ref)
    assert_equal_on_all_ranks(dist)


@check("train_grouped_matches_single_process")
def _train_grouped() -> None:
    data = batches(B)
    dist, _ = train_distributed(data, groups=2)
    ref, _ = train_reference(data)
    assert_same_weights(dist, ref)


@check("backward_passes_per_step_2")
def _bpps() -> None:
    data = batches(2 * B)
    dist, _ = train_distributed(data, k=2)
    ref, _ = train_reference(data)
    assert_same_weights(dist, ref)


@check("synchronize_clip_skip_synchronize")
def _clip() -> None:
    data = batches(B)
    dist, _ = train_distributed(data, clip=0.05, bucket_cap_mb=None)  # one allreduce per tensor
    ref, _ = train_reference(data, clip=0.05)
    assert_same_weights(dist, ref)


@check("fp16_compression_loss_within_5pct")
def _fp16() -> None:
    data = batches(B, steps=30)
    _, loss_fp16 = train_distributed(data, compression=hvd.Compression.fp16)
    _, loss_ref = train_distributed(data)
    assert abs(loss_fp16 - loss_ref) <= 0.05 * loss_ref, f"fp16 loss {loss_fp16} vs {loss_ref}"


@check("zero_grad_with_allreduce_in_flight")
def _zero_grad() -> None:
    model = make_model(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = batches(B, steps=1)[0]
    loss_fn(model, x, y).backward()
    opt.zero_grad()  # handles in flight: completed and discarded
    assert all(p.grad is None for p in model.parameters())
    loss_fn(model, x, y).backward()
    opt.step()
    assert_equal_on_all_ranks(model)


@check("broadcast_parameters")
def _bcast_params() -> None:
    model = make_model(100 + R)  # different initial weights on every rank
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert_same_weights(model, make_model(100), rtol=0)
    other = make_model(200 + R)
    hvd.broadcast_parameters(list(other.named_parameters()), root_rank=N - 1)
    assert_same_weights(other, make_model(200 + N - 1), rtol=0)


def _state_equal_everywhere(opt: torch.optim.Optimizer) -> None:
    sd = opt.state_dict()
    everyone = hvd.allgather_object(sd)
    for r, other in enumerate(everyone):
        assert other["param_groups"] == sd["param_groups"], f"param_groups of rank {r} differ"
        assert other["state"].keys() == sd["state"].keys(), f"state keys of rank {r} differ"
        for i, st in sd["state"].items():
            for key, v in st.items():
                ov = other["state"][i][key]
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, ov), f"state[{i}][{key!r}] of rank {r} differs"
                else:
                    assert v == ov, f"state[{i}][{key!r}] of rank {r} differs"


@check("broadcast_optimizer_state")
def _bcast_opt() -> None:
    for trained_rank in (0, N - 1):
        model = make_model(0)
        opt = torch.optim.Adam(model.parameters(), lr=0.01 * (R + 1))
        if R == trained_rank:  # the others' state is still empty (torch creates it lazily)
            for x, y in batches(B, steps=2, seed=R):
                opt.zero_grad()
                loss_fn(model, x, y).backward()
                opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        _state_equal_everywhere(opt)
        assert opt.param_groups[0]["lr"] == 0.01
    # a wrapped optimizer works too
    model = make_model(0)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x, y = batches(B, steps=1)[0]
    loss_fn(model, x, y).backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    _state_equal_everywhere(opt)


@check("join_uneven_batches")
def _join() -> None:
    model = make_model(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    for x, y in batches(B // N, steps=3 + 2 * R, seed=50 + R):  # rank r has 3 + 2r batches
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    last = hvd.join()
    assert 0 <= last < N, f"join returned {last}"
    hvd.barrier()


@check("keras_torch_backend_fit")
def _keras_torch() -> None:
    """spark_hvd.keras on Keras's torch backend: DistributedOptimizer + callbacks in model.fit."""
    os.environ["KERAS_BACKEND"] = "torch"
    import keras

    import spark_hvd.keras as khvd

    assert keras.backend.backend() == "torch"
    assert "tensorflow" not in sys.modules, "spark_hvd.keras imported TensorFlow on the torch backend"
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6 * B, IN)).astype(np.float32)
    y = np.tanh(x[:, :OUT_F]).astype(np.float32)
    per = B // N
    mine = np.concatenate([np.arange(s * B + R * per, s * B + (R + 1) * per) for s in range(6)])

    def model(seed: int) -> keras.Model:
        m = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(12, activation="tanh"),
                              keras.layers.Dense(OUT_F)])
        init = np.random.default_rng(seed)  # not keras.utils.set_random_seed: it would import TensorFlow
        for v in m.weights:
            v.assign(init.normal(scale=0.3, size=v.shape).astype(np.float32))
        return m

    dist = model(400 + R)  # different initial weights: the broadcast callback makes them root's
    dist.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    hist = dist.fit(x[mine], y[mine], batch_size=per, epochs=2, shuffle=False, verbose=0,
                    callbacks=[khvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               khvd.callbacks.MetricAverageCallback()])
    ref = model(400)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    ref.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(dist.weights, ref.weights, strict=True):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), rtol=1e-5,
                                   atol=1e-6, err_msg=a.path)
    losses = hvd.allgather_object(hist.history["loss"])
    assert all(v == losses[0] for v in losses), f"averaged metrics differ by rank: {losses}"
    t = khvd.allreduce(torch.full((2,), float(R)), op=khvd.Sum)
    assert torch.equal(t, torch.full((2,), float(N * (N - 1) / 2))), t


out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
with open(os.path.join(out_dir, f"torch-rank{R}.json"), "w") as f:
    json.dump({"rank": R, "size": N, "results": RESULTS}, f)
hvd.shutdown()
