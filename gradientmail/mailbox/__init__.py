"""Mailboxes: the object store as the run's only shared thing."""

from gradientmail.mailbox.base import Mailbox, check_key
from gradientmail.mailbox.memory import MemoryMailbox

__all__ = ["Mailbox", "MemoryMailbox", "check_key"]
