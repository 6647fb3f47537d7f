"""The negotiation table on its own: no ranks, no threads, no backend.

Each test plays the gathered messages of a round into one table (every rank's table is this one, fed the same
messages), and checks what is ready, what mismatches and what stalls.
"""

from __future__ import annotations

import numpy as np
import pytest

from spark_hvd.core.engine.device import GroupScope
from spark_hvd.core.engine.negotiation import Meta, ResponseCache
from spark_hvd.core.engine.table import (
    NegotiationTable,
    check_same_settings,
    decode_messages,
    encode_message,
    fast_answer,
    fast_vector,
    message_digest,
    message_lengths,
    place_message,
    same_messages,
    tune_slots,
)
from spark_hvd.core.errors import SparkHvdError, StallError, TensorMismatchError


def meta(shape=(4,), dtype="<f4", op="sum", kind="allreduce", device="") -> Meta:
    return Meta(kind, dtype, tuple(shape), op, 0, 1.0, 1.0, False, device)


def message(full=(), ids=(), join=False, shutdown=False, expired=()) -> list:
    return [int(join), int(shutdown), list(ids), [m.to_wire(n) for n, m in full], list(expired)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_tensor_is_ready_once_every_rank_submitted_it_in_first_appearance_order():
    table = NegotiationTable(3)
    cache = ResponseCache(16)
    news = table.absorb([message([("b", meta()), ("a", meta())]), message([("a", meta())]), message()], cache)
    assert news.progress and not news.joins and not news.shutdown
    assert table.ready() == [] and set(table.pending) == {"a", "b"}
    table.absorb([message(), message([("b", meta())]), message([("b", meta()), ("a", meta())])], cache)
    ready = table.ready()
    assert [(e.name, err) for e, err in ready] == [("b", None), ("a", None)]  # b appeared first (rank 0's order)
    assert table.idle


def test_cache_ids_stand_for_their_names():
    table = NegotiationTable(2)
    cache = ResponseCache(16)
    cache.put("w", meta((3, 3)))
    (cache_id,) = [i for i in range(cache.id_count())]
    table.absorb([message(ids=[cache_id]), message([("w", meta((3, 3)))])], cache)
    (entry, error), = table.ready()
    assert entry.name == "w" and error is None and entry.meta.shape == (3, 3)


def test_a_shape_mismatch_names_the_tensor_and_the_minority_ranks():
    table = NegotiationTable(3)
    table.absorb([message([("g", meta((4,)))]), message([("g", meta((5,)))]), message([("g", meta((4,)))])],
                 ResponseCache(0))
    (entry, error), = table.ready()
    assert isinstance(error, TensorMismatchError)
    assert error.name == "g" and error.ranks == [1]
    assert "'g'" in str(error) and "rank 1: allreduce shape=(5,)" in str(error)


def test_dtype_and_op_mismatches_and_ragged_first_dimensions():
    table = NegotiationTable(2)
    cache = ResponseCache(0)
    table.absorb([message([("d", meta(dtype="<f4")), ("o", meta(op="sum")),
                           ("r", meta((2, 3), kind="allgather"))]),
                  message([("d", meta(dtype="<f8")), ("o", meta(op="max")),
                           ("r", meta((5, 3), kind="allgather"))])], cache)
    errors = {e.name: err for e, err in table.ready()}
    assert isinstance(errors["d"], TensorMismatchError) and "float64" in str(errors["d"])
    assert isinstance(errors["o"], TensorMismatchError) and "op=max" in str(errors["o"])
    assert errors["r"] is None  # an allgather's first dimension may differ by rank


def test_one_tensor_on_the_gpu_here_and_in_host_memory_there_is_named():
    table = NegotiationTable(3)
    table.absorb([message([("t", meta(device="cuda"))]), message([("t", meta())]),
                  message([("t", meta(device="cuda"))])], ResponseCache(0))
    (_, error), = table.ready()
    assert isinstance(error, TensorMismatchError) and error.ranks == [1]
    assert "on cuda on ranks [0, 2]" in str(error) and "host memory on ranks [1]" in str(error)


def test_a_process_set_names_global_ranks():
    table = NegotiationTable(2, GroupScope(1, (3, 5)))
    table.absorb([message([("g", meta((4,)))]), message([("g", meta((2,)))])], ResponseCache(0))
    (_, error), = table.ready()
    assert "in process set 1 (ranks [3, 5])" in str(error)
    assert error.ranks == [5] and "rank 5: allreduce shape=(2,)" in str(error)


def test_joined_ranks_are_left_out_of_allreduces_and_fail_the_other_kinds():
    table = NegotiationTable(3)
    cache = ResponseCache(0)
    news = table.absorb([message(join=True), message([("s", meta()), ("g", meta((2,), kind="allgather"))]),
                         message([("s", meta()), ("g", meta((2,), kind="allgather"))])], cache)
    assert news.joins == [0] and not table.all_joined()
    errors = {e.name: err for e, err in table.ready()}
    assert errors["s"] is None
    assert isinstance(errors["g"], TensorMismatchError) and errors["g"].ranks == [0] and "join()" in str(errors["g"])
    table.absorb([message(), message(join=True), message(join=True)], cache)
    assert table.all_joined()
    table.clear_joins()
    assert table.idle


def test_a_shutdown_is_reported_with_its_ranks():
    table = NegotiationTable(2)
    news = table.absorb([message(), message(shutdown=True)], ResponseCache(0))
    assert news.shutdown == [1] and not news.progress


def test_a_stall_is_warned_once_per_period_then_stops_the_job_naming_the_missing_ranks():
    clock = Clock()
    table = NegotiationTable(3, stall_check_time_s=10, stall_shutdown_time_s=30, clock=clock)
    cache = ResponseCache(0)
    table.absorb([message([("late", meta())]), message([("late", meta())]), message()], cache)
    assert table.ready() == [] and table.stall_warnings(0) == [] and table.expired() == []
    clock.now += 11
    (warning,) = table.stall_warnings(0)
    assert "'late'" in warning and "ranks [2] have not submitted it" in warning
    assert table.stall_warnings(0) == []  # not again until another period has passed
    clock.now += 10
    assert table.stall_warnings(2) == []  # rank 2 lacks it: the ranks that have it warn
    clock.now += 10
    assert table.expired() == ["late"]
    error = table.stall_error({"late"})
    assert isinstance(error, StallError) and error.name == "late" and error.ranks == [2]
    assert "SPARK_HVD_STALL_SHUTDOWN_TIME=30 s" in str(error)
    assert table.stall_error({"gone"}) is None  # completed in the same round: nothing to raise


def test_the_fast_rounds_vector_finds_the_common_ids_and_the_partial_ones():
    size, count = 3, 6

    def summed(*per_rank: tuple[list[int], bool]) -> np.ndarray:
        return sum(fast_vector(ids, irregular, count, r, size, 10 + r) for r, (ids, irregular) in enumerate(per_rank))

    vec = summed(([1, 4], False), ([4, 1, 5], False), ([1, 4], False))
    assert fast_answer(vec, size) == ([1, 4], True)  # 5 was sent by one rank only
    assert message_lengths(vec, size) == [10, 11, 12]
    assert fast_answer(summed(([2], False), ([2], False), ([2], False)), size) == ([2], False)
    vec = summed(([2], False), ([], True), ([2], False))
    assert fast_answer(vec, size) is None  # someone has something new: the full round
    assert not same_messages(vec, size)  # no digests: the messages must travel


def test_the_fast_rounds_vector_says_when_every_rank_sent_the_same_message():
    rng = np.random.default_rng(7)
    size, count = 4, 5
    same = encode_message([0, 0, [], [meta().to_wire("new.1")], []])
    other = encode_message([0, 0, [], [meta().to_wire("new.2")], []])
    assert message_digest(same) == message_digest(encode_message([0, 0, [], [meta().to_wire("new.1")], []]))
    assert message_digest(same) != message_digest(other)
    assert all(0 < d < 2 ** 31 for d in message_digest(same))

    def summed(messages: list[np.ndarray]) -> np.ndarray:
        return sum(fast_vector([], True, count, r, size, m.size, message_digest(m)) for r, m in enumerate(messages))

    assert same_messages(summed([same] * size), size)
    for odd in range(size):  # any one rank with another message: every message travels
        messages = [same] * size
        messages[odd] = other
        assert not same_messages(summed(messages), size)
    # a random message on one rank, random ids elsewhere in the vector: the ids never disturb the digests
    noise = encode_message([0, 0, [], [meta().to_wire(str(rng.integers(1 << 30)))], []])
    vec = summed([same, same, noise, same])
    vec[4 + 3 * size:] += rng.integers(0, 3, count, dtype=np.int32)
    assert not same_messages(vec, size)


def test_the_tuning_slots_ride_beside_the_ids_and_digests():
    size, count = 3, 4
    message = encode_message([0, 0, [], [meta().to_wire("x")], []])
    vecs = [fast_vector([1, 3], False, count, r, size, message.size, message_digest(message),
                        (1234, 5678, 9) if r == 0 else (0, 0, 0)) for r in range(size)]
    summed = sum(vecs)
    assert tune_slots(summed, size) == (1234, 5678, 9)  # rank 0's choice, as it sent it
    assert fast_answer(summed, size) == ([1, 3], False) and same_messages(summed, size)
    assert tune_slots(sum(fast_vector([1], False, count, r, size) for r in range(size)), size) == (0, 0, 0)


def test_messages_placed_by_their_lengths_add_up_to_every_message():
    fields = [[1, 0, [3], [meta().to_wire("x")], []], [0, 0, [], [], []], [0, 1, [2, 5], [], []]]
    encoded = [encode_message(f) for f in fields]
    lengths = [e.size for e in encoded]
    total = sum(place_message(e, lengths, r).astype(np.int64) for r, e in enumerate(encoded))
    assert decode_messages(total.astype(np.uint8), 3) == fields


def test_messages_round_trip_and_a_short_gather_is_an_error():
    fields = [[1, 0, [3], [meta().to_wire("x")], []], [0, 0, [], [], ["y"]]]
    gathered = np.concatenate([encode_message(f) for f in fields])
    assert decode_messages(gathered, 2) == fields
    with pytest.raises(SparkHvdError, match="message of rank 1 is missing"):
        decode_messages(encode_message(fields[0]), 2)


def test_ranks_with_different_fusion_settings_are_named():
    check_same_settings([[64, 1024], [64, 1024]])
    with pytest.raises(SparkHvdError, match="rank 1: fusion_threshold=32"):
        check_same_settings([[64, 1024], [32, 1024]])
