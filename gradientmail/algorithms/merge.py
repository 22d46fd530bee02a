"""The math of a round: contribution weights, merges, the Nesterov outer step, cosines.

Everything here is a pure function over `Value`s and Python numbers. Scalars that feed
tensor bytes (norms, coefficients) are rounded to float32 first: reductions sum in float64
and backends may sum in different orders, so their float64 results can differ in the last
bits; after rounding to float32 they agree except in the rarest ties, which is what keeps
a numpy closer and a torch closer byte-identical in practice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from gradientmail.backends.base import Value
from gradientmail.backends.numpy_backend import f32
from gradientmail.errors import ConfigError, RemoteProtocolError

__all__ = [
    "CANCEL_NORM",
    "RDA_ALWAYS",
    "Merge",
    "Rda",
    "WeightedMean",
    "gram_of",
    "mean_cosine",
    "merge_from_json",
    "nesterov",
    "normalized_weights",
    "rda",
    "rda_coefficients",
    "weight",
    "weighted_mean",
]

#: The spec's φ(x) = x / max(‖x‖, 1e-12) guard, raised to where float32 rounding noise
#: ends: Σpᵢφ(vᵢ) is a convex combination of unit vectors, so its norm is in [0, 1], and
#: below 1e-5 the float32 sum is mostly rounding error of its ~1 sized terms (M=8: noise
#: ~2e-7). Directions that cancel that far merge to zero instead of amplified noise.
CANCEL_NORM = 1e-5


@dataclasses.dataclass(frozen=True)
class WeightedMean:
    """Merge each tensor as Σwᵢvᵢ / Σwᵢ."""

    def to_json(self) -> dict[str, Any]:
        return {"type": "weighted_mean"}


#: `Rda.min_deltas` of a record that does not name it: runs begun before it existed merged
#: every round of two or more deltas by RDA, and their records must re-derive the same.
RDA_ALWAYS = 2


@dataclasses.dataclass(frozen=True)
class Rda:
    """Weighted norm-preserving average: (Σwᵢ‖vᵢ‖/Σwᵢ) · φ(Σwᵢφ(vᵢ)/Σwᵢ),
    φ(x) = x / ‖x‖. Some tensors use the weighted mean instead: those in `direct_names`
    (the parameters of embedding modules, which the model's adapter names: a learner fills
    it in when it is None, see `DiLoCo.with_direct_names`), and those whose lowercased
    name contains `direct_pattern` (lowercased; None: no pattern). A round of fewer than
    `min_deltas` deltas merges by the weighted mean.

    Why `min_deltas` = 3: RDA keeps the mean of the deltas' norms, which averaging many
    near-orthogonal deltas would shrink; of two, the mean keeps ≥ 0.71 of the norm, and
    what RDA adds back is mostly the noise the mean removed. At two learners (GPT-2 2×128,
    H = 20, three seeds) RDA ended 1.18% above standard DiLoCo's held-out loss, the
    weighted mean 0.24% (benchmarks/RESULTS.md, "Streaming and Decoupled at two
    learners"); at four and eight learners, where most rounds merge three or more, RDA
    is level with standard DiLoCo."""

    direct_pattern: str | None = "embed"
    direct_names: tuple[str, ...] | None = None
    min_deltas: int = 3

    def __post_init__(self) -> None:
        k = self.min_deltas
        if isinstance(k, bool) or not isinstance(k, int) or k < RDA_ALWAYS:
            raise ConfigError(f"min_deltas={k!r} must be an int >= 2 (rounds of fewer "
                              "deltas merge by the weighted mean)")
        if self.direct_pattern is not None and not isinstance(self.direct_pattern, str):
            raise ConfigError(f"direct_pattern={self.direct_pattern!r} must be a string or None")
        names = self.direct_names
        if names is not None:
            if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
                raise ConfigError(f"direct_names={names!r:.100} must be parameter names")
            object.__setattr__(self, "direct_names", tuple(sorted(set(names))))

    def is_direct(self, name: str) -> bool:
        if self.direct_names is not None and name in self.direct_names:
            return True
        p = self.direct_pattern
        return p is not None and p.lower() in name.lower()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "rda", "direct_pattern": self.direct_pattern}
        if self.direct_names:  # absent when empty: runs of models without embeddings
            out["direct_names"] = list(self.direct_names)  # keep their bytes
        if self.min_deltas != RDA_ALWAYS:  # absent: the runs begun before it keep theirs
            out["min_deltas"] = self.min_deltas
        return out

    def applies_to(self, name: str, deltas: int) -> bool:
        """Whether tensor `name` of a round of `deltas` deltas merges by RDA (else by the
        weighted mean)."""
        return deltas >= self.min_deltas and not self.is_direct(name)


Merge = WeightedMean | Rda


def merge_from_json(obj: Any, field: str = "merge") -> Merge:
    """Inverse of `to_json`; `RemoteProtocolError` naming `field` for another shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise RemoteProtocolError(f"{field}={obj!r:.100} must be an object with a string 'type'")
    kind = obj["type"]
    if kind == "weighted_mean":
        if set(obj) != {"type"}:
            raise RemoteProtocolError(
                f"{field}: weighted_mean takes no options; unexpected keys "
                f"{sorted(set(obj) - {'type'})}"
            )
        return WeightedMean()
    if kind == "rda":
        if set(obj) - {"direct_names", "min_deltas"} != {"type", "direct_pattern"}:
            raise RemoteProtocolError(
                f"{field}: rda needs exactly 'type' and 'direct_pattern' (and may have "
                f"'direct_names' and 'min_deltas'); got {sorted(obj)}"
            )
        pattern = obj["direct_pattern"]
        if pattern is not None and not isinstance(pattern, str):
            raise RemoteProtocolError(
                f"{field}.direct_pattern={pattern!r:.100} must be a string or null"
            )
        names = obj.get("direct_names")
        if names is not None and not (
            isinstance(names, list) and names and all(isinstance(n, str) and n for n in names)
            and names == sorted(set(names))
        ):
            raise RemoteProtocolError(
                f"{field}.direct_names={names!r:.100} must be a sorted list of distinct "
                "parameter names"
            )
        least = obj.get("min_deltas", RDA_ALWAYS)
        if "min_deltas" in obj and (isinstance(least, bool) or not isinstance(least, int)
                                    or least <= RDA_ALWAYS):
            # Written only when not 2: one record, one spelling.
            raise RemoteProtocolError(
                f"{field}.min_deltas={least!r:.100} must be an int > 2 (absent: 2)")
        return Rda(pattern, None if names is None else tuple(names), least)
    raise RemoteProtocolError(
        f"{field}.type={kind!r:.100} is not a merge; use 'weighted_mean' or 'rda'"
    )


def _count(name: str, v: object, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"{name}={v!r} must be an int >= {low}")
    return v


def weight(tokens: int, steps: int) -> float:
    """A contribution's weight tokens² / steps, exact in integers, rounded once."""
    t = _count("tokens", tokens, 0)
    s = _count("steps", steps, 1)
    return float(Fraction(t * t, s))


def normalized_weights(weights: Sequence[int | float | Fraction]) -> list[float]:
    """wᵢ / Σw, each exact before one rounding; equal shares when every weight is 0."""
    if not weights:
        raise ConfigError("need at least one weight")
    exact = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, int | float | Fraction):
            raise ConfigError(f"weights[{i}]={w!r} is not a number")
        if not math.isfinite(w) or w < 0:
            raise ConfigError(f"weights[{i}]={w!r} must be finite and >= 0")
        exact.append(Fraction(w))
    total = sum(exact, Fraction(0))
    if total == 0:
        # Learners that count no tokens still merge: as equals.
        return [1.0 / len(exact)] * len(exact)
    return [float(w / total) for w in exact]


