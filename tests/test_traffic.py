"""Pricing a mailbox's traffic (`gradientmail.traffic`) and reading a run's traffic from
its round records (`gradientmail.app.record_traffic`): pure functions, called directly."""

from __future__ import annotations

import pytest

from gradientmail.app.record_traffic import follow_bytes, record_traffic
from gradientmail.errors import ConfigError
from gradientmail.traffic import GIB, S3_STANDARD, Prices, RequestCounts, measure
from gradientmail.wire.estimates import Estimates
from gradientmail.wire.records import Participant, RoundRecord
from gradientmail.wire.refs import PayloadRef, StepRef

SHA = "0" * 64


def test_default_prices_are_s3_standard_us_east_1() -> None:
    assert Prices(put_per_1000=0.005, get_per_1000=0.0004, egress_per_gb=0.09) == S3_STANDARD
    counts = RequestCounts(list=1000, get=1000, put=1000, delete=1000, create=400)
    # PUT (creates among them) and LIST at $0.005 per 1,000, GET at $0.0004, DELETE free.
    assert S3_STANDARD.requests_usd(counts) == pytest.approx(0.005 + 0.005 + 0.0004)
    assert S3_STANDARD.egress_usd(GIB) == pytest.approx(0.09)
    assert GIB == 2**30
    # The benchmarks' request cost is the same definition.
    assert counts.cost_usd() == S3_STANDARD.requests_usd(counts)
    assert counts.cost_usd(per_million_put_list=10.0, per_million_get=1.0) == pytest.approx(
        (2000 * 10.0 + 1000 * 1.0) / 1e6)


def test_a_price_must_be_a_finite_number_of_dollars() -> None:
    with pytest.raises(ConfigError, match=r"^egress_per_gb=-0.01 must be a finite number of "
                                          r"dollars >= 0$"):
        Prices(egress_per_gb=-0.01)
    with pytest.raises(ConfigError, match="put_per_1000=nan"):
        Prices(put_per_1000=float("nan"))


def test_measure_prices_requests_and_egress_per_hour() -> None:
    counts = RequestCounts(list=3, get=200, put=40, delete=7, bytes_up=5_000,
                           bytes_down=3 * GIB, create=12)
    prices = Prices(put_per_1000=0.01, get_per_1000=0.001, egress_per_gb=0.05)
    t = measure(counts, 1800.0, prices)
    assert (t.requests, t.bytes_up, t.bytes_down) == (250, 5_000, 3 * GIB)
    assert t.usd_requests == pytest.approx((43 * 0.01 + 200 * 0.001) / 1000)
    assert t.usd_egress == pytest.approx(3 * 0.05)
    assert t.usd == pytest.approx(t.usd_requests + t.usd_egress)
    assert t.usd_per_hour == pytest.approx(2 * t.usd)  # half an hour
    assert t.to_json() == {
        "list": 3, "get": 200, "put": 40, "delete": 7, "create": 12, "bytes_up": 5_000,
        "bytes_down": 3 * GIB, "requests": 250, "seconds": 1800.0, "usd": t.usd,
        "usd_requests": t.usd_requests, "usd_egress": t.usd_egress,
        "usd_per_hour": t.usd_per_hour,
    }
    assert str(t).startswith("250 requests (GET 200, PUT 40 of which create 12, LIST 3, "
                             "DELETE 7), 5000 B up, 3221225472 B down in 1800.0 s: $")
    assert measure(counts, 0.0).usd_per_hour is None  # no time has passed
    assert measure(counts, -1.0).seconds == 0.0


def ref(key: str, size: int) -> PayloadRef:
    return PayloadRef(key, size, SHA)


def record(r: int, participants: tuple[Participant, ...], at: float | None,
           step: bool = False) -> RoundRecord:
    theta = None if step else ref(f"theta/0/{r + 1:010d}-000000.safetensors", 1000)
    outer = None if step else ref(f"outer/0/{r + 1:010d}-000000.safetensors", 2000)
    return RoundRecord(
        round=r, fragment=0, version=r + 1, theta=theta, outer=outer, update=None,
        participants=participants, estimates=Estimates(), mean_cosine=None, dropped=(),
        closer="a", all_final=False,
        step=StepRef(ref(f"steps/0/{r + 1:010d}-000000.safetensors", 300), "F32",
                     "nesterov", SHA) if step else None,
        committed_at=at,
    )


def part(learner: str, size: int | None, held: bool = False) -> Participant:
    return Participant(learner, 10, 10, 100, 1.0, held=held,
                       payload_size=None if held else size)


def test_records_give_bytes_and_writes_per_round_and_per_learner_hour() -> None:
    records = [
        # a checkpoint: theta 1000 + outer 2000; a's contribution held, b's uploaded
        record(0, (part("a", None, held=True), part("b", 500)), at=1000.0),
        # a replicated step of 300 bytes; both uploaded
        record(1, (part("a", 400), part("b", 600)), at=1900.0, step=True),
    ]
    assert [follow_bytes(rec) for rec in records] == [1000, 300]
    t = record_traffic(records, learners=2)
    assert t is not None
    assert (t.rounds, t.first_round, t.last_round, t.learners) == (2, 0, 1, 2)
    assert t.uploads == 1.5
    assert t.contribution_bytes == (500 + 1000) / 2
    assert t.commit_payloads == 1.5 and t.commit_bytes == (3000 + 300) / 2
    assert t.follow_bytes == (1000 + 300) / 2
    # per round: 2 PUTs per upload, the claim, the closer's payloads, the record
    assert t.puts == ((2 + 1 + 2 + 1) + (4 + 1 + 1 + 1)) / 2
    assert t.rounds_per_hour == pytest.approx(4.0)  # one round in 900 s
    hourly = t.per_learner_hour()
    assert hourly is not None
    assert hourly["bytes_up"] == pytest.approx((750 + 1650) * 4 / 2)
    assert hourly["bytes_down"] == pytest.approx(650 * 4 + 750 * 4 / 2)
    assert hourly["puts"] == pytest.approx(6.5 * 4 / 2)
    assert hourly["gets"] == pytest.approx(2 * 4 + 2 * 1.5 * 4 / 2)
    assert hourly["usd"] == pytest.approx(
        (hourly["puts"] * 0.005 + hourly["gets"] * 0.0004) / 1000
        + round(hourly["bytes_down"]) * 0.09 / GIB)
    js = t.to_json()
    assert js["per_round"]["puts"] == t.puts and js["per_learner_hour"] == hourly
    assert js["prices"] == {"put_per_1000": 0.005, "get_per_1000": 0.0004,
                            "egress_per_gb": 0.09}


def test_records_without_sizes_or_stamps_say_so() -> None:
    old = [record(0, (part("a", None),), at=None), record(1, (part("b", 10),), at=None)]
    t = record_traffic(old, learners=0)
    assert t is not None
    assert t.learners == 2  # none holding a lease: those who took part
    assert t.contribution_bytes is None  # a record from before payload_size
    assert t.rounds_per_hour is None and t.per_learner_hour() is None
    assert record_traffic([], learners=3) is None
