"""The roll call's decisions and its object, with plain numbers for the clock."""

from __future__ import annotations

import asyncio
import math

import pytest

from gradientmail.errors import AuthenticationError, LocalProtocolError, RemoteProtocolError
from gradientmail.mailbox import MemoryMailbox
from gradientmail.run.keyspace import CALL_KEY
from gradientmail.run.lease import LeaseTracker
from gradientmail.run.protocol import Exchange
from gradientmail.run.rollcall import (
    Call,
    Judging,
    answer_within,
    call_after,
    next_call,
    reply,
    should_post,
    verdict,
)

POLL = 1.0


def test_timing_is_in_polls_with_floors_in_seconds() -> None:
    assert (call_after(1.0), answer_within(1.0)) == (2.0, 5.0)
    assert (call_after(3.0), answer_within(3.0)) == (6.0, 15.0)
    # Very short polls: a thread not scheduled for a moment is not judged gone.
    assert (call_after(0.01), answer_within(0.01)) == (1.0, 2.0)


def test_a_round_is_called_after_waiting_from_its_first_contribution() -> None:
    assert next_call(None, 0, None, POLL) is None  # nothing in: nobody knows who is missing
    assert next_call(100.0, 0, None, POLL) == 102.0


def test_later_calls_of_a_round_back_off() -> None:
    # From the end of the previous call: 2 s x 2, 4, 8, ... at most x 32.
    assert next_call(100.0, 1, 107.0, POLL) == 111.0
    assert next_call(100.0, 2, 111.0, POLL) == 119.0
    assert next_call(100.0, 3, 119.0, POLL) == 135.0
    assert next_call(100.0, 9, 200.0, POLL) == 264.0
    assert next_call(100.0, 10**6, 200.0, POLL) == 264.0


def test_a_backup_closer_waits_out_the_round_it_could_close() -> None:
    # Its quorum in since `held`; the preferred closer has until then and 2 s after the
    # first contribution, whichever is later.
    assert next_call(100.0, 0, None, POLL, held=100.5) == 102.0
    assert next_call(100.0, 0, None, POLL, held=104.0) == 104.0
    assert next_call(100.0, 1, 104.0, POLL, held=104.0) == 108.0


def test_a_call_someone_else_posted_for_the_round_is_not_called_over() -> None:
    theirs = Call(7, 3, "b")
    assert should_post(None, 7, set())
    assert not should_post(theirs, 7, set())  # b is judging round 7
    assert should_post(theirs, 7, {(3, "b")})  # counted already: our turn comes
    assert should_post(theirs, 8, set())  # a call of another round
    assert should_post(theirs.with_verdict({}), 8, set())


def judging() -> Judging:
    return Judging(Call(4, 0, "a"), {"b": 10, "c": 3}, posted=100.0)


def test_verdict_waits_for_the_deadline_then_names_the_silent() -> None:
    j = judging()
    assert verdict(j, {"a": 1, "b": 10, "c": 3}, 101.0, POLL) is None
    assert verdict(j, {"a": 1, "b": 11, "c": 3}, 104.9, POLL) is None  # b answered
    assert verdict(j, {"a": 1, "b": 11, "c": 3}, 105.0, POLL) == {"c": 3}
    assert verdict(j, {"a": 1, "b": 10, "c": 3}, 130.0, POLL) == {"b": 10, "c": 3}
    # A deadline on a poll is met despite rounding: a clock that adds 0.1 s at a time.
    t = 100.0
    for _ in range(50):
        t += 0.1
    assert t < 105.0
    assert verdict(j, {"b": 10, "c": 3}, t, POLL) == {"b": 10, "c": 3}


def test_verdict_is_empty_as_soon_as_everyone_answered() -> None:
    j = judging()
    assert verdict(j, {"b": 11, "c": 4}, 100.5, POLL) == {}
    # A restart may count from anywhere (lower too); a released lease is no one's to judge.
    assert verdict(j, {"b": 0}, 101.0, POLL) == {}


def test_reply_answers_an_open_call_once_and_applies_a_verdict() -> None:
    call = Call(4, 0, "a")
    assert reply(call, "b", 10).beat
    assert not reply(call, "a", 1).beat  # the caller does not answer itself
    closed = call.with_verdict({"c": 3, "b": 10})
    assert closed.gone == (("b", 10), ("c", 3))
    r = reply(closed, "d", 5)
    assert (r.beat, dict(r.drop)) == (False, {"b": 10, "c": 3})
    # b was judged gone at the counter it still holds: alive after all, it beats at once.
    r = reply(closed, "b", 10)
    assert (r.beat, dict(r.drop)) == (True, {"c": 3})
    assert not reply(closed, "b", 11).beat  # it beat since


