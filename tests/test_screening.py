"""A contribution's delta as a round merges it: the value checks and the norms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradientmail.algorithms.base import Contribution
from gradientmail.syncer.screening import delta_norms, screen_delta
from gradientmail.wire.quantization import dequantize, quantize
from gradientmail.wire.sharded_pieces import RowPieces
from gradientmail.wire.tensor_bytes import TensorBytes


def f32(*values: float) -> TensorBytes:
    return TensorBytes.from_numpy(np.array(values, dtype=np.float32))


def test_a_stored_delta_is_merged_as_it_is() -> None:
    entries = {"w": f32(1.0, 2.0), "b": f32(3.0)}
    assert screen_delta(entries, ["w", "b"], "F32") == entries
    assert screen_delta(entries, ["w"], None) == {"w": entries["w"]}


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F4"])
def test_a_quantized_delta_is_read_as_its_dequantized_values(fmt: str) -> None:
    entries = quantize("w", f32(1.0, -2.0, 0.5), fmt)
    delta = screen_delta(entries, ["w"], fmt)
    assert isinstance(delta, dict) and set(delta) == {"w"}
    # Kept quantized (the merge decodes it a window at a time), its values dequantize's.
    assert isinstance(delta["w"], RowPieces) and delta["w"].dtype == "F32"
    assert delta["w"].joined() == dequantize(entries, "w", fmt)
    assert np.allclose(delta["w"].joined().to_numpy(), [1.0, -2.0, 0.5], rtol=0.1)


def test_a_delta_is_dropped_swept_unreadable_or_non_finite() -> None:
    assert screen_delta(None, ["w"], "F32") == "payload swept"
    # a quantized format without its scales does not dequantize
    reason = screen_delta({"w": quantize("w", f32(1.0), "F8_E4M3")["w"]}, ["w"], "F8_E4M3")
    assert isinstance(reason, str) and reason.startswith("unreadable: ")
    bad = {"w": f32(1.0, math.nan), "b": f32(3.0), "c": f32(math.inf)}
    assert screen_delta(bad, ["w", "b", "c"], "F32") == "non-finite values in ['w', 'c']"
    empty = {"w": TensorBytes.from_numpy(np.zeros((0,), dtype=np.float32))}
    assert screen_delta(empty, ["w"], "F32") == empty


def test_a_delta_norm_spans_all_its_tensors() -> None:
    c = Contribution("a", 1, 1, 1, False, {"w": f32(3.0), "b": f32(4.0)})
    assert delta_norms([c]) == {"a": 5.0}
