"""Recursive doubling: a log-depth allreduce for small arrays, written against a three-call peer interface.

The ring takes 2(N-1) steps, each one message latency; for a small array the latency is all there is, so at
N = 8 the ring pays 14 latencies where recursive doubling pays 3. Every member exchanges its whole array with the
member whose position differs in bit k, for k = 0 .. log2(P)-1, reducing what it receives into its own; after the
last step every member holds the reduction (gloo's ``allreduce_halving_doubling`` and MPICH's small-message
allreduce take this shape). A member count that is not a power of two, N = P + R (P the largest power of two below
N): the first 2R members pair up, each even one hands its array to the odd one beside it and sits out, the P that
remain run the exchanges, and each odd one hands the result back.

Every member ends with the same bits: an exchange gives both sides ``a op b`` and ``b op a``, which IEEE 754 makes
equal for every ``ReduceOp`` (sum, product, min, max are commutative element-wise), and the members that sit out
receive the result as it is. AVERAGE is a sum divided once at the end.

The transport is the caller's (``spark_hvd.core.backends.ring``: the authenticated TCP mesh), through ``Peers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.reduce import divide_average, reduce_into


class Peers(Protocol):
    """Point-to-point transfers with the members of a group (addressed by global rank)."""

    def send(self, dst: int, data: np.ndarray) -> None:
        """Send ``data`` (a uint8 view) to ``dst``."""

    def recv(self, src: int, into: np.ndarray) -> None:
        """Receive ``into.nbytes`` bytes from ``src`` into ``into`` (a uint8 view)."""

    def exchange(self, peer: int, data: np.ndarray, into: np.ndarray) -> None:
        """Send ``data`` to ``peer`` and receive as many bytes from it into ``into``, overlapped."""


def steps(position: int, n: int) -> tuple[int | None, list[int]]:
    """This member's plan as positions: (the odd member it hands its array to, when it sits out; else None),
    and the partners of its exchanges, in order (empty for a member that sits out)."""
    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    if position < 2 * rem and position % 2 == 0:
        return position + 1, []
    virtual = position // 2 if position < 2 * rem else position - rem
    partners = []
    mask = 1
    while mask < p2:
        other = virtual ^ mask
        partners.append(other * 2 + 1 if other < rem else other + rem)
        mask <<= 1
    return None, partners


def allreduce(flat: np.ndarray, op: ReduceOp, bfloat16: bool, members: Sequence[int], position: int,
              peers: Peers, scratch: np.ndarray) -> None:
    """Reduce ``flat`` in place over ``members`` (global ranks; this one is ``members[position]``).

    ``scratch``: at least ``flat.nbytes`` bytes (uint8) to receive into.
    """
    n = len(members)
    raw = flat.view(np.uint8)
    theirs = scratch[:raw.nbytes]
    incoming = theirs.view(flat.dtype)
    rem = n - (1 << (n.bit_length() - 1))
    sit_out_to, partners = steps(position, n)
    if sit_out_to is not None:
        peers.send(members[sit_out_to], raw)
        peers.recv(members[sit_out_to], raw)
        return
    folded = position < 2 * rem  # an odd member of the first 2R: it holds its even neighbour's array too
    if folded:
        peers.recv(members[position - 1], theirs)
        reduce_into(flat, incoming, op, bfloat16)
    for partner in partners:
        peers.exchange(members[partner], raw, theirs)
        reduce_into(flat, incoming, op, bfloat16)
    if op is ReduceOp.AVERAGE:
        divide_average(flat, n, bfloat16)
    if folded:
        peers.send(members[position - 1], raw)
