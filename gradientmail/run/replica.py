"""Each fragment's state, followed commit by commit: the replicated outer step's reader.

In a run with a replicated outer step (`DiLoCo.checkpoint_every` K > 1) a commit carries
the merged Δ, not the fragment's parameters: every party holds the fragment's theta, fp32
master and momentum and applies each commit's step itself (`DiLoCo.apply_step`), byte for
byte what the closer computed (the record's `theta_sha256` checks it). A party that holds
no state, or an older one, starts from the fragment's newest checkpoint at or before the
commit (the versions that are multiples of K upload theta and the outer state; version 0
is the run's init) and replays the steps after it. In runs where every commit is a
checkpoint (K = 1), reading a commit is loading it.

One `Replica` serves a learner and the closer embedded in it, so a step is downloaded and
applied once per process, and a closer that closed a round holds its result already.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence

from gradientmail.algorithms.base import Algorithm, FragmentState
from gradientmail.algorithms.registry import algorithm_from_json
from gradientmail.backends.numpy_backend import NumpyBackend
from gradientmail.errors import ConfigError, GradientmailError, RemoteProtocolError
from gradientmail.run.bounds import payload_bound
from gradientmail.run.protocol import Exchange
from gradientmail.wire.records import Manifest, RoundRecord
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = [
    "Chain",
    "Replica",
    "newest_model",
    "require_manifest",
    "state_at",
    "theta_digest",
    "walk_back",
]


def theta_digest(theta: Mapping[str, TensorBytes], names: Sequence[str]) -> str:
    """SHA-256 over each tensor's name, dtype, shape and bytes, in plan order.

    A party that rebuilds theta from a commit's update or step checks its work against
    this."""
    h = hashlib.sha256()
    for n in names:
        t = theta[n]
        h.update(f"{n}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.buffer)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Chain:
    """The way to a commit of a fragment: a base, then `steps` (their records, oldest
    first, each with a step) applied to it. The base is the state held at `base_version`
    when `held`, else the checkpoint `checkpoint` committed, else Θ⁰ (`base_version` 0)."""

    base_version: int
    held: bool
    checkpoint: RoundRecord | None
    steps: tuple[RoundRecord, ...]


async def walk_back(exchange: Exchange, fragments: int, fragment: int, rec: RoundRecord,
                    held: int | None) -> Chain:
    """The chain to `rec`'s version of `fragment` for a party that holds version `held`
    of it (None: nothing), walking the records back from `rec`, one fragment's round
    every `fragments` rounds, to a base: the held version just before a step, a
    checkpoint, or Θ⁰. Reads records only. `RemoteProtocolError` when the records do not
    form a chain (a record of it missing, or one with neither theta nor a step)."""
    steps: list[RoundRecord] = []
    cur = rec
    while True:
        if held is not None and held == cur.version - 1 and cur.step is not None:
            steps.append(cur)
            return Chain(held, True, None, tuple(reversed(steps)))
        if cur.checkpoint:
            return Chain(cur.version, False, cur, tuple(reversed(steps)))
        if cur.step is None:
            raise RemoteProtocolError(f"round {cur.round} commits version {cur.version} of "
                                      f"fragment {fragment} with neither theta nor a step")
        steps.append(cur)
        if cur.version == 1:
            return Chain(0, False, None, tuple(reversed(steps)))
        prev_round = cur.round - fragments
        prev = await exchange.read_round(prev_round) if prev_round >= 0 else None
        if prev is None or prev.fragment != fragment or prev.version != cur.version - 1:
            raise RemoteProtocolError(
                f"round {cur.round} commits version {cur.version} of fragment {fragment}, "
                f"and round {prev_round} is not its version {cur.version - 1}; the run's "
                "records do not form a chain"
            )
        cur = prev


class Replica:
    """The newest state this process holds of each fragment, and how to reach another.

    `at(fragment, rec)` returns the fragment's state at `rec`'s version (at Θ⁰ for None),
    from what it holds when it can; None when a payload it needed was swept under it (a
    newer commit of the fragment exists: start over from the newest record). `bytes_down`
    counts the payload bytes it fetched.
    """

    def __init__(self, exchange: Exchange, manifest: Manifest, algorithm: Algorithm) -> None:
        self.exchange = exchange
        self.manifest = manifest
        self.algorithm = algorithm
        self.states: dict[int, FragmentState] = {}
        self.bytes_down = 0
        # One thread (training owns the others); its pool reuses the arrays of states
        # nothing holds any more, round after round.
        self._backend = NumpyBackend(threads=1)
        self._locks: dict[int, asyncio.Lock] = {}

    def held(self, fragment: int) -> FragmentState | None:
        """The state held of `fragment`, if any."""
        return self.states.get(fragment)

    def hold(self, state: FragmentState) -> None:
        """Keep `state` (a closer's result) unless a newer version is held."""
        held = self.states.get(state.fragment)
        if held is None or held.version < state.version:
            self.states[state.fragment] = state

    async def at(self, fragment: int, rec: RoundRecord | None) -> FragmentState | None:
        """The state of `fragment` at the version `rec` committed (Θ⁰ when None).

        `RemoteProtocolError` when the records do not form a chain (a step that does not
        give the theta its record names, a record of the chain missing)."""
        lock = self._locks.setdefault(fragment, asyncio.Lock())
        async with lock:
            target = 0 if rec is None else rec.version
            held = self.states.get(fragment)
            if held is not None and held.version == target:
                return held
            state = await self._reach(fragment, rec, held)
            if state is not None:
                self.hold(state)
            return state

    async def _reach(
        self, fragment: int, rec: RoundRecord | None, held: FragmentState | None
    ) -> FragmentState | None:
        if rec is None:
            return await self._init(fragment)
        chain = await walk_back(self.exchange, len(self.manifest.plan), fragment, rec,
                                None if held is None else held.version)
        base: FragmentState | None
        if chain.held:
            base = held
        elif chain.checkpoint is not None:
            base = await self._checkpoint(chain.checkpoint)
        else:
            base = await self._init(fragment)
        if base is None:
            return None
        state = base
        for step_rec in chain.steps:
            nxt = await self._apply(state, step_rec)
            if nxt is None:
                return None
            state = nxt
        return state

    async def _init(self, fragment: int) -> FragmentState | None:
        names = self.manifest.plan[fragment]
        # One payload, or the parts a sharded creator's ranks uploaded, joined.
        theta = await self.exchange.fetch_init(self.manifest, fragment)
        if theta is None:
            keys = [ref.key for ref in self.manifest.init_refs(fragment)]
            raise RemoteProtocolError(f"an init payload of fragment {fragment} is gone "
                                      f"({', '.join(map(repr, keys))})")
        self.bytes_down += self.manifest.init_size(fragment)
        return self.algorithm.initial_state(fragment, {n: theta[n] for n in names})

    async def _checkpoint(self, rec: RoundRecord) -> FragmentState | None:
        assert rec.theta is not None and rec.outer is not None
        names = self.manifest.plan[rec.fragment]
        schema = self.manifest.schema
        store = self.exchange.store
        theta = await store.fetch_tensors(rec.theta, payload_bound(schema, names, "theta"))
        outer = await store.fetch_tensors(rec.outer, payload_bound(schema, names, "outer"))
        if theta is None or outer is None:
            return None
        self.bytes_down += rec.theta.size + rec.outer.size
        return FragmentState.from_payloads(
            rec.fragment, rec.version, {n: theta[n] for n in names}, outer, key=rec.outer.key
        )

    async def _apply(self, state: FragmentState, rec: RoundRecord) -> FragmentState | None:
        step = rec.step
        assert step is not None
        names = self.manifest.plan[rec.fragment]
        entries = await self.exchange.store.fetch_tensors(
            step.payload, payload_bound(self.manifest.schema, names, "steps"))
        if entries is None:
            return None
        self.bytes_down += step.payload.size
        new = await asyncio.to_thread(
            self.algorithm.apply_step, state, entries, step.format, step.rule, self._backend
        )
        digest = await asyncio.to_thread(theta_digest, new.theta, names)
        if digest != step.theta_sha256:
            raise RemoteProtocolError(
                f"round {rec.round}: applying its step to version {state.version} of fragment "
                f"{rec.fragment} gives theta {digest[:12]}…, the closer's was "
                f"{step.theta_sha256[:12]}…: the step's payload was changed and its record "
                "rewritten, or this party and the closer compute the outer step differently"
            )
        return new


async def state_at(
    exchange: Exchange, fragment: int, rec: RoundRecord | None,
    manifest: Manifest | None = None,
) -> FragmentState:
    """The state of `fragment` as `rec` committed it (Θ⁰ for None), read from the newest
    checkpoint at or before it and the steps since (for tools and tests; a party that
    follows the run keeps a `Replica`). `RemoteProtocolError` when the run has no
    manifest or a payload is gone."""
    if manifest is None:
        manifest = await exchange.read_manifest()
        if manifest is None:
            raise RemoteProtocolError(f"{exchange.where} holds no run (no manifest)")
    replica = Replica(exchange, manifest, algorithm_from_json(dict(manifest.algorithm)))
    state = await replica.at(fragment, rec)
    if state is None:
        where = "Θ⁰" if rec is None else f"round {rec.round}"
        raise RemoteProtocolError(f"a payload of {where} (fragment {fragment}) was swept")
    return state


async def require_manifest(ex: Exchange, url: str) -> Manifest:
    """The run's manifest, or a `ConfigError` saying that `url` holds no run."""
    manifest = await ex.read_manifest()
    if manifest is None:
        raise ConfigError(
            f"no run found in {url!r}: it holds no manifest.json. Check the URL (and "
            "--endpoint-url or AWS_ENDPOINT_URL for S3); a run is created by its first "
            "learner"
        )
    return manifest


async def newest_model(ex: Exchange, url: str) -> tuple[dict[str, TensorBytes], dict[str, str]]:
    """Every parameter at its fragment's newest committed version (Θ⁰ for a fragment
    never committed), in schema order, and metadata naming the round and versions.

    A payload swept while it is read means a newer commit exists: it reads again.
    """
    manifest = await require_manifest(ex, url)
    replica = Replica(ex, manifest, algorithm_from_json(dict(manifest.algorithm)))
    seen = -2
    while True:
        newest = await ex.newest_round(max(seen, -1))
        latest = await ex.latest_commit_per_fragment(len(manifest.plan), newest)
        values: dict[str, TensorBytes] = {}
        versions = []
        for p, names in enumerate(manifest.plan):
            rec = latest.get(p)
            state = await replica.at(p, rec)
            if state is None:
                if newest == seen:
                    raise GradientmailError(
                        f"a payload of fragment {p} in {url!r} is missing, though round "
                        f"{newest} is the newest; the run is damaged"
                    )
                break
            values.update((n, state.theta[n]) for n in names)
            versions.append(rec.version if rec is not None else 0)
        else:
            ordered = {n: values[n] for n in manifest.schema.names}
            metadata = {
                "format": "pt",
                "gradientmail.url": url,
                "gradientmail.round": str(newest),
                "gradientmail.versions": json.dumps(versions),
            }
            return ordered, metadata
        seen = newest
