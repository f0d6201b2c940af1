"""Waiting queue order (aborted first, then FIFO) and the ownership ledger's checks."""

import pytest

from pivot.cluster import Role
from pivot.planning.queue import DONE, Owner, OwnershipError, Sequence, SequenceLedger, WaitingQueue


def seq(i, prompt=100, generated=0):
    return Sequence(id=i, prompt_tokens=prompt, generated_tokens=generated)


def test_aborted_sequences_go_first_then_fifo():
    q = WaitingQueue(Role.ROLLOUT)
    for i in range(3):
        q.push(seq(i))
    q.push_aborted(seq(10, generated=50))
    q.push(seq(3))
    q.push_aborted(seq(11, generated=7))
    assert q.ids() == [10, 11, 0, 1, 2, 3]
    assert [q.pop().id for _ in range(len(q))] == [10, 11, 0, 1, 2, 3]
    with pytest.raises(IndexError, match="rollout queue is empty"):
        q.pop()


def test_remove_and_requeue_keep_order_and_token_total():
    q = WaitingQueue(Role.REWARD)
    for i in range(4):
        q.push(seq(i, prompt=10 * (i + 1)))
    assert q.tokens == 100
    removed = q.remove(1)
    assert removed.id == 1 and 1 not in q and q.tokens == 80
    q.push_aborted(removed)  # the same id again, now as aborted: it must come out once
    assert q.ids() == [1, 0, 2, 3]
    assert [q.pop().id for _ in range(4)] == [1, 0, 2, 3]
    assert q.tokens == 0 and q.peek() is None
    with pytest.raises(KeyError, match="not in the reward queue"):
        q.remove(7)


def test_pushing_a_queued_sequence_twice_is_an_error():
    q = WaitingQueue(Role.ROLLOUT)
    q.push(seq(1))
    with pytest.raises(ValueError, match="already in the rollout queue"):
        q.push_aborted(seq(1))


def test_ledger_moves_are_checked_against_the_owner():
    ledger = SequenceLedger()
    queue, replica = Owner.queue(Role.ROLLOUT), Owner.replica("r0")
    ledger.submit(1, queue)
    with pytest.raises(OwnershipError, match="submitted twice"):
        ledger.submit(1, queue)
    with pytest.raises(OwnershipError, match="owned by queue:rollout, not replica:r0"):
        ledger.move(1, DONE, expect=replica)
    ledger.move(1, replica, expect=queue)
    ledger.finish(1, expect=replica)
    with pytest.raises(OwnershipError, match="is done"):
        ledger.move(1, queue)
    with pytest.raises(OwnershipError, match="never submitted"):
        ledger.owner(2)
    assert ledger.counts() == {"submitted": 1, "done": 1, "queued": 0, "running": 0}


def test_check_invariants_names_lost_duplicated_and_misplaced_sequences():
    ledger = SequenceLedger()
    q, r0, r1 = Owner.queue(Role.ROLLOUT), Owner.replica("r0"), Owner.replica("r1")
    for i in range(4):
        ledger.submit(i, q)
    ledger.move(2, r0)
    ledger.move(3, r1)
    ledger.check_invariants({q: [0, 1], r0: [2], r1: [3]})  # all well: no exception
    with pytest.raises(OwnershipError) as err:
        ledger.check_invariants({q: [0], r0: [2, 3], r1: [3, 9]})
    text = str(err.value)
    assert "sequence 1 lost: the ledger says queue:rollout" in text
    assert "sequence 3 duplicated: held by replica:r0, replica:r1" in text
    assert "sequence 9 held by replica:r1 was never submitted" in text
    ledger.finish(0)
    with pytest.raises(OwnershipError, match="sequence 0 is done but still held by queue"):
        ledger.check_invariants({q: [0, 1], r0: [2], r1: [3]})
    with pytest.raises(OwnershipError, match="held by replica:r1 but the ledger says replica:r0"):
        ledger.check_invariants({q: [1], r1: [2, 3]})
