"""The learner's error feedback (`learner.feedback.Residuals`) on the learner's device and
across checkpoints.

On a torch adapter the residuals are float32 tensors on the parameters' device and the
payloads are the numpy path's bytes; the values sent plus the residual left are the
deltas trained in every order of success and failure (a later payload of a fragment
encoded before an earlier one failed included); `state_dict` survives `torch.save` /
`torch.load(weights_only=True)` and a restored learner encodes as the original would;
bad states are refused naming the mismatch and the fix; a plain `Learner` saves and
restores its residuals around a restart.
"""

from __future__ import annotations

import io
import itertools
import pickle
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradientmail import events as ev  # noqa: E402
from gradientmail.adapters.torch import TorchAdapter  # noqa: E402
from gradientmail.algorithms.diloco import DiLoCo  # noqa: E402
from gradientmail.errors import ConfigError  # noqa: E402
from gradientmail.learner.feedback import Residuals  # noqa: E402
from gradientmail.learner.options import LearnerOptions  # noqa: E402
from gradientmail.learner.runtime import Learner  # noqa: E402
from gradientmail.mailbox import MemoryMailbox  # noqa: E402
from gradientmail.wire.sparse import CHUNK, densify  # noqa: E402
from gradientmail.wire.tensor_bytes import TensorBytes  # noqa: E402

SHAPES = {"w": (CHUNK + 50,), "b": (30,)}
SIZES = {n: int(np.prod(s)) for n, s in SHAPES.items()}
DENSITY = 0.02


def deltas(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * 1e-3).astype(np.float32) for n, s in SHAPES.items()}


def as_bytes(d: dict[str, np.ndarray]) -> dict[str, TensorBytes]:
    return {n: TensorBytes.from_numpy(a) for n, a in d.items()}


def as_torch(d: dict[str, np.ndarray], device: str) -> dict[str, Any]:
    return {n: torch.from_numpy(a.copy()).to(device) for n, a in d.items()}


def host(a: Any) -> np.ndarray:
    return a.cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def sent(entries: dict[str, TensorBytes]) -> dict[str, np.ndarray]:
    return {n: densify(entries, n, s).to_numpy().reshape(-1).astype(np.float64)
            for n, s in SHAPES.items()}


def bitwise(a: Any, b: Any) -> bool:
    return np.array_equal(host(a).view(np.uint32), host(b).view(np.uint32))


# -- on the device ----------------------------------------------------------------------


def test_on_the_device_the_residuals_stay_there_and_the_bytes_are_numpys(device: str) -> None:
    on_host, on_device = Residuals("a"), Residuals("a")
    for r in range(6):
        d = deltas(r)
        want = on_host.encode(r, r % 2, as_bytes(d), DENSITY)
        assert on_device.encode(r, r % 2, as_torch(d, device), DENSITY) == want
        if r == 3:  # round 3 fails: both give its share back
            on_host.failed(r)
            on_device.failed(r)
        else:
            on_host.recorded(r, ("a",))
            on_device.recorded(r, ("a",))
    for fragment in (0, 1):
        kept = on_device.residual(fragment)
        assert set(kept) == set(SHAPES)
        for n, t in kept.items():
            assert isinstance(t, torch.Tensor) and t.device.type == device
            assert t.dtype == torch.float32 and t.shape == (SIZES[n],)
            assert bitwise(t, on_host.residual(fragment)[n])


# -- every order of success and failure ------------------------------------------------


def test_the_edge_case_a_later_payload_encoded_before_an_earlier_one_failed() -> None:
    # Payloads 0 and 1 of fragment 0 are both in flight; then 0 fails and 1 stands. 0's
    # steps go out again later, so the residual must be what 1 alone would leave on top
    # of the residual before 0: d1 + 0 − s1, not d0 + d1 − s0 − s1 (0's unsent part
    # counted while its steps come again) nor the residual before 0 (1's lost).
    res = Residuals("a")
    d0, d1 = deltas(10), deltas(11)
    s0 = sent(res.encode(0, 0, as_bytes(d0), DENSITY))
    s1 = sent(res.encode(1, 0, as_bytes(d1), DENSITY))
    res.failed(0)
    res.recorded(1, ("a",))
    for n in SHAPES:
        want = d1[n].astype(np.float64) + d0[n] - s0[n] - s1[n] - (d0[n] - s0[n])
        np.testing.assert_allclose(host(res.residual(0)[n]), want, rtol=0, atol=1e-9)
    # ... and when 1 fails as well, nothing is left (to float32 rounding: 0's share was
    # taken out of 1's residual by arithmetic, not by restoring an array).
    res2 = Residuals("a")
    res2.encode(0, 0, as_bytes(d0), DENSITY)
    res2.encode(1, 0, as_bytes(d1), DENSITY)
    res2.failed(0)
    res2.failed(1)
    for v in res2.residual(0).values():
        np.testing.assert_allclose(host(v), 0, rtol=0, atol=1e-9)


