"""Driver and Spark's Python workers: a prepared dataset's Parquet files written by the workers with pyarrow.

Spark's own Parquet writer runs in the JVM, and the JVM's first Parquet write of a session is its slowest by far
(its classes loaded and compiled: seconds on a 2-core machine, ``benchmarks/RESULTS.md``), a cost a
``TorchDistributor`` user never pays. A first fit's Python workers are warm already (they convert the
DataFrame's batches to Arrow for every ``mapInArrow``), so :func:`write_splits` writes the files there, in one
job for both splits. Each split is shuffled into ``num_parts`` partitions as Spark's writer has it
(``repartition``), and those are coalesced into one task per training process: a task writes its partitions one
after the other, each as ``<split>/part-<partition>.parquet``. The files hold the rows Spark's writer puts in its
``part-<partition>-<uuid>-c000.<codec>.parquet``, in the same order, so a fit trains on the same batches either way;
a Python task costs 0.15-0.35 s of scheduling and Arrow set-up on a loaded 2-core machine, against 5-20 ms to write
6,250 rows (``benchmarks/RESULTS.md``), hence fewer tasks than files.

The files hold what Spark's writer would write for the same rows: Spark's standard list layout
(``<column>.list.element``), the codec asked for, float columns without a dictionary, row groups cut at the same
byte size (Spark's 128 MiB, or ``row_group_bytes``), and Spark's schema in the footer
(``org.apache.spark.sql.parquet.row.metadata``), so ``spark.read.parquet`` reads them back with the DataFrame's
types. Each task writes a hidden file (``._tmp-...``, which readers skip) and renames it into place when it is
complete; a failing task deletes its own, and the driver deletes any a killed worker left before it commits.

It runs where the workers can write the store as the driver does and rename files in it: a
:class:`~spark_hvd.store.local.LocalStore` (a local or shared mounted path), not a FUSE mount (DBFS, Unity Catalog
volumes: Spark's writes are polled for there), HDFS or an object store; for Vector columns kept sparse (a
``VectorUDT`` has no Arrow form); for the codecs pyarrow writes as Spark names them. ``prepare_data`` falls back to
Spark's writer otherwise, or when ``SPARK_HVD_PREPARE_WRITER=jvm``.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from spark_hvd.store import Store

#: Spark's codec names -> pyarrow's, for the codecs both write the same way (Spark's ``lz4`` is Hadoop's framing,
#: not Parquet's ``LZ4_RAW``: left to Spark)
CODECS = {"snappy": "snappy", "gzip": "gzip", "zstd": "zstd", "none": "none", "uncompressed": "none"}
#: Spark's default Parquet row group size (``parquet.block.size``)
SPARK_ROW_GROUP_BYTES = 128 << 20
#: The footer key under which Spark records a file's schema
SPARK_SCHEMA_KEY = b"org.apache.spark.sql.parquet.row.metadata"
#: Names of files being written (pyarrow.dataset and Spark skip names starting with '.' or '_')
TMP_PART = "._tmp-part-"
#: The tasks' answer: one row per file written
RESULT_SCHEMA = "split string, part int, rows long"
#: Columns the tasks get beside the data: the partition of ``repartition(num_parts)``, the split's index
PART_COL, SPLIT_COL = "__spark_hvd_part__", "__spark_hvd_split__"


def chosen(store: Store, kinds: Sequence[str], compression: str) -> bool:
    """Whether the dataset is written by the Python workers (else by Spark's writer); see the module docstring."""
    from spark_hvd.store.fuse import FuseStore
    from spark_hvd.store.local import LocalStore

    mode = os.environ.get("SPARK_HVD_PREPARE_WRITER", "auto").lower()
    if mode == "jvm":
        return False
    return (isinstance(store, LocalStore) and not isinstance(store, FuseStore) and "sparse" not in kinds
            and compression.lower() in CODECS)


def write_splits(splits: dict[str, DataFrame], store: Store, target: str, num_parts: int, tasks: int,
                 compression: str, plain_paths: Sequence[str], row_group_bytes: int | None) -> dict[str, int]:
    """Write each DataFrame of ``splits`` (``{"train": df, "val": df}``) as ``num_parts`` files under
    ``target/<split>`` from the Python workers, in one Spark job of about ``tasks`` tasks per split; returns each
    split's row count as the writers' footers hold it. ``plain_paths``: Parquet column paths written without a
    dictionary."""
    import functools
    import json

    from pyspark.sql import functions as F

    names = list(splits)
    frames = []
    for index, (split, sdf) in enumerate(splits.items()):
        store._makedirs(posixpath.join(target, split))
        tagged = sdf.repartition(num_parts).select("*", F.spark_partition_id().alias(PART_COL),
                                                   F.lit(index).cast("int").alias(SPLIT_COL))
        frames.append(tagged.coalesce(max(1, min(tasks, num_parts))))
    fields = json.loads(next(iter(splits.values())).schema.json())["fields"]
    writer = _Writer(store, target, CODECS[compression.lower()], tuple(plain_paths),
                     int(row_group_bytes or SPARK_ROW_GROUP_BYTES), names,
                     json.dumps({"type": "struct", "fields": fields}, separators=(",", ":")))
    rows = functools.reduce(lambda a, b: a.union(b), frames).mapInArrow(writer, RESULT_SCHEMA).collect()
    counts = dict.fromkeys(names, 0)
    for r in rows:
        counts[r["split"]] += int(r["rows"])
    fs = store.pyarrow_filesystem()
    for split in names:  # a killed worker's file (a failing task deletes its own)
        for info in fs.get_file_info(_selector(posixpath.join(target, split))):
            if info.base_name.startswith(TMP_PART):
                fs.delete_file(info.path)
    return counts


def _selector(path: str) -> Any:
    import pyarrow.fs as pafs

    return pafs.FileSelector(path, allow_not_found=True)


class _Writer:
    """The ``mapInArrow`` function: writes each partition that reaches it (its rows arrive one partition after
    the other) as one file; answers ``(split, part, rows)`` per file."""

    def __init__(self, store: Store, target: str, codec: str, plain_paths: tuple[str, ...], group_bytes: int,
                 splits: list[str], spark_schema: str) -> None:
        self.store, self.target, self.codec, self.plain_paths = store, target, codec, plain_paths
        self.group_bytes, self.splits, self.spark_schema = group_bytes, splits, spark_schema

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import numpy as np
        import pyarrow as pa

        done: list[tuple[str, int, int]] = []
        current: _PartFile | None = None
        try:
            for batch in batches:
                if not batch.num_rows:
                    continue
                names = batch.schema.names
                keep = [i for i, name in enumerate(names) if name not in (PART_COL, SPLIT_COL)]
                data = pa.RecordBatch.from_arrays([batch.column(i) for i in keep],
                                                  schema=pa.schema([batch.schema.field(i) for i in keep]))
                part = batch.column(names.index(PART_COL)).to_numpy()
                split = batch.column(names.index(SPLIT_COL)).to_numpy()
                starts = [0, *(np.flatnonzero((np.diff(part) != 0) | (np.diff(split) != 0)) + 1).tolist()]
                for start, end in zip(starts, [*starts[1:], batch.num_rows], strict=True):
                    key = (self.splits[int(split[start])], int(part[start]))
                    if current is None or (current.split, current.part) != key:
                        if current is not None:
                            done.append((current.split, current.part, current.close()))
                        current = _PartFile(self, *key)
                    current.add(data.slice(start, end - start))
            if current is not None:
                done.append((current.split, current.part, current.close()))
                current = None
        except BaseException:
            if current is not None:
                current.abort()
            raise
        yield pa.RecordBatch.from_pydict({"split": [d[0] for d in done], "part": [d[1] for d in done],
                                          "rows": [d[2] for d in done]},
                                         schema=pa.schema([("split", pa.string()), ("part", pa.int32()),
                                                           ("rows", pa.int64())]))


class _PartFile:
    """One partition's file: row groups of about ``group_bytes`` (buffered batches' Arrow size), written to a
    hidden name and renamed into place by :meth:`close`; nothing is created for no rows."""

    def __init__(self, writer: _Writer, split: str, part: int) -> None:
        self.w, self.split, self.part = writer, split, part
        self.final = posixpath.join(writer.target, split, f"part-{part:05d}.parquet")
        self.tmp = posixpath.join(writer.target, split, f"{TMP_PART}{part:05d}-{uuid.uuid4().hex[:12]}.parquet")
        self.pending: list[pa.RecordBatch] = []
        self.pending_bytes = 0
        self.rows = 0
        self.out: Any = None

    def add(self, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        self.pending.append(batch)
        self.pending_bytes += batch.nbytes
        if self.pending_bytes >= self.w.group_bytes:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.pending:
            return
        table = pa.Table.from_batches(self.pending)
        if self.out is None:
            schema = table.schema.with_metadata({SPARK_SCHEMA_KEY: self.w.spark_schema.encode()})
            plain = set(self.w.plain_paths)
            dictionary = [c for c in _leaf_paths(schema) if c not in plain]
            self.out = pq.ParquetWriter(self.tmp, schema, filesystem=self.w.store.pyarrow_filesystem(),
                                        compression=self.w.codec, use_dictionary=dictionary or False,
                                        write_statistics=True)
        self.out.write_table(table.replace_schema_metadata(self.out.schema.metadata),
                             row_group_size=table.num_rows)
        self.rows += table.num_rows
        self.pending, self.pending_bytes = [], 0

    def close(self) -> int:
        """Write what is buffered, close, rename into place; the file's row count (its footer's)."""
        self._flush()
        if self.out is None:
            return 0
        self.out.close()
        fs = self.w.store.pyarrow_filesystem()
        fs.move(self.tmp, self.final)
        return self.rows

    def abort(self) -> None:
        """Delete the hidden file (a failed task leaves nothing)."""
        try:
            if self.out is not None:
                self.out.close()
        except Exception:  # noqa: BLE001 - the task fails anyway; the file goes below
            pass
        try:
            self.w.store.pyarrow_filesystem().delete_file(self.tmp)
        except (FileNotFoundError, OSError):
            pass


def _leaf_paths(schema: pa.Schema) -> list[str]:
    """The Parquet column paths of an Arrow schema's leaves (lists in the standard ``.list.element`` layout)."""
    import pyarrow as pa

    def walk(prefix: str, typ: Any) -> Iterator[str]:
        if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
            yield from walk(prefix + ".list.element", typ.value_type)
        elif pa.types.is_struct(typ):
            for f in typ:
                yield from walk(prefix + "." + f.name, f.type)
        else:
            yield prefix

    return [p for f in schema for p in walk(f.name, f.type)]
