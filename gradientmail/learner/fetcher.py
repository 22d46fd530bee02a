"""A commit's parameters, fetched for a learner by the cheapest way it has.

Copies of a fragment's bytes on the way in (F32, codec off): download, `decode` (none:
the tensors view the payload; zstd: decompress and unshuffle), `adapter.load` (one copy
straight from the payload onto the device, the anchor the learner keeps), and the
training thread's `apply` (the parameters' in-place copy).
"""

from __future__ import annotations

import asyncio

from gradientmail.adapters.base import Adapter
from gradientmail.algorithms.outer import rebuild_theta
from gradientmail.errors import (
    ConfigError,
    GradientmailError,
    RemoteProtocolError,
    SchemaMismatch,
)
from gradientmail.learner.messages import Commit
from gradientmail.learner.sharded import ranks_of
from gradientmail.run.bounds import payload_bound
from gradientmail.run.join import JoinResult
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import theta_digest
from gradientmail.wire.records import RoundRecord
from gradientmail.wire.serialization import validate
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = ["CommitFetcher"]


class CommitFetcher:
    """Fetches commits for a learner that joined as `joined` says, holding the host bytes
    of each fragment's newest commit to rebuild the next from its update (communication
    thread only)."""

    def __init__(self, exchange: Exchange, adapter: Adapter, joined: JoinResult) -> None:
        self._exchange = exchange
        self._adapter = adapter
        self._plan = joined.plan
        self._replica = joined.replica
        self._host: dict[int, tuple[int, dict[str, TensorBytes]]] = {
            p: (version, theta)
            for p, ((version, _), theta) in enumerate(
                zip(joined.fragments, joined.thetas, strict=True))
        }

    async def fetch(self, rec: RoundRecord) -> Commit | None:
        """The commit's parameters, loaded onto the model's device. With a replicated
        outer step, the replica's state at its version (its step applied to the state
        held); otherwise rebuilt from its quantized update when this learner holds the
        previous version (checked against the record's digest), else downloaded. None
        when the payloads were swept; a `Commit` with `rejected` set when the parameters
        do not fit the model (a tensor missing, or of another shape or dtype), so that a
        bad commit is reported and passed over instead of raising on the training thread."""
        ex = self._exchange
        names = self._plan[rec.fragment]
        schema = self._adapter.schema
        if ranks_of(self._adapter) is not None:
            return await self._fetch_rows(rec)
        theta: dict[str, TensorBytes] | None = None
        nbytes = 0
        replica = self._replica
        if replica.algorithm.replicated:
            before = replica.bytes_down
            try:
                state = await replica.at(rec.fragment, rec)
            except SchemaMismatch as exc:
                # A step that does not fit the model: the chain cannot go past it, so each
                # later step of this fragment is passed over too, until a checkpoint
                # restarts the chain. (A payload that fails its digest or bound is
                # retried instead, as a read the store may serve right next time.)
                return Commit(rec, None, 0, rejected=str(exc))
            if state is None:
                return None
            theta, nbytes = dict(state.theta), replica.bytes_down - before
        held = self._host.get(rec.fragment)
        if theta is None and rec.update is not None and held is not None \
                and held[0] == rec.version - 1:
            update = await ex.store.fetch_tensors(rec.update.payload,
                                            payload_bound(schema, names, "updates"))
            if update is not None:
                try:
                    rebuilt = await asyncio.to_thread(
                        rebuild_theta, held[1], update, rec.update.format)
                except (GradientmailError, ValueError):
                    rebuilt = None  # an update that does not fit: the full theta decides
                if rebuilt is not None and \
                        theta_digest(rebuilt, names) == rec.update.theta_sha256:
                    theta, nbytes = rebuilt, rec.update.payload.size
        if theta is None:
            if rec.theta is None:
                raise RemoteProtocolError(
                    f"round {rec.round}'s record carries no theta and this run does not "
                    "replicate its outer step"
                )
            fetched = await ex.store.fetch_tensors(rec.theta, payload_bound(schema, names, "theta"))
            if fetched is None:
                return None
            theta, nbytes = fetched, rec.theta.size
        try:
            validate(schema, theta, names)
        except SchemaMismatch as exc:
            return Commit(rec, None, nbytes, rejected=str(exc))
        self._host[rec.fragment] = (rec.version, theta)
        loaded = await asyncio.to_thread(self._adapter.load, theta)
        return Commit(rec, loaded, nbytes)

    async def _fetch_rows(self, rec: RoundRecord) -> Commit | None:
        """A commit read by a learner whose ranks each read their own rows (`Ranks.load`),
        and with a replicated outer step replay it on their own rows of the state: no rank
        downloads the fragment, so none holds it to rebuild the next version from an
        update."""
        ranks = ranks_of(self._adapter)
        assert ranks is not None
        try:
            loaded, nbytes = await ranks.load(self._exchange, self._replica.manifest,
                                             rec.fragment, rec)
        except (RemoteProtocolError, SchemaMismatch, ConfigError) as exc:
            return Commit(rec, None, 0, rejected=str(exc))
        return None if loaded is None else Commit(rec, loaded, nbytes)