def test_a_failure_settled_while_a_later_payload_encodes(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    # The communication thread settles round 0 as failed while the worker thread encodes
    # round 1 (the lock is not held while encoding): the outcome is the one of round 1
    # encoded first and round 0 failing after it.
    import gradientmail.learner.feedback as feedback

    d0, d1 = deltas(12), deltas(13)
    first = Residuals("a")
    first.encode(0, 0, as_bytes(d0), DENSITY)
    want = first.encode(1, 0, as_bytes(d1), DENSITY)
    first.failed(0)

    res = Residuals("a")
    res.encode(0, 0, as_bytes(d0), DENSITY)
    real = feedback._sparsify

    def meanwhile(*args: Any) -> Any:
        res.failed(0)  # would deadlock if encode held the lock here
        return real(*args)

    monkeypatch.setattr(feedback, "_sparsify", meanwhile)
    assert res.encode(1, 0, as_bytes(d1), DENSITY) == want
    assert res.in_flight() == {1: 0}
    assert all(bitwise(res.residual(0)[n], first.residual(0)[n]) for n in SHAPES)
    # Round 1 failing as well leaves (to rounding) nothing, as it does sequentially.
    res.failed(1)
    for v in res.residual(0).values():
        np.testing.assert_allclose(host(v), 0, rtol=0, atol=1e-9)


@pytest.mark.parametrize("outcomes", list(itertools.product((True, False), repeat=3)))
def test_sent_plus_residual_is_trained_in_every_order(outcomes: tuple[bool, ...]) -> None:
    for order in itertools.permutations(range(3)):
        res = Residuals("a")
        ds = [deltas(20 + j) for j in range(3)]
        ss = [sent(res.encode(j, 0, as_bytes(ds[j]), DENSITY)) for j in range(3)]
        for j in order:
            if outcomes[j]:
                res.recorded(j, ("a", "b"))
            elif j % 2:
                res.failed(j)  # its upload failed
            else:
                res.recorded(j, ("b",))  # its round closed without this learner
        assert res.in_flight() == {}
        # What stood: its steps are merged, what it did not carry is in the residual.
        # What failed: its steps go out again (below), so it counts for nothing yet.
        for n in SHAPES:
            trained = sum(ds[j][n].astype(np.float64) for j in range(3) if outcomes[j])
            carried = sum(ss[j][n] for j in range(3) if outcomes[j])
            left = host(res.residual(0).get(n, np.zeros(SIZES[n], np.float32)))
            np.testing.assert_allclose(left + carried, trained, rtol=0, atol=2e-9,
                                       err_msg=f"{outcomes} {order}")
        # The failed steps go out again with the next delta; it stands.
        again = {n: (sum((ds[j][n] for j in range(3) if not outcomes[j]),
                         np.zeros(SIZES[n], np.float32)) + ds[0][n]).astype(np.float32)
                 for n in SHAPES}
        s3 = sent(res.encode(3, 0, as_bytes(again), DENSITY))
        res.recorded(3, ("a",))
        for n in SHAPES:
            trained = sum(ds[j][n].astype(np.float64) for j in range(3)) + ds[0][n]
            carried = sum(ss[j][n] for j in range(3) if outcomes[j]) + s3[n]
            np.testing.assert_allclose(host(res.residual(0)[n]) + carried, trained,
                                       rtol=0, atol=4e-9)


def test_swept_records_settle_as_the_rebase_does_and_a_round_encoded_again() -> None:
    res = Residuals("a")
    res.encode(0, 0, as_bytes(deltas(30)), DENSITY)
    before = {n: host(v).copy() for n, v in res.residual(0).items()}
    res.encode(2, 0, as_bytes(deltas(31)), DENSITY)
    res.encode(3, 1, as_bytes(deltas(32)), DENSITY)
    res.recorded(0, ("a",))
    # Round 2's record was swept before this learner read it, and round 4 (fragment 0)
    # closed without it: as the training thread's rebase does, round 2's steps go out
    # again. Fragment 1's round in flight is not touched.
    res.swept(0, 4, took_part=False)
    assert res.in_flight() == {3: 1}
    assert all(bitwise(res.residual(0)[n], before[n]) for n in SHAPES)
    res.encode(5, 0, as_bytes(deltas(34)), DENSITY)
    res.swept(0, 6, took_part=True)  # taken into commit 6 with this learner's: it stands
    assert res.in_flight() == {3: 1}
    assert not all(bitwise(res.residual(0)[n], before[n]) for n in SHAPES)
    # Round 3 failed to upload and is encoded again: its first attempt is settled first.
    first = {n: host(v).copy() for n, v in res.residual(1).items()}
    res.encode(3, 1, as_bytes(deltas(33)), DENSITY)
    res.failed(3)
    assert res.residual(1) == {} and first
    assert res.in_flight() == {}


# -- checkpoints --------------------------------------------------------------------------


def through_torch_save(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    out: dict[str, Any] = torch.load(buf, weights_only=True)  # tensors and plain types only
    return out


def test_a_restored_residuals_encodes_as_the_original(device: str) -> None:
    adapter = TorchAdapter(torch.nn.Linear(1, 1))  # only for its to_device
    original = Residuals("a")
    for r in range(4):  # rounds 2 (fragment 0) and 3 (fragment 1) stay in flight
        original.encode(r, r % 2, as_torch(deltas(40 + r), device), DENSITY)
        if r < 2:
            original.recorded(r, ("a",))
    state = original.state_dict()
    assert set(state["in_flight"]) == {2, 3}
    restored = Residuals("a")
    restored.load_state_dict(through_torch_save(state), SIZES,
                             lambda n, v: v.to(adapter.device).reshape(-1).float())
    assert restored.in_flight() == {2: 0, 3: 1}
    # Round 2 fails (its residual comes back exactly), round 3 stands, round 4 encodes
    # the same bytes and leaves the same residuals.
    for res in (original, restored):
        res.failed(2)
        res.recorded(3, ("a",))
    d = deltas(44)
    on_cpu = {n: torch.from_numpy(a.copy()) for n, a in d.items()}
    assert restored.encode(4, 0, dict(on_cpu), DENSITY) == original.encode(
        4, 0, as_torch(d, device), DENSITY)
    for f in (0, 1):
        assert all(bitwise(restored.residual(f)[n], original.residual(f)[n]) for n in SHAPES)


def test_numpy_residuals_survive_a_pickle() -> None:
    original = Residuals("a")
    original.encode(0, 0, as_bytes(deltas(50)), DENSITY)
    original.encode(1, 0, as_bytes(deltas(51)), DENSITY)
    restored = Residuals("a")
    restored.load_state_dict(pickle.loads(pickle.dumps(original.state_dict())), SIZES,
                             lambda n, v: np.asarray(v, np.float32).reshape(-1))
    for res in (original, restored):
        res.failed(0)
        res.recorded(1, ("a",))
    assert all(bitwise(restored.residual(0)[n], original.residual(0)[n]) for n in SHAPES)


def test_bad_states_are_refused_naming_the_mismatch_and_the_fix() -> None:
    res = Residuals("a")
    res.encode(0, 0, as_bytes(deltas(60)), DENSITY)
    good = res.state_dict()
    fresh = Residuals("a")

    def load(state: Any, sizes: dict[str, int] = SIZES) -> None:
        fresh.load_state_dict(state, sizes, lambda n, v: np.asarray(v).reshape(-1))

    with pytest.raises(ConfigError, match=r"not a Residuals state: keys \['x'\], expected "
                                          r"\['in_flight', 'residuals', 'version'\]"):
        load({"x": 1})
    with pytest.raises(ConfigError, match=r"version 7 is not 1: written by another "
                                          "gradientmail version"):
        load({**good, "version": 7})
    with pytest.raises(ConfigError, match=r"the residuals of fragment 0 has a residual for "
                                          r"'w', which is not a synced parameter of this "
                                          r"model; resume with the model the checkpoint"):
        load(good, {"b": 30})
    with pytest.raises(ConfigError, match=r"the residual of 'w' has 4146 elements, the "
                                          r"parameter 4000; resume with the model"):
        load(good, {**SIZES, "w": 4000})
    assert fresh.residual(0) == {} and fresh.in_flight() == {}  # nothing replaced
    load(good)
    with pytest.raises(ConfigError, match=r"residuals of fragment 0; this run has 0 "
                                          r"fragments\. Resume into the run"):
        fresh.check_fragments(())
    with pytest.raises(ConfigError, match=r"residuals of \['w'\] in fragment 0, which this "
                                          "run puts elsewhere"):
        fresh.check_fragments((("b",), ("w",)))
    fresh.check_fragments((("b", "w"),))


# -- a learner around a restart -----------------------------------------------------------

FAST = {"poll_interval": 0.005, "lease_every": 5.0, "lease_timeout": 30.0}


def sparse_run(fragments: int = 1) -> DiLoCo:
    return DiLoCo(sync_every=4, fragments=fragments, in_flight=1, overlap_steps=0,
                  delta_dtype="TOPK_F8", delta_density=1 / CHUNK, flush_on_close=False)


def model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))


