"""Events: frozen dataclasses describing what a learner or syncer did, and `log_events`.

Every runtime reports through a callback `on_event(event)`; `log_events` is the default
and the integrations turn events into metrics. Modules define their own event classes as
subclasses of `Event` here, so one import gives the whole vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

__all__ = ["Event", "EventSink", "log_events"]

_log = logging.getLogger("gradientmail")


@dataclasses.dataclass(frozen=True)
class Event:
    """Base of every event. `level` is the logging level `log_events` uses."""

    @property
    def level(self) -> int:
        return logging.INFO

    def describe(self) -> str:
        fields = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
        )
        return f"{type(self).__name__}({fields})"


EventSink = Callable[[Event], None]


def log_events(event: Event) -> None:
    """Log an event on the `gradientmail` logger at the event's level."""
    _log.log(event.level, "%s", event.describe())
