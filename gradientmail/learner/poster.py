"""A learner's contributions on their way out: anchor − θ, quantized, encoded, offered to
its embedded closer or uploaded, and a failed upload settled.

The mailman's publish loop hands each `Outgoing` job to `Poster.post`, one at a time.
Copies of a fragment's bytes on the way out (F32, codec off; "+1 GPU" where a device adds
one): the snapshot clone (training thread), anchor − θ (a new tensor), its device-to-host
copy (GPU only; `from_torch` then holds that host memory as is), quantize (only with a
delta_dtype: the codes; an adapter with `delta_quantized` quantizes on the GPU and copies
only the codes to the host; a sparse delta_dtype keeps anchor − θ on the device, where it
becomes the fragment's residual once encoded, and only the payload's bytes come to the
host: `learner.feedback`), `pack` (header and tensors joined into one blob), upload. The
way in is `gradientmail.learner.fetcher`.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable

from gradientmail.adapters.base import Adapter
from gradientmail.algorithms.base import Algorithm
from gradientmail.clock import Clock
from gradientmail.errors import LocalProtocolError
from gradientmail.events import EventSink, PublishCancelled, PublishFailed, SnapshotPublished
from gradientmail.learner.feedback import ErrorFeedback, Residuals
from gradientmail.learner.messages import Outgoing, delta_format
from gradientmail.learner.sharded import Sparse, ranks_of
from gradientmail.run.protocol import Exchange
from gradientmail.syncer.hosted import Host
from gradientmail.wire.quantization import quantize
from gradientmail.wire.records import RoundRecord, SnapshotRecord
from gradientmail.wire.sparse import SPARSE_FORMATS, default_density
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["Poster"]


class Poster:
    """Publishes the contributions of learner `learner` through `exchange`. `closed()` is
    the newest round whose commit the learner has (a job of a round closed already is
    cancelled), `host` the seam to the learner's embedded closer (None without one),
    `wake` wakes the receive loop, and `failed` takes the rounds whose publish is known not to
    have landed (the training thread retracts them). With a sparse `delta_dtype` it
    keeps each fragment's error feedback in `residuals` (the learner's, which its
    checkpoints hold; a new one by default), which `recorded` settles."""

    def __init__(
        self,
        exchange: Exchange,
        adapter: Adapter,
        algorithm: Algorithm,
        learner: str,
        plan: tuple[tuple[str, ...], ...],
        *,
        clock: Clock,
        on_event: EventSink,
        hold_own: bool,
        closed: Callable[[], int],
        host: Host | None,
        wake: asyncio.Event,
        failed: queue.SimpleQueue[int],
        poll_interval: float = 1.0,
        residuals: ErrorFeedback | None = None,
    ) -> None:
        self._ex = exchange
        self._adapter = adapter
        self._algorithm = algorithm
        self._learner = learner
        self._plan = plan
        self._clock = clock
        self._on_event = on_event
        self._hold_own = hold_own
        self._closed = closed
        self._host = host
        self._wake = wake
        self._failed_rounds = failed
        self._poll_interval = poll_interval
        self.residuals: ErrorFeedback = residuals if residuals is not None \
            else Residuals(learner)

    def recorded(self, record: RoundRecord) -> None:
        """The commit of `record.round` arrived: a sparse payload of it that the round
        left out gives its residual back (`Residuals.recorded`)."""
        self.residuals.recorded(record.round, tuple(p.learner for p in record.participants))

    def swept(self, record: RoundRecord) -> None:
        """The records before `record` (the newest commit of its fragment, read instead of
        them: they were swept) settle this learner's sparse payloads of that fragment
        (`Residuals.swept`)."""
        self.residuals.recorded(record.round, tuple(p.learner for p in record.participants))
        self.residuals.swept(record.fragment, record.round,
                             any(p.learner == self._learner for p in record.participants))

    async def post(self, job: Outgoing) -> None:
        """Publish `job`; a failure is reported (and settled), never raised."""
        t0 = self._clock.now()
        try:
            await self._publish(job, t0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._failed(job, exc, t0)

    async def _failed(self, job: Outgoing, exc: Exception, t0: float) -> None:
        """A publish raised. Unless the error was our own (a refused field, a round taken
        already), its record may have been written all the same (the answer was lost, or
        the retries ran out after an attempt that landed), so look before retracting: a
        retracted publish whose record landed would have its steps counted twice (once in
        the commit that merged it, again with the next publish)."""
        if isinstance(exc, LocalProtocolError):
            # A refused field, or a round this learner id has a record in already (an
            # earlier run of it): the steps go out with a later round.
            outcome, record = "absent", None
        else:
            outcome, record = await self._settle(job)
        if record is not None:
            self._published(job, record, t0)
            return
        self._on_event(PublishFailed(self._learner, job.round, repr(exc)))
        if outcome == "absent":
            self.residuals.failed(job.round)
            # Known not written: the round may be published again, the steps go out later.
            # ("closed": the commit's participants say whether it was merged; the training
            # thread learns it from there.)
            self._failed_rounds.put(job.round)

    async def _settle(self, job: Outgoing) -> tuple[str, SnapshotRecord | None]:
        """Whether a failed publish's record landed: ("landed", record), ("absent", None),
        or ("closed", None) when the round's commit arrived before the store would say
        (one GET per poll interval while it fails)."""
        ex = self._ex
        while self._closed() < job.round:
            try:
                record = await ex.contribution(job.round, self._learner)
            except asyncio.CancelledError:
                raise
            except Exception:
                await self._clock.sleep(self._poll_interval)
                continue
            if record is not None and job.landed_as(record):
                return "landed", record
            return "absent", None
        return "closed", None

    def _published(self, job: Outgoing, record: SnapshotRecord, t0: float,
                   tensors: dict[str, TensorBytes] | None = None, held: bool = False) -> None:
        host = self._host
        if host is not None and not held:
            host.note(job.round, record.payload, tensors)
            self._wake.set()
        self._on_event(
            SnapshotPublished(
                self._learner,
                job.round,
                job.fragment,
                job.steps,
                job.tokens,
                record.payload_size,
                self._clock.now() - t0,
                held,
            )
        )

    async def _publish(self, job: Outgoing, t0: float) -> None:
        ex = self._ex
        if job.round <= self._closed() and not job.final:
            self._on_event(PublishCancelled(self._learner, job.round, "round already closed"))
            return
        fmt = delta_format(self._algorithm.delta_dtype,
                           [self._adapter.schema[n].dtype for n in self._plan[job.fragment]])
        draft = job.draft(ex, self._learner, self._adapter.schema.digest(), fmt)
        ranks = ranks_of(self._adapter)
        if ranks is not None:
            # Every rank uploads its own rows: no rank holds the whole delta, so nothing
            # is offered to the embedded closer from memory. Sparse: each rank keeps the
            # error feedback of its own rows (`Ranks.feedback`).
            parts = await ranks.upload(ex, job.round, self._learner, job.anchor,
                                       job.snapshot, fmt, self._sparse(job, fmt))
            self._published(job, await ex.publish_parts(draft, parts), t0)
            return
        tensors = await asyncio.to_thread(self._encode, job, fmt)
        # A run kept auditable (`keep_rounds`) holds nothing back: a merge is re-derived
        # from the uploaded contributions, and a held one was never uploaded.
        hold = self._hold_own and self._algorithm.keep_rounds is None
        if hold and self._host is not None:
            # Offered to the embedded closer first: if this contribution completes the
            # round's set, the closer merges it from memory and it is never uploaded.
            taken = self._host.offer(draft, tensors)
            self._wake.set()
            if await taken:
                self._published(job, draft, t0, held=True)
                return
        record = await ex.publish_draft(draft, tensors)
        self._published(job, record, t0, tensors)

    def _sparse(self, job: Outgoing, fmt: str) -> Sparse | None:
        """How `job`'s delta is sparsified in `fmt` (None: a dense format)."""
        if fmt not in SPARSE_FORMATS:
            return None
        density, decay = self._algorithm.delta_density, self._algorithm.feedback_decay
        return Sparse(job.fragment, default_density(fmt) if density is None else density,
                      1.0 if decay is None else decay,
                      self._algorithm.feedback_momentum or 0.0)

    def _encode(self, job: Outgoing, fmt: str) -> dict[str, TensorBytes]:
        sparse = self._sparse(job, fmt)
        if sparse is not None:
            # On the model's device where the adapter offers it: the residuals live there.
            on_device = getattr(self._adapter, "delta_tensors", None)
            delta = (on_device(job.anchor, job.snapshot) if on_device is not None
                     else self._adapter.delta(job.anchor, job.snapshot))
            return self.residuals.encode(job.round, job.fragment, delta, sparse.density,
                                         sparse.decay, fmt, sparse.momentum)
        quantized = getattr(self._adapter, "delta_quantized", None)
        if fmt != "F32" and quantized is not None:
            entries: dict[str, TensorBytes] = quantized(job.anchor, job.snapshot, fmt)
            return entries
        delta = self._adapter.delta(job.anchor, job.snapshot)
        if fmt == "F32":
            return delta
        out: dict[str, TensorBytes] = {}
        for name, tensor in delta.items():
            out.update(quantize(name, tensor, fmt))
        return out