def train(learner: Learner, net: Any, steps: int, seed: int) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + step)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        learner.step(4)


def test_a_learner_keeps_its_residuals_across_a_restart() -> None:
    mailbox = MemoryMailbox()
    options = LearnerOptions(**FAST, hold_own=False)
    net = model()
    first = Learner(TorchAdapter(net), sparse_run(), mailbox, "solo", options=options)
    first.start()
    train(first, net, 8, seed=0)
    saved = through_torch_save(first.state_dict())
    first.close()
    kept = saved["error_feedback"]["residuals"][0]
    assert set(kept) == {n for n, _ in net.named_parameters()}
    assert all(t.abs().sum() > 0 for t in kept.values())

    net2 = model()
    again = Learner(TorchAdapter(net2), sparse_run(), mailbox, "solo", options=options)
    again.load_state_dict(saved)
    again.start()
    with pytest.raises(ConfigError, match="was started already; call load_state_dict"):
        again.load_state_dict(saved)
    now = again.state_dict()["error_feedback"]
    assert now["in_flight"] == {}
    assert all(torch.equal(now["residuals"][0][n], kept[n]) for n in kept)
    train(again, net2, 4, seed=100)  # the next round carries them
    assert any(not torch.equal(again.state_dict()["error_feedback"]["residuals"][0][n], kept[n])
               for n in kept)
    again.close()

    # A checkpoint whose round 0 was in flight: joining settles it from round 0's record,
    # which names "solo" (it stands: the residual stays) and not "other" (it was dropped:
    # the residual before it, none, comes back).
    residual = saved["error_feedback"]["residuals"][0]
    flying = {"error_feedback": {"version": 1, "residuals": {0: residual},
                                 "in_flight": {0: {"fragment": 0, "before": None,
                                                   "after": residual}}}}
    for who, stands in (("solo", True), ("other", False)):
        joined = Learner(TorchAdapter(model()), sparse_run(), mailbox, who, options=options)
        joined.load_state_dict(flying)
        assert joined.state_dict()["error_feedback"]["in_flight"] == {0: {
            "fragment": 0, "before": None, "after": joined.state_dict()["error_feedback"][
                "residuals"][0]}}
        joined.start()
        state = joined.state_dict()["error_feedback"]
        joined.close()
        if stands:
            assert state["in_flight"] == {}
            assert all(torch.equal(state["residuals"][0][n], residual[n]) for n in residual)
        else:
            assert state is None  # nothing kept, nothing in flight

    # A checkpoint of another fragment plan is refused when the learner joins, and the
    # lease it took is released.
    other = {"error_feedback": {**saved["error_feedback"],
                                "residuals": {3: saved["error_feedback"]["residuals"][0]}}}
    seen: list[Any] = []
    late = Learner(TorchAdapter(model()), sparse_run(), mailbox, "solo", options=options,
                   on_event=seen.append)
    late.load_state_dict(other)
    with pytest.raises(ConfigError, match=r"residuals of fragment 3; this run has 1 fragments"):
        late.start()
    assert [e.learner for e in seen if isinstance(e, ev.LeaseReleased)] == ["solo"]
    with pytest.raises(ConfigError, match=r"not a Learner state: keys \['x'\]"):
        Learner(TorchAdapter(model()), sparse_run(), mailbox, "x").load_state_dict({"x": 1})


