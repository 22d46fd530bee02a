"""Every error gradientmail raises, under one base class.

Two families are kept apart (as h11 does): *usage* errors mean this process misused the
API or was configured wrongly; *remote* errors mean a peer or the store handed us
something bad. Each message names the value, the rule it broke and, where there is one,
the fix.
"""

from __future__ import annotations

__all__ = [
    "AlreadyContributed",
    "AuthenticationError",
    "ConditionalWriteUnsupported",
    "ConfigError",
    "CorruptPayload",
    "GradientmailError",
    "LocalProtocolError",
    "MailboxError",
    "MissingExtra",
    "NonFiniteError",
    "ProtocolError",
    "RemoteProtocolError",
    "RunConfigMismatch",
    "RunVanished",
    "SchemaMismatch",
]


class GradientmailError(Exception):
    """Base of every error the library raises."""


class ConfigError(GradientmailError, ValueError):
    """A configuration value or an API argument is invalid (our own misuse)."""


class MissingExtra(GradientmailError, ImportError):
    """An optional dependency is not installed; the message names the extra."""

    def __init__(self, extra: str, purpose: str = "") -> None:
        self.extra = extra
        what = f" for {purpose}" if purpose else ""
        super().__init__(
            f"the optional dependency {extra!r} is needed{what}; "
            f"install it with: pip install 'gradientmail[{extra}]'"
        )


class NonFiniteError(GradientmailError, ValueError):
    """A tensor holds NaN or infinity where only finite values are allowed."""


class ProtocolError(GradientmailError):
    """Something about the run's records or payloads is wrong."""


class LocalProtocolError(ProtocolError, ValueError):
    """This process asked for something the protocol does not allow (bad key, bad id)."""


class AlreadyContributed(LocalProtocolError):
    """A learner published to a round it already has a contribution in (one per round)."""


class RemoteProtocolError(ProtocolError):
    """A peer or the store handed us bad data: a record or payload we cannot accept."""


class AuthenticationError(RemoteProtocolError):
    """A record of an authenticated run failed its check (unsealed, altered, forged or
    sealed with another run key), or this process's run key does not match the run's."""


class RunVanished(RemoteProtocolError):
    """The run a learner joined is gone from its mailbox (its manifest was deleted: the
    directory removed, the bucket or prefix emptied): nothing it trains can be merged."""


class CorruptPayload(RemoteProtocolError):
    """Payload bytes that cannot be decoded: truncated, corrupted, oversized or hostile."""


class SchemaMismatch(GradientmailError):
    """Tensors do not match the schema; the message names every differing parameter."""


class RunConfigMismatch(GradientmailError):
    """This process's algorithm configuration differs from the run's manifest."""


class MailboxError(GradientmailError):
    """The object store failed an operation (after retries); chained to the cause."""


class ConditionalWriteUnsupported(MailboxError):
    """The store (or a proxy in front of it) ignores create-if-absent; unsafe to use."""
