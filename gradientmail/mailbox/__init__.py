"""Mailboxes: the object store as the run's only shared thing.

`open_mailbox(url)` picks the implementation: a directory (`LocalMailbox`, the embedded
default), S3 or an S3-compatible store (`S3Mailbox`), or memory (`MemoryMailbox`, tests).
`verify_conditional_writes` checks a store honours create-if-absent; `CountingMailbox`
and `FaultyMailbox` wrap any mailbox for measurements and failure tests.
"""

from gradientmail.mailbox.base import Mailbox, check_key, check_prefix
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.s3 import S3Mailbox
from gradientmail.mailbox.selftest import verify_conditional_writes
from gradientmail.mailbox.url import open_mailbox
from gradientmail.mailbox.wrappers import CountingMailbox, FaultPlan, FaultRule, FaultyMailbox
from gradientmail.traffic import RequestCounts

__all__ = [
    "CountingMailbox",
    "FaultPlan",
    "FaultRule",
    "FaultyMailbox",
    "LocalMailbox",
    "Mailbox",
    "MemoryMailbox",
    "RequestCounts",
    "S3Mailbox",
    "check_key",
    "check_prefix",
    "open_mailbox",
    "verify_conditional_writes",
]