@pytest.mark.parametrize("fmt", ["TOPK_F8", "SIGN1"])
def test_the_learners_momentum_is_settled_and_saved_with_the_residual(fmt: str) -> None:
    """With `feedback_momentum`, a failed newest payload gives back the momentum and the
    residual it replaced exactly, on the host and on a torch tensor alike; the momentum
    travels in the checkpoint state beside the residual and comes back in its place."""
    density = 1.0 if fmt == "SIGN1" else DENSITY
    for make in (as_bytes, lambda d: as_torch(d, "cpu")):
        r = Residuals("me")
        r.encode(0, 0, make(deltas(0)), density, 0.95, fmt, 0.8)
        mom, res = ({n: host(a).copy() for n, a in r.momentum(0).items()},
                    {n: host(a).copy() for n, a in r.residual(0).items()})
        assert sorted(mom) == sorted(res) == sorted(SHAPES)
        np.testing.assert_array_equal(mom["w"], deltas(0)["w"])  # m = the first delta
        r.recorded(0, ("me",))
        r.encode(1, 0, make(deltas(1)), density, 0.95, fmt, 0.8)
        np.testing.assert_allclose(host(r.momentum(0)["w"]),
                                   np.float32(0.8) * deltas(0)["w"] + deltas(1)["w"],
                                   rtol=1e-6)
        r.failed(1)
        for n in SHAPES:
            np.testing.assert_array_equal(host(r.momentum(0)[n]), mom[n])
            np.testing.assert_array_equal(host(r.residual(0)[n]), res[n])
        state = r.state_dict()
        back = Residuals("me")
        back.load_state_dict(state, SIZES, lambda name, a: a)
        for n in SHAPES:
            np.testing.assert_array_equal(host(back.momentum(0)[n]), mom[n])
            np.testing.assert_array_equal(host(back.residual(0)[n]), res[n])


