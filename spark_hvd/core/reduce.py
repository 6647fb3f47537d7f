"""Element-wise reductions shared by every backend: in place, with numpy ufuncs and ``out=``.

bfloat16 arrives as a ``uint16`` view of the raw bits: it is widened to float32 (exact), reduced there, and
rounded back to bfloat16 with round-to-nearest-even (NaN stays NaN).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from spark_hvd.core.backend import ReduceOp

SUPPORTED_DTYPES = frozenset(np.dtype(t) for t in
                             (np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.uint16,
                              np.int8, np.int16, np.uint32, np.uint64))

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVERAGE: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


#: the element-wise reductions, which every backend runs itself (``ReduceOp.ADASUM`` is not one: the host group runs
#: it over the backend's collectives, ``spark_hvd.core.algorithms.adasum``)
ELEMENTWISE_OPS = tuple(op for op in ReduceOp if op in _UFUNCS)  # in the enum's order


def ufunc_for(op: ReduceOp) -> np.ufunc:
    """The numpy ufunc that combines two partial results of ``op`` (AVERAGE sums; divide at the end)."""
    return _UFUNCS[op]


def check_dtype(buf: np.ndarray, bfloat16: bool = False) -> None:
    """Raise ``TypeError`` for a dtype the collectives cannot reduce."""
    if bfloat16 and buf.dtype != np.uint16:
        raise TypeError(f"bfloat16 buffers must be passed as a uint16 view, got {buf.dtype}")
    if buf.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"cannot reduce arrays of dtype {buf.dtype}; supported: float16/32/64, int32/64, uint8, "
                        "and bfloat16 as a uint16 view")


def reduce_widened(buf: np.ndarray, bfloat16: bool, reduce: Callable[[np.ndarray], None]) -> bool:
    """For a float16 buffer, or a bfloat16 one (its uint16 view): ``reduce`` a float32 copy, then narrow the
    result back into ``buf`` (for backends without half-precision reductions); returns True. Other dtypes: nothing
    is done, False."""
    if not (bfloat16 or buf.dtype == np.float16):
        return False
    wide = bf16_to_f32(buf) if bfloat16 else buf.astype(np.float32)
    reduce(wide)
    if bfloat16:
        f32_to_bf16(wide, buf)
    else:
        buf[...] = wide
    return True


def bf16_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen raw bfloat16 bits (uint16) to float32 (exact)."""
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    wide = out.view(np.uint32)
    np.left_shift(bits, 16, out=wide, dtype=np.uint32)
    return out


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round float32 ``values`` to bfloat16 bits in ``out`` (uint16), nearest-even; NaN stays a quiet NaN.

    ``values`` is used as scratch (its contents are destroyed).
    """
    nan = np.isnan(values)
    bits = values.view(np.uint32)
    lsb = np.right_shift(bits, 16) & np.uint32(1)
    lsb += np.uint32(0x7FFF)
    bits += lsb  # wraps only for NaN payloads, which are replaced below
    np.right_shift(bits, 16, out=bits)
    out[...] = bits  # same-kind narrowing of values < 2**16
    if nan.any():
        out[nan] = np.uint16(0x7FC0) | (out[nan] & np.uint16(0x8000))
    return out


def reduce_into(acc: np.ndarray, other: np.ndarray, op: ReduceOp, bfloat16: bool = False) -> None:
    """``acc = op(acc, other)`` element-wise, in place (AVERAGE sums: call ``divide_average`` at the end)."""
    ufunc = _UFUNCS[op]
    if bfloat16:
        wide = bf16_to_f32(acc)
        ufunc(wide, bf16_to_f32(other), out=wide)
        f32_to_bf16(wide, acc)
    else:
        ufunc(acc, other, out=acc)


def scale_inplace(buf: np.ndarray, factor: float, bfloat16: bool = False) -> None:
    """``buf *= factor`` in place; integers are truncated toward zero (as Horovod does)."""
    if factor != 1.0:
        _by_scalar(np.multiply, buf, factor, bfloat16)


def divide_average(buf: np.ndarray, size: int, bfloat16: bool = False) -> None:
    """Turn a sum over ``size`` ranks into their average, in place (integers truncate toward zero)."""
    if size != 1:
        _by_scalar(np.divide, buf, size, bfloat16)


def _by_scalar(ufunc: np.ufunc, buf: np.ndarray, value: float, bfloat16: bool) -> None:
    """``buf = ufunc(buf, value)`` in place: bfloat16 and float16 computed in float32 and rounded once (as Horovod
    does; for float16 the same bits as float16 arithmetic where ``value`` is a float16, as a rank count is), other
    floats in their own dtype, integers in float64 and truncated toward zero."""
    if bfloat16:
        wide = bf16_to_f32(buf)
        ufunc(wide, np.float32(value), out=wide)
        f32_to_bf16(wide, buf)
    elif buf.dtype == np.float16:  # not by a float16 factor: 0.1 would be rounded to float16 first
        ufunc(buf, np.float32(value), out=buf, dtype=np.float32, casting="unsafe")
    elif buf.dtype.kind == "f":
        ufunc(buf, buf.dtype.type(value), out=buf)
    else:
        buf[...] = np.trunc(ufunc(buf, np.float64(value)))


def reference_reduce(arrays: list[np.ndarray], op: ReduceOp, bfloat16: bool = False) -> np.ndarray:
    """The expected result of an allreduce of ``arrays`` (one per rank, in rank order), for tests.

    Reduces in rank order like the ring's reduce-scatter does, so the float results match bit for bit
    where the ring's order is the same and closely otherwise.
    """
    acc = arrays[0].copy()
    for other in arrays[1:]:
        reduce_into(acc, other, op, bfloat16)
    if op is ReduceOp.AVERAGE:
        divide_average(acc, len(arrays), bfloat16)
    return acc
