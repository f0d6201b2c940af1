"""Session affinity in the routing core: a session's next sequence goes to the replica that
finished its last one while that replica is routable and under the cap, and elsewhere when
not; the memory of sessions is bounded and forgets removed replicas and ended sessions."""

from planner_cases import ROLLOUT_MODEL

from pivot.cluster import Role
from pivot.planning.queue import Sequence, SequenceLedger
from pivot.planning.routing import RoleScheduler, RouterSettings, check_ownership, make_router


def rotating(cap: int = 4, **kw) -> RoleScheduler:
    """Three replicas a, b, c under round robin: without a hint each sequence goes to the
    next in turn, so a hint that is followed is told apart from one that is not."""
    router = make_router(
        RouterSettings(policy="round_robin", max_concurrent_per_replica=cap), ROLLOUT_MODEL
    )
    core = RoleScheduler(Role.ROLLOUT, router, SequenceLedger(), **kw)
    for name in ("a", "b", "c"):
        core.add_replica(name)
    return core


def serve(core: RoleScheduler, seq_id: int, session: str = "") -> str:
    """Submit one sequence, dispatch it, finish it; the replica that ran it."""
    core.submit(Sequence(id=seq_id, prompt_tokens=10, session=session))
    (sent,) = core.dispatch()
    core.complete(sent.replica_id, seq_id, generated_tokens=5)
    return sent.replica_id


def place(core: RoleScheduler, seq_id: int, session: str = "") -> str | None:
    core.submit(Sequence(id=seq_id, prompt_tokens=10, session=session))
    sent = core.dispatch()
    return sent[0].replica_id if sent else None


def test_a_sessions_next_sequence_goes_to_the_replica_that_served_its_last():
    core = rotating()
    assert serve(core, 0, "s") == "a"
    assert core.session_replica("s") == "a"
    # round robin's turn is b's now; the hint wins
    assert place(core, 1, "s") == "a"
    assert place(core, 2) == "b"  # a sequence without a session is routed as ever
    assert (core.session_hits, core.session_misses) == (1, 0)
    check_ownership(core.ledger, core)


def test_a_cut_or_full_replica_sends_the_session_elsewhere_without_waiting():
    core = rotating(cap=2)
    assert serve(core, 0, "s") == "a"
    core.set_unroutable({"a"})
    assert place(core, 1, "s") == "b"
    assert place(core, 2) == "c"  # the router skips a cut replica too
    core.set_unroutable(())
    for seq_id in (3, 4):  # a full
        core.submit(Sequence(id=seq_id, prompt_tokens=10))
        core.dispatch_to(seq_id, "a")
    assert place(core, 5, "s") == "b"  # round robin's turn is a's, but a is full
    assert (core.session_hits, core.session_misses) == (0, 2)
    core.complete("a", 3)
    assert place(core, 6, "s") == "a"  # room again: the hint holds
    assert core.session_hits == 1
    core.complete("b", 1)  # the session's latest finish is b's now
    assert core.session_replica("s") == "b"
    check_ownership(core.ledger, core)


def test_a_removed_replica_and_an_ended_session_are_forgotten():
    core = rotating()
    assert serve(core, 0, "s") == "a" and serve(core, 1, "t") == "b"
    core.remove_replica("a")
    assert core.session_replica("s") is None and core.session_replica("t") == "b"
    assert place(core, 2, "s") == "b"  # routed as any other: neither a hit nor a miss
    assert (core.session_hits, core.session_misses) == (0, 0)
    assert core.end_session("t") and not core.end_session("t")
    assert core.session_replica("t") is None and core.sessions == 0
    assert place(core, 3, "t") == "c"  # round robin's turn; the hint would have said b
    assert (core.session_hits, core.session_misses) == (0, 0)


def test_a_removal_forgets_only_the_sessions_last_served_there():
    core = rotating(max_sessions=2)
    assert serve(core, 0, "s") == "a"
    core.set_unroutable({"a"})
    assert serve(core, 1, "s") == "b"  # the session moved on: b holds its prefix now
    core.set_unroutable(())
    assert serve(core, 2, "t") == "c" and serve(core, 3, "s") == "b"
    assert serve(core, 4, "u") == "a"  # t, the least recently served, is out: the cap
    core.remove_replica("a")  # u's replica; s was a's once, t's was c
    assert core.session_replica("s") == "b" and core.session_replica("u") is None
    core.remove_replica("c")  # t was forgotten already: nothing left to forget
    assert core.sessions == 1 and core.session_replica("t") is None


def test_the_session_map_is_capped_least_recently_served_out():
    core = rotating(max_sessions=2)
    serve(core, 0, "old")
    serve(core, 1, "mid")
    serve(core, 2, "old")  # served again: now the most recent
    serve(core, 3, "new")
    assert core.sessions == 2
    assert core.session_replica("mid") is None
    assert core.session_replica("old") is not None and core.session_replica("new") is not None
