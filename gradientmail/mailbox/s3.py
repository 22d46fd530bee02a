"""S3Mailbox: the Mailbox contract on S3 or any S3-compatible store (MinIO, R2, moto).

`create` is `PutObject` with `If-None-Match: *`: 412 PreconditionFailed means the key
exists (older MinIO answers 304, read the same way); 409 ConditionalRequestConflict (a
concurrent write to the key) is retried with jittered exponential backoff. Throttling (503
SlowDown), other 5xx and connection errors are retried by botocore's own retry modes; no
other 4xx is retried. Objects of `multipart_threshold` bytes or more go up in parts (for
`create`, with `If-None-Match` on CompleteMultipartUpload, which S3, MinIO and moto honour).
A bucket should expire incomplete multipart uploads (a lifecycle rule): an upload cut off
by a crash is otherwise billed forever.

Endpoint, region and credentials come from the standard AWS chain (environment variables
including `AWS_ENDPOINT_URL`, profiles, instance roles) unless given explicitly. boto3 is
imported on first use; blocking calls run in a bounded pool of `max_concurrency` threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import random
import re
import secrets
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import ConfigError, LocalProtocolError, MailboxError, MissingExtra
from gradientmail.mailbox.base import Mailbox, check_key, check_prefix, check_range

__all__ = ["S3Mailbox"]

MiB = 1024 * 1024
_MIN_PART = 5 * MiB  # S3's smallest part (all but the last)
_MAX_PARTS = 10_000
_PAGE = 1000
_TOKEN = "gradientmail-token"  # metadata naming the create call that wrote an object
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_T = TypeVar("_T")
_SESSIONS: dict[str | None, Any] = {}
_SESSIONS_LOCK = threading.Lock()


class S3Mailbox(Mailbox):
    """Keys under `prefix` in `bucket`. No I/O happens before the first operation.

    Options: `endpoint_url` (MinIO, R2, moto; default from the AWS chain), `region_name`,
    `profile` (a named AWS profile), `max_concurrency` (threads and HTTP connections),
    `multipart_threshold` / `part_size` (bytes), `retry_mode` ("standard" or "adaptive")
    and `max_attempts` for botocore's retries, `create_attempts` for 409 conflicts on
    create, `addressing_style` ("path" for stores without virtual-host buckets), and
    `clock` for the create backoff. `read_only=True` refuses `put`, `create` and `delete`
    (`LocalProtocolError`) before any request.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        profile: str | None = None,
        max_concurrency: int = 16,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 16 * MiB,
        retry_mode: str = "standard",
        max_attempts: int = 5,
        create_attempts: int = 8,
        addressing_style: str | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        clock: Clock | None = None,
        read_only: bool = False,
    ) -> None:
        if not _BUCKET.match(bucket):
            raise ConfigError(
                f"bucket name {bucket!r} is not a valid S3 bucket name: 3 to 63 characters "
                "of lowercase letters, digits, '.' and '-', starting and ending with a "
                "letter or digit"
            )
        prefix = prefix.strip("/")
        if prefix:
            try:
                check_key(prefix)
            except LocalProtocolError as exc:
                raise ConfigError(f"S3 mailbox prefix {prefix!r} is not usable: {exc}") from exc
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency={max_concurrency} must be >= 1")
        if part_size < _MIN_PART:
            raise ConfigError(f"part_size={part_size} must be >= {_MIN_PART} (S3's minimum)")
        if multipart_threshold < part_size:
            raise ConfigError(
                f"multipart_threshold={multipart_threshold} must be >= part_size={part_size}"
            )
        if retry_mode not in ("standard", "adaptive", "legacy"):
            raise ConfigError(
                f"retry_mode={retry_mode!r} is not one of 'standard', 'adaptive', 'legacy'"
            )
        if max_attempts < 1 or create_attempts < 1:
            raise ConfigError(
                f"max_attempts={max_attempts} and create_attempts={create_attempts} must be >= 1"
            )
        if addressing_style not in (None, "auto", "path", "virtual"):
            raise ConfigError(
                f"addressing_style={addressing_style!r} is not one of 'auto', 'path', 'virtual'"
            )
        self.bucket = bucket
        self.prefix = prefix + "/" if prefix else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.profile = profile
        self.max_concurrency = max_concurrency
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.retry_mode = retry_mode
        self.max_attempts = max_attempts
        self.create_attempts = create_attempts
        self.addressing_style = addressing_style
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._clock: Clock = clock or MonotonicClock()
        self.read_only = read_only
        self._lock = threading.Lock()
        self._client: Any = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    # -- the contract -------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        full = self._full(key)

        def fetch() -> bytes | None:
            from botocore.exceptions import ClientError

            try:
                return self._fetch(full)
            except ClientError as exc:
                if _code(exc) in ("NoSuchKey", "404", "NotFound"):
                    return None
                raise

        return await self._run("get", key, fetch)

    async def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        full = self._full(key)
        check_range(key, start, stop)

        def fetch() -> bytes | None:
            from botocore.exceptions import ClientError

            try:
                if start == stop:  # HTTP cannot ask for no bytes; ask whether the key exists
                    self._invoke("head_object", {"Bucket": self.bucket, "Key": full})
                    return b""
                return self._fetch(full, Range=f"bytes={start}-{stop - 1}")
            except ClientError as exc:
                if _code(exc) in ("NoSuchKey", "404", "NotFound"):
                    return None
                if _status(exc) == 416 or _code(exc) == "InvalidRange":
                    return b""  # the object exists and ends before `start`
                raise

        return await self._run("get_range", key, fetch)

    async def put(self, key: str, data: bytes) -> None:
        full = self._full(key)
        self._writable("put", key)
        data = bytes(data)
        if len(data) >= self.multipart_threshold:
            await self._multipart("put", key, data, {})
            return
        await self._run("put", key, self._call("put_object", Key=full, Body=data))

    async def create(self, key: str, data: bytes) -> bool:
        full = self._full(key)
        self._writable("create", key)
        _require_boto3()
        from botocore.exceptions import ClientError

        data = bytes(data)
        token = secrets.token_hex(12)
        ambiguous = False  # an earlier attempt of this call may have landed
        for attempt in range(1, self.create_attempts + 1):
            try:
                if len(data) >= self.multipart_threshold:
                    await self._multipart("create", key, data, {_TOKEN: token}, if_none_match=True)
                else:
                    call = self._call(
                        "put_object", Key=full, Body=data, IfNoneMatch="*", Metadata={_TOKEN: token}
                    )
                    await self._run("create", key, call, translate=False)
                return True
            except ClientError as exc:
                status, code = _status(exc), _code(exc)
                retries = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
                ambiguous = ambiguous or bool(retries)
                if status in (412, 304) or code == "PreconditionFailed":
                    # After a retried attempt the object may be our own earlier write whose
                    # answer was lost; the token in its metadata tells.
                    return ambiguous and await self._written_by(key, token)
                if (status == 409 or code == "ConditionalRequestConflict") and (
                    attempt < self.create_attempts
                ):
                    await self._clock.sleep(self._backoff(attempt))
                    continue
                raise self._error("create", key, exc) from exc
        raise AssertionError("unreachable")

    async def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        check_prefix(prefix)
        kwargs: dict[str, Any] = {"Prefix": self.prefix + prefix, "MaxKeys": _PAGE}
        if start_after is not None:
            kwargs["StartAfter"] = self.prefix + start_after
        keys: list[str] = []
        cut = len(self.prefix)
        while True:
            page = await self._run("list", prefix, self._call("list_objects_v2", **kwargs))
            for item in page.get("Contents", []):
                key = item["Key"][cut:]
                if _valid(key):  # objects other tools wrote under odd names are not ours
                    keys.append(key)
            if not page.get("IsTruncated"):
                return keys
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    async def delete(self, key: str) -> None:
        full = self._full(key)
        self._writable("delete", key)
        await self._run("delete", key, self._call("delete_object", Key=full))

    async def close(self) -> None:
        """Shut the thread pool down and close the HTTP connections (reopened on next use)."""
        with self._lock:
            pool, client = self._pool, self._client
            self._pool = self._client = None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            client.close()

    # -- plumbing ------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The boto3 S3 client, created on first use (tests register botocore events on it)."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
                client = self._client
        return client

    def _make_client(self) -> Any:
        _require_boto3()
        import boto3
        from botocore.config import Config

        # Typed as Any: the stubs' TypedDicts want literal modes, ours is validated above.
        retries: Any = {"mode": self.retry_mode, "max_attempts": self.max_attempts}
        s3: Any = {"addressing_style": self.addressing_style} if self.addressing_style else None
        config = Config(
            retries=retries,
            max_pool_connections=self.max_concurrency,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            s3=s3,
        )
        # A boto3 session loads the service model once; reusing it makes a new client
        # cheap (~10 ms instead of ~200 ms). Sessions are not thread-safe: hence the lock.
        with _SESSIONS_LOCK:
            session = _SESSIONS.get(self.profile)
            if session is None:
                session = _SESSIONS[self.profile] = boto3.session.Session(profile_name=self.profile)
            return session.client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=self.region_name,
                config=config,
            )

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.max_concurrency, thread_name_prefix="gradientmail-s3"
                )
            return self._pool

    def _call(self, method: str, **kwargs: Any) -> Callable[[], Any]:
        """A blocking call of client.<method>(Bucket=bucket, **kwargs), for `_run`."""
        return functools.partial(self._invoke, method, {"Bucket": self.bucket, **kwargs})

    def _invoke(self, method: str, kwargs: dict[str, Any]) -> Any:
        return getattr(self.client, method)(**kwargs)

    def _writable(self, op: str, key: str) -> None:
        if self.read_only:
            raise LocalProtocolError(
                f"{op} of {key!r} refused: {self.url} was opened read-only; open it without "
                "read_only=True to write"
            )

    def _full(self, key: str) -> str:
        return self.prefix + check_key(key)

    async def _run(self, op: str, key: str, fn: Callable[[], _T], *, translate: bool = True) -> _T:
        """Run a blocking call in the pool; translate botocore errors unless told not to."""
        _require_boto3()
        from botocore.exceptions import BotoCoreError, ClientError

        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor(), fn)
        except ClientError as exc:
            if not translate:
                raise
            raise self._error(op, key, exc) from exc
        except BotoCoreError as exc:
            raise self._error(op, key, exc) from exc

    def _fetch(self, full: str, **extra: str) -> bytes:
        from botocore.exceptions import (
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )

        # botocore retries the request, not the reading of the body that follows it.
        for attempt in range(1, self.max_attempts + 1):
            response = self._invoke("get_object", {"Bucket": self.bucket, "Key": full, **extra})
            try:
                data: bytes = response["Body"].read()
                return data
            except (IncompleteReadError, ReadTimeoutError, ResponseStreamingError):
                if attempt == self.max_attempts:
                    raise
        raise AssertionError("unreachable")

    async def _multipart(
        self,
        op: str,
        key: str,
        data: bytes,
        metadata: dict[str, str],
        *,
        if_none_match: bool = False,
    ) -> None:
        full = self._full(key)
        size = max(self.part_size, math.ceil(len(data) / _MAX_PARTS))
        upload = await self._run(
            op, key, self._call("create_multipart_upload", Key=full, Metadata=metadata)
        )
        upload_id: str = upload["UploadId"]
        view = memoryview(data)
        # A semaphore per call: the mailbox may be used from several event loops.
        gate = asyncio.Semaphore(self.max_concurrency)

        async def part(number: int, offset: int) -> dict[str, Any]:
            body = bytes(view[offset : offset + size])
            call = self._call(
                "upload_part", Key=full, UploadId=upload_id, PartNumber=number, Body=body
            )
            async with gate:
                answer = await self._run(op, key, call)
            return {"ETag": answer["ETag"], "PartNumber": number}

        try:
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [
                        group.create_task(part(i + 1, offset))
                        for i, offset in enumerate(range(0, len(data), size))
                    ]
            except BaseExceptionGroup as failed:
                raise failed.exceptions[0] from None
            parts = [task.result() for task in tasks]
            extra: dict[str, Any] = {"IfNoneMatch": "*"} if if_none_match else {}
            complete = self._call(
                "complete_multipart_upload",
                Key=full,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **extra,
            )
            await self._run(op, key, complete, translate=not if_none_match)
        except BaseException:
            abort = self._call("abort_multipart_upload", Key=full, UploadId=upload_id)
            with contextlib.suppress(Exception):  # the original error matters more
                await self._run(op, key, abort)
            raise

    async def _written_by(self, key: str, token: str) -> bool:
        from botocore.exceptions import ClientError

        full = self._full(key)

        def head() -> dict[str, Any] | None:
            try:
                answer: dict[str, Any] = self._call("head_object", Key=full)()
                return answer
            except ClientError as exc:
                if _status(exc) == 404:
                    return None
                raise

        answer = await self._run("create", key, head)
        return answer is not None and answer.get("Metadata", {}).get(_TOKEN) == token

    def _backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(2 s, 50 ms * 2^(attempt-1))]."""
        return random.uniform(0.0, min(2.0, 0.05 * 2 ** (attempt - 1)))

    def _endpoint(self) -> str:
        client = self._client
        if client is not None:
            return str(client.meta.endpoint_url)
        return self.endpoint_url or "the default AWS endpoint"

    def _error(self, op: str, key: str, exc: Exception) -> MailboxError:
        from botocore.exceptions import (
            ClientError,
            EndpointConnectionError,
            NoCredentialsError,
            NoRegionError,
        )

        endpoint = self._endpoint()
        what = f"{op} of s3://{self.bucket}/{self.prefix}{key} at {endpoint}"
        if isinstance(exc, ClientError):
            code, status = _code(exc), _status(exc)
            message = exc.response.get("Error", {}).get("Message", "")
            if code == "NoSuchBucket":
                return MailboxError(
                    f"{what} failed: the bucket {self.bucket!r} does not exist; create it "
                    f"first, e.g. `aws s3 mb s3://{self.bucket} --endpoint-url {endpoint}` "
                    "(drop --endpoint-url for AWS itself)"
                )
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return MailboxError(
                    f"{what} failed: {code} (HTTP {status}): {message}; check the credentials "
                    "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or profile=) and "
                    "the bucket's permissions"
                )
            return MailboxError(f"{what} failed: {code} (HTTP {status}): {message}")
        if isinstance(exc, NoCredentialsError):
            return MailboxError(
                f"{what} failed: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, set AWS_PROFILE, or pass profile="
            )
        if isinstance(exc, NoRegionError):
            return MailboxError(
                f"{what} failed: no AWS region configured; set AWS_DEFAULT_REGION or pass "
                "region_name="
            )
        if isinstance(exc, EndpointConnectionError):
            return MailboxError(
                f"{what} failed: cannot reach the endpoint after {self.max_attempts} attempts "
                f"({exc}); check endpoint_url / AWS_ENDPOINT_URL and the network"
            )
        return MailboxError(f"{what} failed: {type(exc).__name__}: {exc}")


def _require_boto3() -> None:
    try:
        import boto3  # noqa: F401
        import botocore.exceptions  # noqa: F401
    except ImportError as exc:
        raise MissingExtra("s3", "S3 mailboxes (s3:// URLs)") from exc


def _code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: Any) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _valid(key: str) -> bool:
    try:
        check_key(key)
    except LocalProtocolError:
        return False
    return True
