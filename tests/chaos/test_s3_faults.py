"""Two learners on moto's S3 server, with faults injected at the HTTP edge.

A botocore `before-send` handler on each learner's own client answers some requests in the
server's place (503 SlowDown, 500, 409 on conditional creates), raises the exceptions a
timed-out or dropped connection produces, or lets a write land and loses its answer. Every
one is retried with backoff by the mailbox; a store that stays down for a while costs
failed polls and publishes (events), never a hung step, and the run goes on once it is
back. A proxy that strips `If-None-Match` is refused at join.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from botocore.awsrequest import AWSPreparedRequest, AWSResponse, HTTPHeaders
from botocore.exceptions import ConnectionClosedError, ReadTimeoutError
from botocore.httpsession import URLLib3Session

from chaos.harness import (
    ToyAdapter,
    conclude,
    event_dict,
    theta_digests,
    train_step,
    verify_run,
)
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.errors import ConditionalWriteUnsupported
from gradientmail.events import Event, PollFailed, PublishFailed, SnapshotPublished
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import S3Mailbox

# Every n-th request of a kind meets the next of its faults, in turn. "create" is a
# PutObject with If-None-Match (S3Mailbox.create).
FAULTS = {
    "PutObject": (4, ("500", "lost", "timeout", "503")),
    "create": (5, ("409", "lost", "drop", "409", "503")),
    "GetObject": (10, ("500", "timeout", "drop")),
    "ListObjectsV2": (10, ("timeout", "500", "drop")),
    "DeleteObject": (6, ("500", "drop")),
}
#: What an operation that exhausted its retries reports, for each fault it may have met last.
INJECTED = ("InternalError (HTTP 500)", "SlowDown (HTTP 503)", "Read timeout on endpoint",
            "Connection was closed before", "ConditionalRequestConflict (HTTP 409)")
OUTAGE = 3.0  # seconds during which one learner's store answers every request with a 500


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._body


def _answer(request: AWSPreparedRequest, status: int, code: str) -> AWSResponse:
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>injected {code}</Message></Error>").encode()
    return AWSResponse(request.url, status, HTTPHeaders(), _Raw(body))


class HttpFaults:
    """A before-send handler injecting `FAULTS`, and failing every request while `down`."""

    def __init__(self) -> None:
        self.down = False
        self.seen: collections.Counter[str] = collections.Counter()
        self.injected: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def __call__(self, request: AWSPreparedRequest, event_name: str = "", **_: Any
                 ) -> AWSResponse | None:
        op = event_name.rsplit(".", 1)[-1]
        if op == "PutObject" and "If-None-Match" in request.headers:
            op = "create"
        with self._lock:
            self.seen[op] += 1
            n = self.seen[op]
            every, kinds = FAULTS.get(op, (0, ()))
            fault = None
            if self.down:
                fault = "outage"
            elif every and n % every == 0:
                fault = kinds[(n // every - 1) % len(kinds)]
            if fault is not None:
                self.injected[fault] += 1
        if fault is None:
            return None
        if fault in ("500", "outage"):
            return _answer(request, 500, "InternalError")
        if fault == "503":
            return _answer(request, 503, "SlowDown")
        if fault == "409":
            return _answer(request, 409, "ConditionalRequestConflict")
        if fault == "timeout":
            time.sleep(0.05)
            raise ReadTimeoutError(endpoint_url=request.url)
        if fault == "lost":
            URLLib3Session().send(request)  # the write lands; its answer never comes back
        raise ConnectionClosedError(endpoint_url=request.url)


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, kind: type[Event]) -> list[Any]:
        with self._lock:
            return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture
def s3_run(s3_bucket: str, moto_endpoint: str) -> Iterator[Callable[..., S3Mailbox]]:
    """Mailboxes on one fresh prefix of the test bucket; closed afterwards."""
    made: list[S3Mailbox] = []
    prefix = f"chaos-{time.monotonic_ns()}"

    def make(**options: Any) -> S3Mailbox:
        mailbox = S3Mailbox(s3_bucket, prefix, endpoint_url=moto_endpoint, **options)
        made.append(mailbox)
        return mailbox

    yield make
    import asyncio

    for mailbox in made:
        asyncio.run(mailbox.close())


def test_a_run_on_s3_with_http_faults_completes(s3_run: Callable[..., S3Mailbox]) -> None:
    alg = DiLoCo(sync_every=4, fragments=2, quorum_size=2)  # τ = 2, no barrier
    names = ("alpha", "beta")
    edges = {n: HttpFaults() for n in names}
    events = {n: Recorder() for n in names}
    adapters = {n: ToyAdapter(w) for w, n in enumerate(names)}
    learners = {}
    for n in names:
        mailbox = s3_run(max_attempts=5)
        mailbox.client.meta.events.register("before-send.s3", edges[n])
        learners[n] = Learner(
            adapters[n],
            alg,
            mailbox,
            n,
            on_event=events[n],
            options=LearnerOptions(
                poll_interval=0.02,
                lease_every=0.5,
                lease_timeout=3.0,
                keep_versions=10**6,
            ),
        )
    steps, outage_at = 140, 40
    stall: dict[str, float] = {}
    outage: list[float] = []
    back: list[int] = []  # how many events beta had seen when its store came back

    def work(w: int, n: str) -> None:
        learner, adapter = learners[n], adapters[n]
        learner.start()
        longest = 0.0
        for step in range(steps):
            if n == "beta" and step == outage_at:
                edges[n].down, t0 = True, time.monotonic()
            if n == "beta" and edges[n].down and time.monotonic() - t0 > OUTAGE:
                edges[n].down = False
                outage.append(time.monotonic() - t0)
                back.append(len(events[n].events))
            train_step(adapter, w, step)
            t = time.monotonic()
            learner.step(16)
            longest = max(longest, time.monotonic() - t)
            time.sleep(0.05)
        stall[n] = longest
        learner.close()

    threads = [threading.Thread(target=work, args=(w, n)) for w, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a learner hung"
    assert outage, "beta's outage never ended"
    clean = s3_run()
    figures = verify_run(clean)
    for n in names:
        assert adapters[n].digests() == theta_digests(clean, learners[n].rounds_seen), n
    assert max(learner.rounds_seen for learner in learners.values()) == figures.rounds - 1
    for n in names:
        kinds = set(edges[n].injected) - {"outage"}
        assert kinds == {"409", "503", "500", "lost", "timeout", "drop"}, (
            n, edges[n].injected, edges[n].seen)
    # The outage cost beta failed polls or publishes, reported as events; both learners
    # took part in rounds after it.
    failed = events["beta"].of(PollFailed) + events["beta"].of(PublishFailed)
    assert failed
    for e in failed:  # the last attempt met the outage, or one of the periodic faults
        assert any(text in e.error for text in INJECTED), e.error
    assert edges["beta"].injected["outage"] > 0
    assert figures.participants("alpha")
    after = [e.round for e in events["beta"].events[back[0]:]
             if isinstance(e, SnapshotPublished)]
    assert set(after) & set(figures.participants("beta")), (after, figures.participants("beta"))
    injected = sum(sum(e.injected.values()) for e in edges.values())
    conclude("S3: 503 SlowDown, 500, 409, timeouts, dropped connections, lost answers, "
             f"and a {OUTAGE:.1f} s outage", figures,
             [event_dict(e) for n in names for e in events[n].events], max(stall.values()),
             requests=sum(sum(e.seen.values()) for e in edges.values()),
             faults_injected=injected, failed_ops_reported=len(failed),
             alpha_failed=len(events["alpha"].of(PollFailed) + events["alpha"].of(PublishFailed)))


def test_a_proxy_that_strips_if_none_match_is_refused_at_join(
    s3_run: Callable[..., S3Mailbox],
) -> None:
    mailbox = s3_run()

    def strip(request: AWSPreparedRequest, **_: Any) -> None:
        if "If-None-Match" in request.headers:
            del request.headers["If-None-Match"]

    mailbox.client.meta.events.register("before-send.s3.PutObject", strip)
    learner = Learner(ToyAdapter(), DiLoCo(sync_every=4, fragments=2), mailbox, "hopeful",
                      on_event=lambda e: None)
    with pytest.raises(ConditionalWriteUnsupported) as info:
        learner.start()
    assert str(info.value).startswith(f"{mailbox.url} does not honour create-if-absent: a "
                                      "second create of probe key 'selftest/")
    import asyncio

    assert asyncio.run(s3_run().list()) == []  # no manifest, no claim, the probe deleted