@pytest.mark.parametrize("fmt", ["TOPK_F8", "TOPK_Q2", "SIGN1"])
def test_residuals_restored_as_tensors_encode_as_restored_as_arrays(fmt: str) -> None:
    """`Learner.load_state_dict` places residuals as tensors on the model's device (a
    sharded learner's ranks too), while TOPK_Q2 and SIGN1 encode on the host: with
    `feedback_momentum` and a failure after a later payload, the payloads, residual and
    momentum equal those of the same state restored as numpy arrays."""
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    got = []
    for kind in (np.asarray, torch.from_numpy):
        first = Residuals("a")
        first.encode(0, 0, {"w": TensorBytes("F32", (5000,), x.tobytes())}, 0.5, fmt=fmt,
                     momentum=0.5)
        state = first.state_dict()
        state["residuals"] = {0: {n: kind(np.array(v)) for n, v in state["residuals"][0].items()}}
        state["in_flight"] = {}
        again = Residuals("a")
        again.load_state_dict(state, {"w": 5000}, lambda _, v: v)
        out = [again.encode(r, 0, {"w": torch.from_numpy(x.copy())}, 0.5, fmt=fmt, momentum=0.5)
               for r in (1, 2)]
        again.failed(1)
        got.append(([{n: bytes(t.buffer) for n, t in o.items()} for o in out],
                    np.asarray(again.residual(0)["w"]), np.asarray(again.momentum(0)["w"])))
    assert got[0][0] == got[1][0]
    np.testing.assert_array_equal(got[0][1], got[1][1])
    np.testing.assert_array_equal(got[0][2], got[1][2])
