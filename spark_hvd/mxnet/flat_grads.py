"""A Gluon trainer's gradients in one contiguous NDArray per dtype, so that ``DistributedTrainer`` averages them
with one allreduce in their own memory.

Gluon gives every parameter a gradient NDArray of its own; reducing them one by one costs a negotiation round, a
view and a wait per parameter. :class:`FlatGrads` allocates one flat NDArray per dtype for the trainer's dense
host parameters, copies each current gradient into its slice once, and makes the slices (MXNet views: the same
memory) the parameters' gradients, the way ``Parameter._init_grad`` attaches them (``Parameter._grad`` and
``autograd.mark_variables``). Backward then writes every gradient into the flat buffer, and a step reduces the
buffer in place with one blocking allreduce: no per-parameter round, no copy, one wait for MXNet's queued
operators. ``zero_grad``, ``grad_req="add"`` and ``param.grad()`` work on the slices as on Gluon's own arrays.

Gluon replaces a parameter's gradient arrays when it re-initialises it (``reset_ctx``, ``cast``, a ``grad_req``
change, ``initialize(force_reinit=True)``): :meth:`FlatGrads.current` notices it by identity and the trainer builds
new buffers. Parameters on a GPU, on several contexts, with sparse or integer gradients, or of size 0 keep their own
arrays (:attr:`FlatGrads.rest`).

A hybridized block with ``static_shape=True`` whose backward has already run keeps writing the gradient arrays it
ran with, whatever the parameters hold afterwards (MXNet 1.9.1 does so after Gluon's own ``_init_grad`` too). So a
build marks the arrays it replaces (NaN for ``grad_req="write"``, zeros for ``"add"``) and :meth:`FlatGrads.verify`
looks at them after the next backward: written means the buffers are not what backward writes, and the parameters
get their own arrays back, with that backward's gradients (the trainer then reduces them one by one). Built before
the first backward (``DistributedTrainer`` builds when it is created, where the parameters are initialised), the
buffers are what every hybridized block binds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mxnet as mx
import numpy as np

from spark_hvd.mxnet import ndarray as nda

_NP_NDARRAY = mx.np.ndarray  # MXNet's numpy-compatible arrays (an NDArray subclass)


def _flattenable(param: Any) -> bool:
    grads = param._grad
    if not grads or len(grads) != 1:
        return False
    g = grads[0]
    return (g.stype == "default" and g.context.device_type == "cpu" and g.size > 0
            and np.dtype(g.dtype) in nda.DTYPES and np.dtype(g.dtype).kind == "f")


def _attach(param: Any, grad: Any) -> None:
    """Make ``grad`` the gradient of ``param`` (one context) as ``Parameter._init_grad`` does, keeping whether its
    gradient is fresh (marking resets that, and ``Trainer`` checks it after the step that builds the buffers)."""
    param._grad = [grad]
    data = param._check_and_get(param._data, list)
    fresh = [d._fresh_grad for d in data]
    mx.autograd.mark_variables(data, param._grad, param.grad_req)
    for d, f in zip(data, fresh, strict=True):
        d._fresh_grad = f


class FlatGrads:
    """The gradients of ``params`` (Gluon ``Parameter`` s with a gradient, in the trainer's order) as slices of one
    flat NDArray per dtype.

    Attributes:
        buffers: the flat NDArrays, one per dtype (and CPU context), in the order of their first parameter.
        views: a writable numpy array over each buffer's memory (what the core reduces).
        rest: the parameters left with their own gradient arrays (see the module's docstring).
    """

    def __init__(self, params: Sequence[Any]) -> None:
        self._params = list(params)
        self.rest = [p for p in self._params if not _flattenable(p)]
        groups: dict[tuple[np.dtype, Any], list[Any]] = {}  # by dtype and context (a rank may train on cpu(rank))
        for p in self._params:
            if _flattenable(p):
                groups.setdefault((np.dtype(p._grad[0].dtype), p._grad[0].context), []).append(p)
        self.buffers: list[Any] = []
        self._slices: list[tuple[Any, Any]] = []  # (parameter, its gradient: a view of a buffer)
        self._replaced: list[tuple[Any, Any, Any]] = []  # (parameter, its former gradient, the view), until verify()
        with mx.autograd.pause():
            for (dtype, ctx), members in groups.items():
                flat = mx.nd.zeros((sum(p._grad[0].size for p in members),), ctx=ctx, dtype=dtype)
                at = 0
                for p in members:
                    old = p._grad[0]
                    view = flat[at:at + old.size].reshape(old.shape)
                    if isinstance(old, _NP_NDARRAY):
                        view = view.as_np_ndarray()
                    view[:] = old  # what backward has already written (a step's gradients, or grad_req="add")
                    old[:] = np.nan if p.grad_req == "write" else 0.0  # verify() sees whether backward writes it
                    _attach(p, view)
                    self._slices.append((p, view))
                    self._replaced.append((p, old, view))
                    at += old.size
                self.buffers.append(flat)
        nda.wait_all()
        self.views = [nda.write_view(flat, waited=True) for flat in self.buffers]

    def verify(self) -> bool:
        """After the first backward since the build (later calls: True at once): True when backward wrote the
        buffers; False when it wrote the arrays they replaced (a ``static_shape`` block bound before the build),
        after giving those arrays back to their parameters with this backward's gradients."""
        replaced, self._replaced = self._replaced, []
        if not replaced:
            return True
        nda.wait_all()
        stale = False
        for p, old, _ in replaced:
            values = old.asnumpy()
            stale = stale or (not np.isnan(values).all() if p.grad_req == "write" else bool(values.any()))
        if not stale:
            return True
        with mx.autograd.pause():
            for p, old, view in replaced:
                if p.grad_req == "add":
                    old += view  # backward added into ``old`` (zeroed at the build); ``view`` holds what came before
                _attach(p, old)
        self.buffers, self.views, self._slices = [], [], []
        return False

    def current(self, params: Sequence[Any]) -> bool:
        """Whether these buffers still hold the gradients of ``params``: the same parameters, none of whose
        gradient arrays Gluon has replaced since."""
        if len(params) != len(self._params) or any(a is not b for a, b in zip(params, self._params, strict=True)):
            return False
        for p, view in self._slices:
            grads = p._grad
            if grads is None or len(grads) != 1 or grads[0] is not view:
                return False
        return all(not _flattenable(p) for p in self.rest)
