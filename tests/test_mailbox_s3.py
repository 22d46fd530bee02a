"""S3Mailbox against moto's HTTP server: errors, retries, conditional writes, multipart.

Faults are injected at the HTTP edge with botocore's `before-send` event on the mailbox's
own client: the handler answers in the server's place (a 409, a 503) and otherwise lets
the real request through to the real server.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from botocore.awsrequest import AWSPreparedRequest, AWSResponse, HTTPHeaders
from botocore.httpsession import URLLib3Session

from gradientmail.errors import ConfigError, MailboxError, MissingExtra
from gradientmail.mailbox import Mailbox, S3Mailbox
from gradientmail.testing import FakeClock

MiB = 1024 * 1024
Factory = Callable[..., Mailbox]


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._body


def _answer(request: AWSPreparedRequest, status: int, code: str = "") -> AWSResponse:
    body = b""
    if code:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>injected {code}</Message></Error>"
        ).encode()
    return AWSResponse(request.url, status, HTTPHeaders(), _Raw(body))


class Edge:
    """A before-send handler: answers the first `count` matching requests itself."""

    def __init__(
        self, status: int, code: str = "", count: int = 1, *, conditional_only: bool = False
    ) -> None:
        self.status, self.code, self.count = status, code, count
        self.conditional_only = conditional_only
        self.seen = 0  # matching requests that reached the edge
        self.forwarded_first = False

    def __call__(self, request: AWSPreparedRequest, **_: Any) -> AWSResponse | None:
        if self.conditional_only and "If-None-Match" not in request.headers:
            return None
        self.seen += 1
        if self.seen > self.count:
            return None
        if self.forwarded_first:
            # The request lands on the server, but its answer is lost on the way back.
            URLLib3Session().send(request)
        return _answer(request, self.status, self.code)


def _s3(factory: Factory, **options: Any) -> S3Mailbox:
    mailbox = factory("s3", **options)
    assert isinstance(mailbox, S3Mailbox)
    return mailbox


def test_missing_bucket_names_bucket_and_fix(moto_endpoint: str) -> None:
    mailbox = S3Mailbox("no-such-bucket", "run1", endpoint_url=moto_endpoint)
    with pytest.raises(MailboxError) as info:
        asyncio.run(mailbox.put("manifest.json", b"{}"))
    assert str(info.value) == (
        f"put of s3://no-such-bucket/run1/manifest.json at {moto_endpoint} failed: the bucket "
        f"'no-such-bucket' does not exist; create it first, e.g. `aws s3 mb "
        f"s3://no-such-bucket --endpoint-url {moto_endpoint}` (drop --endpoint-url for AWS "
        "itself)"
    )
    assert info.value.__cause__ is not None
    with pytest.raises(MailboxError, match="the bucket 'no-such-bucket' does not exist"):
        asyncio.run(mailbox.list("rounds/"))
    asyncio.run(mailbox.close())


def test_unreachable_endpoint_is_named() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    endpoint = f"http://127.0.0.1:{port}"
    mailbox = S3Mailbox("bucket", endpoint_url=endpoint, max_attempts=2)
    with pytest.raises(MailboxError) as info:
        asyncio.run(mailbox.get("k"))
    assert str(info.value).startswith(
        f"get of s3://bucket/k at {endpoint} failed: cannot reach the endpoint after 2 attempts"
    )
    assert str(info.value).endswith("check endpoint_url / AWS_ENDPOINT_URL and the network")
    asyncio.run(mailbox.close())


def test_create_retries_409_conflict(mailbox_factory: Factory) -> None:
    clock = FakeClock()
    mailbox = _s3(mailbox_factory, clock=clock)
    edge = Edge(409, "ConditionalRequestConflict", count=3)
    mailbox.client.meta.events.register("before-send.s3.PutObject", edge)
    assert asyncio.run(mailbox.create("claims/round/0/0", b"me")) is True
    assert asyncio.run(mailbox.get("claims/round/0/0")) == b"me"
    assert edge.seen == 4
    assert 0 < clock.now() <= 0.05 + 0.1 + 0.2  # three jittered backoffs, on the fake clock


def test_create_gives_up_after_create_attempts(mailbox_factory: Factory) -> None:
    mailbox = _s3(mailbox_factory, clock=FakeClock(), create_attempts=3)
    edge = Edge(409, "ConditionalRequestConflict", count=100)
    mailbox.client.meta.events.register("before-send.s3.PutObject", edge)
    with pytest.raises(MailboxError) as info:
        asyncio.run(mailbox.create("claims/round/0/0", b"me"))
    assert str(info.value) == (
        f"create of {mailbox.url}claims/round/0/0 at {mailbox.client.meta.endpoint_url} "
        "failed: ConditionalRequestConflict (HTTP 409): injected ConditionalRequestConflict"
    )
    assert edge.seen == 3
    mailbox.client.meta.events.unregister("before-send.s3.PutObject", edge)
    assert asyncio.run(mailbox.get("claims/round/0/0")) is None


@pytest.mark.parametrize(("status", "code"), [(500, "InternalError"), (503, "SlowDown")])
def test_5xx_and_throttling_are_retried(mailbox_factory: Factory, status: int, code: str) -> None:
    mailbox = _s3(mailbox_factory)
    edge = Edge(status, code, count=1)
    mailbox.client.meta.events.register("before-send.s3.PutObject", edge)
    asyncio.run(mailbox.put("payloads/0/a.safetensors", b"delta"))
    assert asyncio.run(mailbox.get("payloads/0/a.safetensors")) == b"delta"
    assert edge.seen == 2


def test_other_4xx_is_not_retried(mailbox_factory: Factory) -> None:
    mailbox = _s3(mailbox_factory)
    edge = Edge(400, "InvalidRequest", count=100)
    mailbox.client.meta.events.register("before-send.s3.PutObject", edge)
    with pytest.raises(MailboxError, match=r"failed: InvalidRequest \(HTTP 400\)"):
        asyncio.run(mailbox.put("k", b"x"))
    assert edge.seen == 1


def test_old_minio_304_means_exists(mailbox_factory: Factory) -> None:
    mailbox = _s3(mailbox_factory)
    mailbox.client.meta.events.register(
        "before-send.s3.PutObject", Edge(304, count=1, conditional_only=True)
    )
    assert asyncio.run(mailbox.create("claims/create/0", b"me")) is False


def test_create_whose_answer_was_lost_is_still_ours(mailbox_factory: Factory) -> None:
    """The first attempt lands but its answer is a 503; botocore retries and gets 412.
    The token in the object's metadata shows the object is this call's own."""
    mailbox = _s3(mailbox_factory)
    edge = Edge(503, "ServiceUnavailable", count=1, conditional_only=True)
    edge.forwarded_first = True
    mailbox.client.meta.events.register("before-send.s3.PutObject", edge)
    assert asyncio.run(mailbox.create("claims/create/0", b"mine")) is True
    assert asyncio.run(mailbox.get("claims/create/0")) == b"mine"
    assert edge.seen == 2

    # Someone else's object behind a retried 412 is not ours.
    asyncio.run(mailbox.put("claims/create/1", b"theirs"))
    edge2 = Edge(503, "ServiceUnavailable", count=1, conditional_only=True)
    mailbox.client.meta.events.unregister("before-send.s3.PutObject", edge)
    mailbox.client.meta.events.register("before-send.s3.PutObject", edge2)
    assert asyncio.run(mailbox.create("claims/create/1", b"mine")) is False
    assert asyncio.run(mailbox.get("claims/create/1")) == b"theirs"


def test_multipart_put_and_create(mailbox_factory: Factory) -> None:
    mailbox = _s3(mailbox_factory, multipart_threshold=6 * MiB, part_size=5 * MiB)
    big = bytes(range(256)) * (11 * MiB // 256) + b"tail"
    other = b"\x01" * (7 * MiB)
    uploads: list[str] = []

    def count(request: AWSPreparedRequest, **_: Any) -> None:
        uploads.append(request.url)

    mailbox.client.meta.events.register("before-send.s3.CreateMultipartUpload", count)

    async def body() -> None:
        await mailbox.put("theta/0/00000001.safetensors", big)
        assert await mailbox.get("theta/0/00000001.safetensors") == big
        assert await mailbox.create("theta/0/00000002.safetensors", big) is True
        assert await mailbox.create("theta/0/00000002.safetensors", other) is False
        assert await mailbox.get("theta/0/00000002.safetensors") == big
        await mailbox.put("theta/0/small", b"under the threshold")

    asyncio.run(body())
    assert len(uploads) == 3
    left = mailbox.client.list_multipart_uploads(Bucket=mailbox.bucket)
    assert left.get("Uploads", []) == []  # the refused create aborted its upload


def test_missing_boto3_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)
    mailbox = S3Mailbox("bucket")
    with pytest.raises(MissingExtra) as info:
        asyncio.run(mailbox.get("k"))
    assert str(info.value) == (
        "the optional dependency 's3' is needed for S3 mailboxes (s3:// URLs); "
        "install it with: pip install 'gradientmail[s3]'"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket": "Bad_Bucket"}, "bucket name 'Bad_Bucket' is not a valid S3 bucket name"),
        ({"bucket": "ok-bucket", "part_size": MiB}, "part_size=1048576 must be >= 5242880"),
        (
            {"bucket": "ok-bucket", "multipart_threshold": 6 * MiB, "part_size": 8 * MiB},
            "multipart_threshold=6291456 must be >= part_size=8388608",
        ),
        ({"bucket": "ok-bucket", "max_concurrency": 0}, "max_concurrency=0 must be >= 1"),
        ({"bucket": "ok-bucket", "retry_mode": "eager"}, "retry_mode='eager' is not one of"),
        ({"bucket": "ok-bucket", "prefix": "a/../b"}, "S3 mailbox prefix 'a/../b' is not usable"),
    ],
)
def test_config_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        S3Mailbox(**kwargs)
    assert str(info.value).startswith(message)


def test_prefix_isolates_runs(mailbox_factory: Factory, s3_bucket: str, moto_endpoint: str) -> None:
    a = S3Mailbox(s3_bucket, "shared/run-a", endpoint_url=moto_endpoint)
    b = S3Mailbox(s3_bucket, "/shared/run-a-b/", endpoint_url=moto_endpoint)
    assert (a.url, b.url) == (
        f"s3://{s3_bucket}/shared/run-a/",
        f"s3://{s3_bucket}/shared/run-a-b/",
    )

    async def body() -> None:
        await a.put("rounds/00000000.json", b"a")
        await b.put("rounds/00000000.json", b"b")
        assert await a.list() == ["rounds/00000000.json"]
        assert await b.list() == ["rounds/00000000.json"]
        assert await a.get("rounds/00000000.json") == b"a"
        await a.close()
        await b.close()

    asyncio.run(body())
