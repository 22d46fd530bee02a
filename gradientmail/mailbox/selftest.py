"""Check that a store really honours create-if-absent before a run trusts it.

Some S3-compatible stores and proxies drop the `If-None-Match` header silently; every
election in a run would then have several winners. `verify_conditional_writes` finds out
with one probe key.
"""

from __future__ import annotations

import secrets

from gradientmail.errors import ConditionalWriteUnsupported
from gradientmail.mailbox.base import Mailbox

__all__ = ["verify_conditional_writes"]


async def verify_conditional_writes(mailbox: Mailbox, prefix: str = "selftest/") -> None:
    """Create a probe key twice; raise `ConditionalWriteUnsupported` unless the second
    create returns False and leaves the first object in place. The probe is deleted."""
    key = f"{prefix}{secrets.token_hex(8)}"
    first, second = b"probe-1:" + secrets.token_bytes(8), b"probe-2:" + secrets.token_bytes(8)
    fix = (
        "use a store that supports conditional writes (AWS S3, Cloudflare R2, MinIO, "
        "a local directory) and no proxy that strips the If-None-Match header"
    )
    try:
        if not await mailbox.create(key, first):
            raise ConditionalWriteUnsupported(
                f"{mailbox.url} does not honour create-if-absent: creating the new probe key "
                f"{key!r} returned False although nothing was there; {fix}"
            )
        if await mailbox.create(key, second):
            raise ConditionalWriteUnsupported(
                f"{mailbox.url} does not honour create-if-absent: a second create of probe "
                f"key {key!r} returned True (it must return False because the key exists), "
                f"so elections would have several winners; {fix}"
            )
        if await mailbox.get(key) != first:
            raise ConditionalWriteUnsupported(
                f"{mailbox.url} does not honour create-if-absent: a refused create of probe "
                f"key {key!r} still replaced the object; {fix}"
            )
    finally:
        await mailbox.delete(key)