def weighted_mean(values: Sequence[Value], weights: Sequence[int | float | Fraction]) -> Value:
    """Σpᵢvᵢ with pᵢ = wᵢ/Σw, summed left to right in float32. One value gives itself."""
    if len(values) != len(weights):
        raise ConfigError(f"{len(values)} values but {len(weights)} weights")
    if len(values) == 1:
        return values[0]
    p = normalized_weights(weights)
    acc = values[0] * p[0]
    for v, k in zip(values[1:], p[1:], strict=True):
        acc = acc + v * k
    return acc


def rda_coefficients(gram: Sequence[Sequence[float]], shares: Sequence[float]) -> list[float]:
    """The coefficients cᵢ with RDA(v) = Σcᵢvᵢ, from the Gram matrix Gᵢⱼ = vᵢ·vⱼ and the
    normalized weights pᵢ.

    With nᵢ = ‖vᵢ‖ and aᵢ = pᵢ/nᵢ, the direction x = Σaᵢvᵢ = Σpᵢφ(vᵢ) has ‖x‖² = aᵀGa and
    RDA = (Σpᵢnᵢ / ‖x‖)·x. Norms are taken from the Gram matrix (one pass over the data)
    and rounded to float32; directions that cancel (‖x‖ ≤ `CANCEL_NORM`) merge to zero.
    """
    m = len(shares)
    if len(gram) != m or any(len(row) != m for row in gram):
        raise ConfigError(f"gram must be {m}x{m} for {m} shares")
    if m == 1:
        return [1.0]
    norms = [f32(math.sqrt(max(gram[i][i], 0.0))) for i in range(m)]
    a = [p / n if n > 0 else 0.0 for p, n in zip(shares, norms, strict=True)]
    xx = math.fsum(a[i] * a[j] * gram[i][j] for i in range(m) for j in range(m))
    xnorm = f32(math.sqrt(max(xx, 0.0)))
    if xnorm <= CANCEL_NORM:
        return [0.0] * m
    scale = math.fsum(p * n for p, n in zip(shares, norms, strict=True)) / xnorm
    return [scale * ai for ai in a]


