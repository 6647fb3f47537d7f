"""A DataFrame's content key for the prepared-data cache: stable where it can be proved, never stale.

``DataFrame.semanticHash`` is not stable enough: a ``ScalaUDF`` (``VectorAssembler``, ``StandardScalerModel`` ...)
hashes its function object by identity, so every ``Pipeline.fit`` gave a new key and wrote a new copy of the same
data. :func:`plan_key` describes the *canonicalised* analyzed plan instead (expression ids normalised by Spark, no-op
operators removed: ``compat.analyzed_plan``), as Spark's own JSON rendering of the tree, and adds what that
rendering leaves out (its ``null`` fields):

- a ``ScalaUDF``'s function and a Python UDF's command, as a digest of their serialized bytes (the captured values,
  e.g. ``VectorAssembler``'s ``handleInvalid``, are in them);
- a file source (``LogicalRelation`` over a file index): its format, its options and every file's path, size and
  modification time, so files rewritten in place give a new key;
- an in-memory local relation (``createDataFrame`` from pandas): its content hash (Spark's, as ``semanticHash``);
- an RDD-backed relation (``createDataFrame`` from a list, ``df.checkpoint()``): the RDD's id *and this Spark
  application's id*: it cannot be recognised in another session, so it is not.

One thing the rendering shows is left out: a Spark ML stage's uid in the field names of a struct built only to be
handed to a ``ScalaUDF`` (``VectorAssembler`` casts a non-double input ``c`` to ``c_double_<its uid>``, the UDF
reads the struct by position), so a new assembler instance over the same data gives the same key.

A Spark Connect DataFrame (no JVM objects on the client) is described by its Connect plan (protobuf), made
independent of the session that built it: its plan ids renumbered in order of appearance (they count the client's
plans), call-site ``origin`` left out, the uid of a Spark ML transformer (``VectorAssembler``) left out. Its sources
must be ones whose content the key can cover: files (a ``read`` of paths: the files it reads, ``inputFiles()``, and
their sizes and modification times, listed by the server), a local relation (its data is in the plan, or its
content hash), a ``range``; anything else (a table, SQL text, a fitted model held by the server, a relation kind
not known here) falls back to the session-scoped key. Two Connect sessions on the same files thus share the cache.

Anything else the rendering cannot show (a node kind not listed above) falls back to ``semanticHash`` scoped to the
Spark application (or Connect session): it may miss the cache, it never hits it wrongly across sessions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import TYPE_CHECKING, Any

from spark_hvd.data import compat

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame

logger = logging.getLogger(__name__)

_FILE_STATUS = re.compile(r"path=([^;]*);.*?length=(\d+);.*?modification_time=(\d+);")

# (node class, field) pairs that Spark renders as null and that plan_key covers by other means
_COVERED = {
    ("ScalaUDF", "function"),
    ("PythonUDF", "func"),
    ("LogicalRelation", "relation"),
    ("LogicalRDD", "rdd"),
    ("LogicalRDD", "session"),
    ("LocalRelation", "data"),
    ("Cast", "evalMode"),  # from spark.sql.ansi.enabled, which the key includes
}
_CONFS = ("spark.sql.ansi.enabled", "spark.sql.session.timeZone", "spark.sql.caseSensitive")
# a struct field name VectorAssembler derives from its uid: "<column>_double_<Class>_<12 hex digits>"
_STAGE_UID_NAME = re.compile(r"^(.*_double_)[A-Za-z]\w*_[0-9a-f]{12}$")
_EXPR = "org.apache.spark.sql.catalyst.expressions."


def plan_key(df: DataFrame) -> dict[str, Any]:
    """A JSON-able description of what ``df`` computes (see the module docstring); hash it for a cache key."""
    jdf = getattr(df, "_jdf", None)
    if jdf is None:  # Spark Connect: no JVM objects here
        try:
            return _connect_key(df)
        except _Uncovered as exc:
            return _session_scoped(df, f"spark connect: {exc}")
        except Exception as exc:  # a pyspark whose Connect plan differs: stay correct, lose the cross-session hits
            logger.debug("Connect plan fingerprint failed (%s); using semanticHash for this session only", exc)
            return _session_scoped(df, f"spark connect: {type(exc).__name__}: {exc}")
    try:
        return _classic_key(df, jdf)
    except _Uncovered as exc:
        return _session_scoped(df, str(exc))
    except Exception as exc:  # a Spark version whose internals differ: stay correct, lose the cross-fit hits
        logger.debug("plan fingerprint failed (%s); using semanticHash for this session only", exc)
        return _session_scoped(df, f"{type(exc).__name__}: {exc}")


class _Uncovered(Exception):
    pass


def _session_scoped(df: DataFrame, why: str) -> dict[str, Any]:
    try:
        plan_hash: Any = int(df.semanticHash())
    except Exception:  # pragma: no cover - a DataFrame without an analyzed plan hash
        plan_hash = None
    logger.debug("prepared-data key is valid in this Spark application only (%s)", why)
    return {"semantic_hash": plan_hash, "session": _session_id(df)}


def _session_id(df: DataFrame) -> str:
    session = df.sparkSession
    for get in (
        lambda: session.sparkContext.applicationId + "@" + str(session.sparkContext.startTime),
        lambda: session.session_id,  # Connect
    ):
        try:
            return str(get())
        except Exception:
            continue
    return str(id(session))  # pragma: no cover


def _classic_key(df: DataFrame, jdf: Any) -> dict[str, Any]:
    jvm = df.sparkSession.sparkContext._jvm
    plan = compat.analyzed_plan(jvm, jdf).canonicalized()
    nodes = json.loads(plan.toJSON())
    uncovered = sorted(_null_fields(nodes) - _COVERED)
    _drop_stage_uids(nodes)
    if uncovered:
        raise _Uncovered("plan holds fields Spark cannot render: " + ", ".join(f"{c}.{f}" for c, f in uncovered))
    extras: list[Any] = []
    _walk_plan(plan, jvm, df, extras)
    conf = df.sparkSession.conf
    return {
        "plan": hashlib.sha256(json.dumps(nodes, sort_keys=True).encode()).hexdigest(),
        "extras": extras,
        "conf": {k: _conf(conf, k) for k in _CONFS},
    }


def _null_fields(node: Any, out: set[tuple[str, str]] | None = None) -> set[tuple[str, str]]:
    """(class, field) of every null field of a tree node in Spark's JSON; drops per-JVM ids in place."""
    out = set() if out is None else out
    if isinstance(node, list):
        for item in node:
            _null_fields(item, out)
    elif isinstance(node, dict):
        node.pop("jvmId", None)
        cls = node.get("class")
        for field, value in node.items():
            if value is None and isinstance(cls, str):
                out.add((cls.rsplit(".", 1)[-1], field))
            else:
                _null_fields(value, out)
    return out


