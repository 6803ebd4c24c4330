"""Good / fair / poor: how to read a fidelity number (docs/fidelity.md, section "Reading the numbers").

The bands come from what docs/fidelity.md measured on the embedded model: KIVI 4-bit (about 35% of
the bytes, perplexity x1.001 to x1.006) sits in "good" on every metric, 50% per-token pruning and
sign-VQ in "fair", KIVI 2-bit and 70% pruning in "poor". They are a reading aid for people, not a
pass/fail gate (``verify --max-nll-increase`` and friends are the gates). A negative NLL increase is
"noise": the compressed cache predicted that text slightly better, which at these sizes is chance.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Band:
    """``good`` and ``fair`` limits of a metric; ``higher``: larger values are better."""

    label: str
    good: float
    fair: float
    higher: bool
    unit: str = ""

    def grade(self, value: float | None) -> str | None:
        if value is None or value != value:  # None or NaN
            return None
        if self.higher:
            return "good" if value >= self.good else "fair" if value >= self.fair else "poor"
        return "good" if value <= self.good else "fair" if value <= self.fair else "poor"

    def legend(self) -> str:
        """``rel L2: good <= 0.10, fair <= 0.25, poor above``."""
        op, other = (">=", "below") if self.higher else ("<=", "above")
        return f"{self.label}: good {op} {self.good:g}{self.unit}, fair {op} {self.fair:g}{self.unit}, poor {other}"


BANDS: dict[str, Band] = {
    "rel_l2": Band("rel L2", 0.10, 0.25, higher=False),
    "cosine": Band("cosine", 0.99, 0.95, higher=True),
    "min_cosine": Band("min cos", 0.90, 0.40, higher=True),
    "recall": Band("recall", 0.90, 0.75, higher=True),
    "nll_increase": Band("NLL increase", 0.01, 0.05, higher=False, unit=" nats/token"),
    "relative_nll_increase": Band("relative NLL increase", 0.005, 0.02, higher=False),
    "agreement": Band("top-1 agreement", 0.95, 0.85, higher=True),
    "kl": Band("KL", 0.01, 0.05, higher=False, unit=" nats"),
}

# metrics whose negative values are noise, not a gain
SIGNED = ("nll_increase", "relative_nll_increase")


def grade(metric: str, value: float | None) -> str | None:
    """``good``, ``fair``, ``poor``, ``noise`` (a negative NLL increase) or None (no band, no value)."""
    band = BANDS.get(metric)
    if band is None or value is None:
        return None
    if metric in SIGNED and value < 0:
        return "noise"
    return band.grade(value)


def grades(values: dict[str, float | None]) -> dict[str, str | None]:
    """:func:`grade` of every metric in ``values`` that has a band."""
    return {m: grade(m, v) for m, v in values.items() if m in BANDS}
