"""Records: golden bytes, round trips, and hostile input that must raise naming the key."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.errors import LocalProtocolError, RemoteProtocolError
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.record_json import (
    MAX_RECORD_BYTES,
    canonical_json,
    check_learner_id,
    parse_json,
)
from gradientmail.wire.records import (
    CreationClaim,
    Dropped,
    Manifest,
    Participant,
    RoundClaim,
    RoundRecord,
    SnapshotRecord,
)
from gradientmail.wire.refs import Arrival, PayloadRef, UpdateRef
from gradientmail.wire.serialization import ParameterSpec, Schema

A, B, C = "a" * 64, "b" * 64, "c" * 64
KEY = "rounds/0000000007.json"


def ref(key: str, sha: str) -> PayloadRef:
    return PayloadRef(key, 123, sha)


SCHEMA = Schema((ParameterSpec("w", "F32", (2, 3)), ParameterSpec("b", "BF16", (3,))))
MANIFEST = Manifest(
    SCHEMA, (("w",), ("b",)), {"name": "diloco", "outer_lr": 0.7}, "node-1",
    (ref("init/000000/0.safetensors", A), ref("init/000000/1.safetensors", B)), "off",
)
SNAPSHOT = SnapshotRecord(
    "node-1", 7, 1, 3, 1234, 50, 204800, False, C, "BF16",
    ref("payloads/0000000007/node-1.safetensors.zst", A), 0.25,
)
ROUND = RoundRecord(
    7, 1, 4,
    ref("theta/1/0000000004-000000.safetensors", A),
    ref("outer/1/0000000004-000000.safetensors", B),
    UpdateRef(ref("updates/1/0000000004-000000.safetensors", C), "F8_E4M3", A),
    (Participant("node-1", 1234, 50, 204800, 838860800.0),
     Participant("node-2", 1200, 40, 163840, 671088640.0)),
    Estimates(0.25, 1.5, None), 0.875,
    (Dropped("node-3", "stale: base version 2; fragment 1 is at version 3"),),
    "node-2", False,
)

GOLDEN: list[tuple[Any, bytes]] = [
    (CreationClaim(0, "node-1"), b'{"attempt":0,"learner":"node-1","v":1}'),
    (RoundClaim(7, 1, "syncer.0"), b'{"attempt":1,"closer":"syncer.0","round":7,"v":1}'),
    (MANIFEST, (
        b'{"algorithm":{"name":"diloco","outer_lr":0.7},"codec":"off","creator":"node-1",'
        b'"init":[{"key":"init/000000/0.safetensors","sha256":"'
        b'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","size":123},'
        b'{"key":"init/000000/1.safetensors","sha256":"'
        b'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","size":123}],'
        b'"key_fingerprint":null,"plan":[["w"],["b"]],"schema":{"params":['
        b'{"dtype":"F32","name":"w","shape":[2,3]},{"dtype":"BF16","name":"b","shape":[3]}]},'
        b'"v":1}'
    )),
    (SNAPSHOT, (
        b'{"base_version":3,"delta_format":"BF16","final":false,"fragment":1,'
        b'"learner":"node-1","local_step":1234,"payload":{"key":'
        b'"payloads/0000000007/node-1.safetensors.zst","sha256":"'
        b'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","size":123},'
        b'"round":7,"schema_digest":"'
        b'cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc",'
        b'"step_seconds":0.25,"steps":50,"tokens":204800,"v":1}'
    )),
    (ROUND, (
        b'{"all_final":false,"closer":"node-2","dropped":[{"learner":"node-3","reason":'
        b'"stale: base version 2; fragment 1 is at version 3"}],'
        b'"estimates":{"quorum":1.5,"step":0.25,"sync":null},"fragment":1,'
        b'"mean_cosine":0.875,"outer":{"key":"outer/1/0000000004-000000.safetensors",'
        b'"sha256":"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",'
        b'"size":123},"participants":[{"learner":"node-1","local_step":1234,"steps":50,'
        b'"tokens":204800,"weight":838860800.0},{"learner":"node-2","local_step":1200,'
        b'"steps":40,"tokens":163840,"weight":671088640.0}],"round":7,'
        b'"theta":{"key":"theta/1/0000000004-000000.safetensors","sha256":'
        b'"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","size":123},'
        b'"update":{"format":"F8_E4M3","payload":{"key":'
        b'"updates/1/0000000004-000000.safetensors","sha256":'
        b'"cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc","size":123},'
        b'"theta_sha256":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"},'
        b'"v":1,"version":4}'
    )),
]
IDS = ["creation-claim", "round-claim", "manifest", "snapshot", "round"]


@pytest.mark.parametrize(("record", "golden"), GOLDEN, ids=IDS)
def test_golden_bytes(record: Any, golden: bytes) -> None:
    assert record.encode() == golden
    assert type(record).decode(golden, KEY) == record


def test_round_record_without_update_or_cosine() -> None:
    record = dataclasses.replace(ROUND, update=None, mean_cosine=None, dropped=(),
                                 all_final=True)
    data = record.encode()
    assert b'"update":null' in data and b'"mean_cosine":null' in data
    assert b'"all_final":true' in data and b'"dropped":[]' in data
    assert RoundRecord.decode(data, KEY) == record


def test_round_record_arrival_and_participant_pace_are_optional() -> None:
    # Records written before these fields existed keep their bytes (the golden above) and
    # decode with None; new ones carry them and round-trip.
    assert ROUND.arrival is None and ROUND.participants[0].step_seconds is None
    paced = tuple(dataclasses.replace(p, step_seconds=0.25) for p in ROUND.participants)
    record = dataclasses.replace(ROUND, participants=paced,
                                 arrival=Arrival(3.0, 4.5, "node-1", ("node-9", "node-3")))
    data = record.encode()
    assert (b'"arrival":{"first":"node-1","latency":4.5,"missed":["node-3","node-9"],'
            b'"window":3.0}') in data
    assert b'"step_seconds":0.25,"steps":50' in data
    assert RoundRecord.decode(data, KEY) == record
    with pytest.raises(LocalProtocolError, match="latency=-1"):
        Arrival(1.0, -1)
    with pytest.raises(LocalProtocolError, match="step_seconds=nan"):
        dataclasses.replace(ROUND.participants[0], step_seconds=float("nan"))
    bad = data.replace(b'"missed":["node-3","node-9"]', b'"missed":[3]')
    with pytest.raises(RemoteProtocolError, match="missed"):
        RoundRecord.decode(bad, KEY)
    assert RoundRecord.decode(data.replace(b'"first":"node-1"', b'"first":null'), KEY) \
        == dataclasses.replace(record, arrival=Arrival(3.0, 4.5, None, ("node-9", "node-3")))
    extra = data.replace(b'"window":3.0', b'"window":3.0,"x":1')
    with pytest.raises(RemoteProtocolError, match="unexpected \\['x'\\]"):
        RoundRecord.decode(extra, KEY)


def test_history_fields_are_optional_and_round_trip() -> None:
    # Records without the run's history fields keep their bytes (the golden above) and
    # decode with None; records with them carry them and round-trip.
    assert SNAPSHOT.loss is None and b'"loss"' not in SNAPSHOT.encode()
    snap = dataclasses.replace(SNAPSHOT, loss=2.75)
    data = snap.encode()
    assert b'"local_step":1234,"loss":2.75,"payload"' in data
    assert SnapshotRecord.decode(data, KEY) == snap
    assert SnapshotRecord.decode(data.replace(b'"loss":2.75', b'"loss":-1'), KEY).loss == -1.0
    with pytest.raises(RemoteProtocolError, match="field 'loss' must be a number"):
        SnapshotRecord.decode(data.replace(b'"loss":2.75', b'"loss":null'), KEY)
    with pytest.raises(LocalProtocolError, match="loss=inf must be a finite number"):
        dataclasses.replace(SNAPSHOT, loss=float("inf"))
    p = ROUND.participants[0]
    assert (p.loss, p.payload_size, ROUND.committed_at) == (None, None, None)
    record = dataclasses.replace(
        ROUND, participants=(dataclasses.replace(p, loss=2.5, payload_size=4096),
                             dataclasses.replace(ROUND.participants[1], held=True, loss=3.0)),
        committed_at=1_750_000_000.125)
    data = record.encode()
    assert b'"committed_at":1750000000.125,"dropped"' in data
    assert (b'{"learner":"node-1","local_step":1234,"loss":2.5,"payload_size":4096,'
            b'"steps":50,') in data
    assert b'{"held":true,"learner":"node-2","local_step":1200,"loss":3.0,"steps":40' in data
    assert RoundRecord.decode(data, KEY) == record
    for bad, field in ((b'"payload_size":4096', b'"payload_size":-1'),
                       (b'"payload_size":4096', b'"payload_size":1.5'),
                       (b'"loss":2.5', b'"loss":"low"'),
                       (b'"committed_at":1750000000.125', b'"committed_at":-3')):
        with pytest.raises(RemoteProtocolError, match=field.split(b'"')[1].decode()):
            RoundRecord.decode(data.replace(bad, field), KEY)
    with pytest.raises(LocalProtocolError, match="payload_size=-1"):
        dataclasses.replace(p, payload_size=-1)


def test_canonical_json_is_utf8_not_escaped() -> None:
    data = Dropped("n", "café ✓").to_json()
    assert canonical_json(data) == '{"learner":"n","reason":"café ✓"}'.encode()


def test_payload_refs_of_round_record() -> None:
    assert [r.key for r in ROUND.payload_refs()] == [
        "theta/1/0000000004-000000.safetensors",
        "outer/1/0000000004-000000.safetensors",
        "updates/1/0000000004-000000.safetensors",
    ]


def test_payload_ref_of_hashes_the_bytes() -> None:
    r = PayloadRef.of("p/x", b"abc")
    assert r == PayloadRef(
        "p/x", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")


# -- learner ids -----------------------------------------------------------------------

@pytest.mark.parametrize("good", ["a", "0", "node-3.gpu0", "A_b-c.d", "x" * 64])
def test_learner_id_accepts(good: str) -> None:
    assert check_learner_id(good) == good


@pytest.mark.parametrize("bad", ["", "-a", ".a", "_a", "x" * 65, "a/b", "a b", "é", "a\n", 3])
def test_learner_id_rejects_naming_id_and_rule(bad: object) -> None:
    with pytest.raises(LocalProtocolError) as exc:
        check_learner_id(bad)
    msg = str(exc.value)
    assert repr(bad) in msg
    assert "[A-Za-z0-9][A-Za-z0-9._-]{0,63}" in msg


def test_local_construction_rules() -> None:
    with pytest.raises(LocalProtocolError, match=r"round=-1 must be an integer in \[0"):
        RoundClaim(-1, 0, "a")
    with pytest.raises(LocalProtocolError, match="payload sha256='xyz' must be 64 lowercase"):
        PayloadRef("k", 1, "xyz")
    with pytest.raises(LocalProtocolError, match="learner id 'a/b' is invalid"):
        dataclasses.replace(SNAPSHOT, learner="a/b")
    with pytest.raises(LocalProtocolError, match="version=0 must be an integer in \\[1"):
        dataclasses.replace(ROUND, version=0)
    with pytest.raises(LocalProtocolError, match="name a learner twice"):
        dataclasses.replace(ROUND, participants=ROUND.participants[:1] * 2)
    with pytest.raises(LocalProtocolError, match="weight=nan must be a finite number"):
        Participant("a", 1, 1, 1, float("nan"))
    with pytest.raises(LocalProtocolError, match="codec='lz4' must be one of"):
        dataclasses.replace(MANIFEST, codec="lz4")
    with pytest.raises(LocalProtocolError, match="init has 1 payload refs for 2 fragments"):
        dataclasses.replace(MANIFEST, init=MANIFEST.init[:1])
    with pytest.raises(LocalProtocolError, match="must split the schema's 2 tensors"):
        dataclasses.replace(MANIFEST, plan=(("w", "b"), ("b",)))
    with pytest.raises(LocalProtocolError, match="delta_format='f 8' must match"):
        dataclasses.replace(SNAPSHOT, delta_format="f 8")


def test_manifest_keeps_a_private_copy_of_the_algorithm() -> None:
    algorithm = {"lr": [0.7]}
    m = dataclasses.replace(MANIFEST, algorithm=algorithm)
    algorithm["lr"].append(1.0)
    assert m.algorithm == {"lr": [0.7]}


# -- hostile records -------------------------------------------------------------------

def _wrong(value: Any) -> Any:
    if isinstance(value, bool):
        return 1
    if isinstance(value, int):
        return "1"
    if isinstance(value, float):
        return "x"
    if isinstance(value, str):
        return 5
    if value is None:
        return []
    return {} if isinstance(value, list) else []


def _mutations(obj: Any, path: str = "") -> list[tuple[str, str, Any]]:
    """(path, what, mutated copy of the whole record) for every field inside `obj`."""
    out: list[tuple[str, str, Any]] = []

    def walk(node: Any, path: str, setter: Any) -> None:
        if path:
            out.append((path, "type", setter(_wrong(node))))
        if path == "algorithm":  # opaque to the protocol: only its type is checked
            return
        if isinstance(node, dict):
            for k in node:
                def set_k(v: Any, k: str = k, node: Any = node, setter: Any = setter) -> Any:
                    return setter({**node, k: v})
                walk(node[k], f"{path}.{k}" if path else k, set_k)
            if path:
                out.append((path, "missing", setter(dict(list(node.items())[1:]))))
                out.append((path, "extra", setter({**node, "zz": 1})))
        elif isinstance(node, list):
            for i in range(len(node)):
                def set_i(v: Any, i: int = i, node: Any = node, setter: Any = setter) -> Any:
                    return setter([*node[:i], v, *node[i + 1:]])
                walk(node[i], f"{path}[{i}]", set_i)

    walk(obj, path, lambda v: v)
    return out


HOSTILE = [
    (rec, path, what, mutated)
    for rec, golden in GOLDEN
    for path, what, mutated in _mutations(json.loads(golden))
]


@pytest.mark.parametrize(("record", "path", "what", "mutated"), HOSTILE,
                         ids=[f"{type(h[0]).__name__}-{h[1]}-{h[2]}" for h in HOSTILE])
def test_hostile_field_raises_naming_key_and_field(
    record: Any, path: str, what: str, mutated: Any
) -> None:
    data = json.dumps(mutated).encode()
    with pytest.raises(RemoteProtocolError) as exc:
        type(record).decode(data, KEY)
    msg = str(exc.value)
    assert repr(KEY) in msg
    top = path.split(".")[0].split("[")[0]
    assert top in msg
    if not path.startswith(("schema", "estimates")):
        assert f"field {path!r}" in msg  # the full path of the bad field


@pytest.mark.parametrize("record", [g[0] for g in GOLDEN], ids=IDS)
def test_missing_extra_and_version(record: Any) -> None:
    cls = type(record)
    obj = record.to_json()
    for drop in obj:
        with pytest.raises(RemoteProtocolError, match=f"missing \\['{drop}'\\]"):
            cls.decode(canonical_json({k: v for k, v in obj.items() if k != drop}), KEY)
    with pytest.raises(RemoteProtocolError, match=r"unexpected \['extra'\]"):
        cls.decode(canonical_json({**obj, "extra": 0}), KEY)
    for v in (2, 0, "1", True, None):
        with pytest.raises(RemoteProtocolError, match=r"field 'v' is .*reads record format "
                                                      "version 1 only"):
            cls.decode(canonical_json({**obj, "v": v}), KEY)


@pytest.mark.parametrize(("data", "needle"), [
    (b"", "not valid JSON"),
    (b"{", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[]", "is a JSON list, not an object"),
    (b"null", "is a JSON NoneType, not an object"),
    (b'{"a":1,"a":2}', "duplicate field 'a'"),
    (b'{"a":NaN}', "non-finite number NaN"),
    (b'{"a":-Infinity}', "non-finite number -Infinity"),
    (b'{"a":1e999}', "overflows a float"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (b'{"a":' + b"9" * 5000 + b"}", "not valid JSON"),
])
def test_parse_json_rejects(data: bytes, needle: str) -> None:
    with pytest.raises(RemoteProtocolError) as exc:
        parse_json(data, "snapshots/0000000001/x.json")
    assert "'snapshots/0000000001/x.json'" in str(exc.value)
    assert needle in str(exc.value)


def test_oversized_record_is_rejected_before_parsing() -> None:
    data = SNAPSHOT.encode()
    padded = data[:-1] + b" " * (MAX_RECORD_BYTES - len(data) + 1) + b"}"
    with pytest.raises(RemoteProtocolError, match=f"is {MAX_RECORD_BYTES + 1} bytes; records "
                                                  f"are at most {MAX_RECORD_BYTES}"):
        SnapshotRecord.decode(padded, KEY)
    assert SnapshotRecord.decode(padded[:-2] + b"}", KEY) == SNAPSHOT  # just at the bound


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("weight", "NaN", "non-finite number NaN"),
    ("weight", "Infinity", "non-finite number Infinity"),
    ("weight", "-1.0", "weight=-1.0 must be a finite number >= 0"),
    ("mean_cosine", "1e400", "overflows a float"),
])
def test_non_finite_and_negative_numbers(field: str, value: str, needle: str) -> None:
    text = ROUND.encode().decode()
    old = '"weight":838860800.0' if field == "weight" else '"mean_cosine":0.875'
    data = text.replace(old, f'"{field}":{value}').encode()
    with pytest.raises(RemoteProtocolError) as exc:
        RoundRecord.decode(data, KEY)
    assert needle in str(exc.value) and repr(KEY) in str(exc.value)


@pytest.mark.parametrize(("record", "field", "value", "needle"), [
    (SNAPSHOT, "learner", "../etc", "learner id '../etc' is invalid"),
    (SNAPSHOT, "round", -3, "round=-3 must be an integer"),
    (SNAPSHOT, "schema_digest", "ABC", "schema_digest='ABC' must be 64 lowercase hex"),
    (SNAPSHOT, "payload", {"key": "../x", "sha256": A, "size": 1}, "mailbox key '../x'"),
    (ROUND, "version", 0, "version=0 must be an integer in [1"),
    (ROUND, "estimates", {"step": -1, "quorum": None, "sync": None}, "estimate step=-1.0"),
    (ROUND, "closer", "", "learner id '' is invalid"),
    (MANIFEST, "codec", "lz4", "codec='lz4' must be one of"),
    (MANIFEST, "plan", [["w"]], "must split the schema's 2 tensors"),
    (MANIFEST, "schema", {"params": 3}, "field 'schema'"),
    (MANIFEST, "key_fingerprint", "zz", "key_fingerprint='zz' must be 64"),
])
def test_value_rules_on_decode(record: Any, field: str, value: Any, needle: str) -> None:
    data = canonical_json({**record.to_json(), field: value})
    with pytest.raises(RemoteProtocolError) as exc:
        type(record).decode(data, KEY)
    assert needle in str(exc.value) and repr(KEY) in str(exc.value)


# -- round trips -----------------------------------------------------------------------

ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", fullmatch=True)
shas = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
counts = st.integers(0, 2**63 - 1)
keys = st.from_regex(r"[a-z0-9]{1,8}(/[a-z0-9][a-z0-9.]{0,8}){0,3}", fullmatch=True)
refs = st.builds(PayloadRef, keys, counts, shas)
floats = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def round_records(draw: st.DrawFn) -> RoundRecord:
    learners = draw(st.lists(ids, unique=True, max_size=5))
    participants = tuple(
        Participant(n, draw(counts), draw(counts), draw(counts),
                    draw(st.floats(0, 1e30, allow_nan=False)))
        for n in learners
    )
    opt = st.none() | st.floats(0, 1e9, allow_nan=False)
    return RoundRecord(
        draw(counts), draw(counts), draw(st.integers(1, 2**63 - 1)), draw(refs), draw(refs),
        draw(st.none() | st.builds(UpdateRef, refs, st.sampled_from(["F4", "F8_E4M3"]), shas)),
        participants, Estimates(draw(opt), draw(opt), draw(opt)),
        draw(st.none() | floats),
        tuple(draw(st.lists(st.builds(Dropped, ids, st.text(max_size=50)), max_size=3))),
        draw(ids), draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None)
@given(round_records())
def test_round_record_round_trip(record: RoundRecord) -> None:
    data = record.encode()
    back = RoundRecord.decode(data, KEY)
    assert back == record
    assert back.encode() == data


@settings(max_examples=60, deadline=None)
@given(st.builds(SnapshotRecord, ids, counts, counts, counts, counts, counts, counts,
                 st.booleans(), shas, st.sampled_from(["F32", "BF16", "F4"]), refs,
                 st.none() | st.floats(0, 1e6, allow_nan=False)))
def test_snapshot_round_trip(record: SnapshotRecord) -> None:
    assert SnapshotRecord.decode(record.encode(), KEY) == record


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | floats | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=10,
)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    names = draw(st.lists(st.from_regex(r"[a-z]{1,6}(\.[a-z0-9]{1,3})?", fullmatch=True),
                          unique=True, min_size=1, max_size=6))
    schema = Schema(tuple(
        ParameterSpec(n, draw(st.sampled_from(["F32", "BF16", "F16"])),
                      tuple(draw(st.lists(st.integers(1, 9), max_size=3))))
        for n in names
    ))
    cut = draw(st.integers(1, len(names)))
    plan = tuple(p for p in (tuple(names[:cut]), tuple(names[cut:])) if p)
    return Manifest(schema, plan, draw(st.dictionaries(st.text(max_size=5), json_values)),
                    draw(ids), tuple(draw(refs) for _ in plan),
                    draw(st.sampled_from(["off", "zstd"])), draw(st.none() | shas))


@settings(max_examples=40, deadline=None)
@given(manifests())
def test_manifest_round_trip(manifest: Manifest) -> None:
    data = manifest.encode()
    back = Manifest.decode(data, "manifest.json")
    assert back == manifest
    assert back.encode() == data


@settings(max_examples=30, deadline=None)
@given(st.builds(CreationClaim, counts, ids), st.builds(RoundClaim, counts, counts, ids))
def test_claims_round_trip(creation: CreationClaim, claim: RoundClaim) -> None:
    assert CreationClaim.decode(creation.encode(), KEY) == creation
    assert RoundClaim.decode(claim.encode(), KEY) == claim