def gram_of(values: Sequence[Value]) -> list[list[float]]:
    """The Gram matrix of `values` through `Value.dot` (the aggregator uses the backend's
    one-pass `gram`, which gives the same matrix up to float64 summation order)."""
    m = len(values)
    g = [[0.0] * m for _ in range(m)]
    for i in range(m):
        for j in range(i, m):
            g[i][j] = g[j][i] = values[i].dot(values[j])
    return g


def rda(values: Sequence[Value], weights: Sequence[int | float | Fraction]) -> Value:
    """Weighted norm-preserving average (see `rda_coefficients`). Its norm is the weighted
    mean of the norms; one value gives itself; directions that cancel give zero."""
    if len(values) != len(weights):
        raise ConfigError(f"{len(values)} values but {len(weights)} weights")
    if len(values) == 1:
        return values[0]
    c = rda_coefficients(gram_of(values), normalized_weights(weights))
    acc = values[0] * c[0]
    for v, k in zip(values[1:], c[1:], strict=True):
        acc = acc + v * k
    return acc


def nesterov(
    theta: Value, momentum: Value, delta: Value, lr: float, beta: float
) -> tuple[Value, Value]:
    """One outer step on pseudo-gradient Δ: m ← β·m + Δ; Θ ← Θ − η·(Δ + β·m).

    The arithmetic of `torch.optim.SGD(lr=η, momentum=β, nesterov=True)` fed Δ as the
    gradient (which starts its buffer at Δ, the same as β·0 + Δ), with every multiply and
    add rounded separately. Returns (Θ, m).
    """
    m = momentum * beta + delta
    return theta - (delta + m * beta) * lr, m


def mean_cosine(gram: Sequence[Sequence[float]]) -> float | None:
    """The mean over pairs i < j of Gᵢⱼ / √(GᵢᵢGⱼⱼ), rounded to float32; None for fewer
    than two deltas. A zero delta has cosine 0 with every other."""
    m = len(gram)
    if m < 2:
        return None
    total = []
    for i in range(m):
        for j in range(i + 1, m):
            denom = math.sqrt(max(gram[i][i], 0.0) * max(gram[j][j], 0.0))
            total.append(gram[i][j] / denom if denom > 0 else 0.0)
    return f32(min(1.0, max(-1.0, math.fsum(total) / len(total))))