def _drop_stage_uids(node: Any) -> None:
    """In every flattened expression of Spark's JSON (a pre-order list of nodes with ``num-children``), replace
    the stage uid in the field names of a struct that is a ``ScalaUDF``'s argument (module docstring)."""
    if isinstance(node, dict):
        for value in node.values():
            _drop_stage_uids(value)
        return
    if not isinstance(node, list):
        return
    if node and all(isinstance(n, dict) and "num-children" in n for n in node):
        for i, n in enumerate(node):
            if n.get("class") == _EXPR + "ScalaUDF":
                for child in _children(node, i):
                    if node[child].get("class") == _EXPR + "CreateNamedStruct":
                        for name in _children(node, child)[0::2]:
                            lit = node[name]
                            if lit.get("class") == _EXPR + "Literal" and isinstance(lit.get("value"), str):
                                lit["value"] = _STAGE_UID_NAME.sub(r"\1<stage uid>", lit["value"])
    for item in node:
        _drop_stage_uids(item)


def _children(nodes: list[dict], i: int) -> list[int]:
    """Indices of the children of ``nodes[i]`` in a pre-order list of nodes."""
    out, j = [], i + 1
    for _ in range(int(nodes[i].get("num-children", 0))):
        out.append(j)
        j += _subtree_size(nodes, j)
    return out


def _subtree_size(nodes: list[dict], i: int) -> int:
    size, pending = 0, 1
    while pending:
        pending += int(nodes[i + size].get("num-children", 0)) - 1
        size += 1
    return size


def _seq(seq: Any) -> list[Any]:
    return [seq.apply(i) for i in range(seq.size())]


def _digest(jvm: Any, obj: Any) -> str:
    return hashlib.sha256(bytes(jvm.org.apache.spark.util.Utils.serialize(obj))).hexdigest()


def _walk_plan(plan: Any, jvm: Any, df: DataFrame, extras: list[Any]) -> None:
    kind = plan.getClass().getSimpleName()
    if kind == "LogicalRelation":
        extras.append(_file_relation(plan.relation()))
    elif kind == "LogicalRDD":
        extras.append({"rdd": int(plan.rdd().id()), "session": _session_id(df)})
    elif kind == "LocalRelation":
        extras.append({"local": int(plan.semanticHash())})
    for expr in _seq(plan.expressions()):
        _walk_expr(expr, jvm, extras)
    for child in _seq(plan.children()):
        _walk_plan(child, jvm, df, extras)


