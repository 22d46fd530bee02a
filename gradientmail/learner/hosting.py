"""The closer a learner hosts: built from the learner's options once it has joined.

A learner runs the same `Syncer` a standalone `gradientmail sync` runs, given the learner
as its `Host` (`gradientmail.syncer.hosted`): the two meet there and nowhere else.
"""

from __future__ import annotations

from gradientmail.backends.base import Backend
from gradientmail.backends.numpy_backend import NumpyBackend
from gradientmail.events import EventSink
from gradientmail.learner.options import LearnerOptions
from gradientmail.run.lease import LeaseTracker
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import Replica
from gradientmail.syncer.hosted import Host
from gradientmail.syncer.runtime import CloserSettings, Syncer

__all__ = ["hosted_closer"]


def hosted_closer(exchange: Exchange, learner: str, options: LearnerOptions, *,
                  leases: LeaseTracker, replica: Replica, on_event: EventSink,
                  backend: Backend | None = None) -> tuple[Host, Syncer]:
    """Learner `learner`'s closer on `exchange`, sharing its lease tracker and replica,
    and the host through which its contributions reach it."""
    host = Host(learner, leases, replica, exchange.clock)
    settings = CloserSettings(poll_interval=options.poll_interval,
                              lease_timeout=options.lease_timeout,
                              keep_versions=options.keep_versions)
    # The closer inside a learner merges on one thread: the machine's other cores belong
    # to training. A standalone `gradientmail sync` uses several.
    syncer = Syncer(exchange, closer_id=learner, settings=settings, on_event=on_event,
                    host=host, backend=backend if backend is not None else
                    NumpyBackend(threads=1))
    return host, syncer
