"""Where each worker's rank comes from on Ray: pure functions of what the actors report (testable without Ray).

A Ray node is a host: ranks are numbered node by node (nodes in the order their first worker was created, workers
of a node in creation order), so that local ranks are contiguous as under ``spark-hvd-run -H``; the local and
cross ranks then come from the launch contract's one topology function (``spark_hvd.core.jobenv.topology``).
"""

from __future__ import annotations

from collections.abc import Sequence

from spark_hvd.core import torchrun


def rank_order(node_ids: Sequence[str]) -> list[int]:
    """Worker indices in rank order: ``rank_order(nodes)[r]`` is the worker that becomes rank ``r``."""
    nodes = list(dict.fromkeys(node_ids))
    return [i for node in nodes for i, n in enumerate(node_ids) if n == node]


def gpu_assignment(node_ids: Sequence[str], gpu_ids: Sequence[Sequence[str]]) -> list[tuple[str | None, str | None]]:
    """Per rank (``node_ids`` and ``gpu_ids`` already in rank order): ``(CUDA_VISIBLE_DEVICES, gpu)``.

    As Horovod's ``RayExecutor`` does, every worker of a node sees all the GPUs Ray gave that node's workers (so
    CUDA can use peer-to-peer between them), in local-rank order; ``gpu`` is the index of the worker's own first
    GPU among them (its local rank when every worker has one GPU), the ``JobEnv.gpu`` of the rank. A worker without
    a GPU gets ``(None, None)``; two workers of one node given the same GPU raise ``ValueError``.
    """
    per_node: dict[str, list[str]] = {}
    for node, ids in zip(node_ids, gpu_ids, strict=True):
        per_node.setdefault(node, []).extend(str(g) for g in ids)
    for node, ids in per_node.items():
        if len(ids) != len(set(ids)):
            raise ValueError(f"Ray gave two workers of node {node} the same GPU ({ids}); each needs its own")
    out: list[tuple[str | None, str | None]] = []
    for node, ids in zip(node_ids, gpu_ids, strict=True):
        if not ids:
            out.append((None, None))
            continue
        visible = torchrun.visible_devices(per_node[node])
        out.append((visible, str(per_node[node].index(str(ids[0])))))
    return out