def test_call_round_trips_as_canonical_json() -> None:
    open_ = Call(12, 3, "node-1")
    assert open_.encode() == b'{"caller":"node-1","gone":null,"number":3,"round":12,"v":1}'
    closed = open_.with_verdict({"z": 7, "b": 0})
    assert closed.encode() == (b'{"caller":"node-1","gone":{"b":0,"z":7},"number":3,'
                               b'"round":12,"v":1}')
    for call in (open_, closed):
        assert Call.decode(call.encode(), CALL_KEY) == call
    assert open_.ident == (3, "node-1") == closed.ident


@pytest.mark.parametrize("data, names", [
    (b'{"caller":"a","gone":null,"number":0,"round":1}', "missing ['v']"),
    (b'{"caller":"a","gone":[],"number":0,"round":1,"v":1}', "'gone' must be an object"),
    (b'{"caller":"a","gone":{"b":-1},"number":0,"round":1,"v":1}', "gone counter of 'b'"),
    (b'{"caller":"a","gone":{"b":true},"number":0,"round":1,"v":1}', "gone counter of 'b'"),
    (b'{"caller":"a","gone":{"../x":1},"number":0,"round":1,"v":1}', "learner id '../x'"),
    (b'{"caller":"a b","gone":null,"number":0,"round":1,"v":1}', "learner id 'a b'"),
    (b'{"caller":"a","gone":null,"number":0,"round":-2,"v":1}', "round=-2"),
    (b'[1]', "not an object"),
])
def test_a_bad_call_is_a_remote_error_naming_the_key(data: bytes, names: str) -> None:
    with pytest.raises(RemoteProtocolError, match=r"rollcall\.json") as info:
        Call.decode(data, CALL_KEY)
    assert names in str(info.value)


def test_a_bad_call_built_here_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError, match="sorted"):
        Call(1, 0, "a", (("c", 1), ("b", 2)))
    with pytest.raises(LocalProtocolError, match=r"\[0, 10\*\*12\)"):
        Call(1, 0, "a", (("b", 10**12),))


def test_tracker_drops_a_learner_until_its_counter_moves() -> None:
    t = LeaseTracker(timeout=120.0)
    t.observe({"a": 5, "b": 9}, now=0.0)
    t.drop("b", 9)
    assert t.live(1.0) == {"a"}
    t.observe({"a": 5, "b": 9}, now=2.0)  # the same counter: still gone
    assert t.live(2.0) == {"a"}
    t.observe({"a": 5, "b": 10}, now=3.0)  # it beat: live again
    assert t.live(3.0) == {"a", "b"}
    assert t.last_change("b") == 3.0


def test_tracker_drop_of_a_deleted_or_unknown_lease() -> None:
    t = LeaseTracker(timeout=120.0)
    t.drop("x", 4)  # a verdict read before this observer listed x
    assert t.live(0.0) == frozenset()
    t.observe({"x": 4}, now=1.0)
    assert t.live(1.0) == frozenset()
    t.observe({}, now=2.0)  # its lease was deleted by the caller
    t.observe({"x": 0}, now=3.0)  # restarted: first seen again
    assert t.live(3.0) == {"x"}
    assert not math.isinf(t.last_change("x") or math.inf)


def test_tracker_ignores_a_verdict_older_than_what_it_saw() -> None:
    t = LeaseTracker(timeout=120.0)
    t.observe({"b": 11}, now=0.0)
    t.drop("b", 10)  # b answered after the caller's listing; this observer saw it
    assert t.live(1.0) == {"b"}


def test_the_call_is_sealed_in_an_authenticated_run() -> None:
    async def main() -> None:
        box = MemoryMailbox()
        key = "k" * 32
        ex = Exchange(box, run_key=key, prefix="run/")
        assert await ex.read_call() is None
        call = Call(3, 0, "a").with_verdict({"b": 2})
        await ex.post_call(call)
        assert await Exchange(box, run_key=key, prefix="run/").read_call() == call
        # Written without the key (or forged): refused, naming the key.
        await Exchange(box, prefix="run/").post_call(Call(3, 1, "mallory"))
        with pytest.raises(AuthenticationError, match=r"rollcall\.json"):
            await ex.read_call()

    asyncio.run(main())
