"""Small Parquet datasets for the reader tests (imported by the test modules of this directory)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def write_dataset(path, n_rows, n_files=3, row_group_size=40, width=4, seed=0):
    """Files with an ``id`` column, a float ``x``, a bool ``flag`` and a list column ``v`` (v[i] = id + i)."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, n_rows, n_files + 1).astype(int)
    for f, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        ids = np.arange(lo, hi, dtype=np.int64)
        v = (ids[:, None] + np.arange(width)[None, :]).astype(np.float32)
        table = pa.table(
            {
                "id": ids,
                "x": rng.standard_normal(len(ids)),
                "flag": ids % 2 == 0,
                "v": pa.ListArray.from_arrays(np.arange(0, len(ids) * width + 1, width, dtype=np.int32), v.ravel()),
            }
        )
        pq.write_table(table, str(path / f"part-{f:03d}.parquet"), row_group_size=row_group_size)
    return str(path)
