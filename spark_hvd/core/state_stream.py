"""An elastic state of any size, sent and fetched in bounded chunks (no copy of the whole state in one frame).

``encode`` pickles a snapshot with protocol 5 and out-of-band buffers: numpy arrays (and CPU torch tensors, seen
as numpy arrays without a copy) leave the pickle stream as raw buffers, so the stream itself stays small and the
tensors' memory is sent as it is, chunk by chunk. ``upload`` sends the parts through a ``put`` function and
``download`` rebuilds the value from a ``get`` function; ``spark_hvd.core.elastic`` wires them to the driver link.

``core`` imports no framework: a torch tensor is recognised only when torch is already imported.
"""

from __future__ import annotations

import io
import pickle
import sys
from collections.abc import Callable
from typing import Any

#: Bytes per chunk: well under the driver service's 64 MiB frames, large enough that the round trips are few.
CHUNK_BYTES = 8 << 20


def _from_numpy(array: Any) -> Any:
    import torch

    return torch.from_numpy(array)


class _Pickler(pickle.Pickler):
    """Protocol 5 with CPU torch tensors turned into numpy arrays (which pickle out-of-band without a copy)."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is None or type(obj) is not torch.Tensor:
            return NotImplemented
        if obj.device.type != "cpu" or obj.requires_grad or obj.is_sparse or obj.dtype == torch.bfloat16:
            return NotImplemented
        return _from_numpy, (obj.numpy(),)


def encode(value: Any) -> list[memoryview]:
    """``value`` as parts: the pickle stream first, then its out-of-band buffers (views, not copies)."""
    buffers: list[memoryview] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=lambda b: buffers.append(b.raw())).dump(value)
    return [stream.getbuffer(), *buffers]


def decode(parts: list[bytearray]) -> Any:
    """The value that ``encode`` gave ``parts`` of."""
    return pickle.loads(parts[0], buffers=parts[1:])


def upload(parts: list[memoryview], put: Callable[[int, bytes], None], chunk: int | None = None) -> list[int]:
    """Send ``parts`` back to back through ``put(seq, data)`` in chunks of at most ``chunk`` bytes; returns the
    parts' sizes (what ``download`` needs)."""
    chunk = chunk or CHUNK_BYTES
    seq = 0
    for part in parts:
        view = part.cast("B")
        for start in range(0, len(view), chunk):
            put(seq, bytes(view[start:start + chunk]))
            seq += 1
    return [part.nbytes for part in parts]


def download(sizes: list[int], get: Callable[[int, int], bytes], chunk: int | None = None) -> Any:
    """Fetch parts of ``sizes`` through ``get(offset, nbytes)`` (offsets into their concatenation), decode them."""
    chunk = chunk or CHUNK_BYTES
    parts: list[bytearray] = []
    offset = 0
    for size in sizes:
        part = bytearray(size)
        pos = 0
        while pos < size:
            data = get(offset + pos, min(chunk, size - pos))
            if not data:
                raise EOFError(f"the committed state ended at byte {offset + pos}, {size - pos} bytes short of a part")
            part[pos:pos + len(data)] = data
            pos += len(data)
        offset += size
        parts.append(part)
    return decode(parts)