def _walk_expr(expr: Any, jvm: Any, extras: list[Any]) -> None:
    kind = expr.getClass().getSimpleName()
    if kind == "ScalaUDF":
        extras.append({"scala_udf": _digest(jvm, expr.function())})
    elif kind == "PythonUDF":
        func = expr.func()
        extras.append({"python_udf": _digest(jvm, func.command()), "exec": str(func.pythonExec())})
    for child in _seq(expr.children()):
        _walk_expr(child, jvm, extras)


def _file_relation(relation: Any) -> dict[str, Any]:
    if relation.getClass().getSimpleName() != "HadoopFsRelation":
        raise _Uncovered(f"a {relation.getClass().getSimpleName()} source")
    # one py4j call for the whole listing (Hadoop's FileStatus.toString names path, length and modification_time)
    listing = str(relation.location().allFiles().mkString("\n"))
    files = sorted(_FILE_STATUS.findall(listing))
    if len(files) != (listing.count("\n") + 1 if listing else 0):
        raise _Uncovered("a file listing in an unknown format")
    return {
        "format": str(relation.fileFormat().toString()),
        "options": str(relation.options().toString()),
        "files": hashlib.sha256(json.dumps(files).encode()).hexdigest(),
        "num_files": len(files),
    }


def _conf(conf: Any, key: str) -> str | None:
    try:
        return conf.get(key)
    except Exception:  # not set and no default
        return None


# ---------------------------------------------------------------------------------------------- Spark Connect
#: Connect relation kinds that compute from their inputs only (their inputs are walked and checked too)
_CONNECT_PURE = frozenset({
    "project", "filter", "join", "set_op", "sort", "limit", "aggregate", "sample", "offset", "deduplicate",
    "subquery_alias", "repartition", "to_df", "with_columns_renamed", "drop", "tail", "with_columns", "hint",
    "unpivot", "to_schema", "repartition_by_expression", "map_partitions", "parse", "group_map", "co_group_map",
    "as_of_join", "with_relations", "transpose", "lateral_join", "fill_na", "drop_na", "replace", "sample_by",
})
#: Connect sources whose content is in the plan (or its content hash) or implied by it
_CONNECT_CONTENT = frozenset({"range", "local_relation", "cached_local_relation", "chunked_cached_local_relation"})


def _connect_key(df: DataFrame) -> dict[str, Any]:
    session = df.sparkSession
    plan = df._plan.to_proto(session.client)
    reads_files = _canonical_connect(plan, {})
    files: list[list[str]] = []
    if reads_files:
        paths = sorted(str(p) for p in df.inputFiles())
        if paths:
            listing = session.read.format("binaryFile").load(paths).select("path", "length", "modificationTime")
            files = sorted([str(r[0]), str(r[1]), str(r[2])] for r in listing.collect())
            if len(files) != len(paths):
                raise _Uncovered(f"{len(paths)} input files but {len(files)} listed")
    conf = session.conf
    return {
        "connect_plan": hashlib.sha256(plan.SerializeToString(deterministic=True)).hexdigest(),
        "files": hashlib.sha256(json.dumps(files).encode()).hexdigest(),
        "num_files": len(files),
        "conf": {k: _conf(conf, k) for k in _CONFS},
    }


def _canonical_connect(msg: Any, ids: dict[int, int]) -> bool:
    """Make a Connect plan message session-independent in place (module docstring); raise ``_Uncovered`` for a
    source the key cannot cover. True when it reads files."""
    files = False
    name = msg.DESCRIPTOR.full_name
    if name == "spark.connect.Relation":
        kind = msg.WhichOneof("rel_type")
        if kind == "read":
            source = msg.read.WhichOneof("read_type")
            if source != "data_source" or not msg.read.data_source.paths:
                raise _Uncovered(f"a {'table' if source == 'named_table' else 'data source'} read")
            files = True
        elif kind == "ml_relation":
            ml = msg.ml_relation
            if ml.WhichOneof("ml_type") != "transform" or ml.transform.WhichOneof("operator") != "transformer":
                raise _Uncovered("a Spark ML object held by the server")
            ml.transform.transformer.ClearField("uid")
        elif kind not in _CONNECT_PURE and kind not in _CONNECT_CONTENT:
            raise _Uncovered(f"a {kind} relation")
    for field, value in msg.ListFields():
        if field.name == "origin" and field.message_type is not None:
            msg.ClearField("origin")
        elif field.name == "plan_id" and field.message_type is None:
            msg.plan_id = ids.setdefault(int(value), len(ids) + 1)  # 0 may be unset (proto3 default): kept
        elif field.message_type is None:
            continue
        elif field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            if entry.message_type is not None:
                for key in sorted(value):
                    files |= _canonical_connect(value[key], ids)
        elif (field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED):
            for item in value:
                files |= _canonical_connect(item, ids)
        else:
            files |= _canonical_connect(value, ids)
    return files
