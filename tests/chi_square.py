"""Chi-square tests for the sampling tests, without scipy: p = Q(dof / 2, statistic / 2), the regularized upper
incomplete gamma function (`torch.special.gammaincc`, float64)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ChiSquare:
    statistic: float
    dof: int
    p_value: float

    def __str__(self) -> str:
        return f"chi2={self.statistic:.1f} dof={self.dof} p={self.p_value:.3g}"


def p_value(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square with `dof` degrees of freedom."""
    a = torch.tensor(dof / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(statistic / 2.0, dtype=torch.float64)))


def goodness_of_fit(observed: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> ChiSquare:
    """Counts per cell against exact cell probabilities; cells expected below `min_expected` are pooled.

    Cells of probability 0 must be empty (asserted): the sampler produced something impossible otherwise.
    """
    observed = np.asarray(observed, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    assert observed[probs == 0].sum() == 0, "a cell of probability 0 was sampled"
    observed, probs = observed[probs > 0], probs[probs > 0]
    expected = probs / probs.sum() * observed.sum()
    small = expected < min_expected
    obs = np.append(observed[~small], observed[small].sum()) if small.any() else observed
    exp = np.append(expected[~small], expected[small].sum()) if small.any() else expected
    statistic = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return ChiSquare(statistic, dof, p_value(statistic, dof))


def two_sample(counts_a: np.ndarray, counts_b: np.ndarray, min_total: int = 10) -> ChiSquare:
    """Homogeneity of two samples (counts over the same cells); cells with fewer than `min_total` samples in
    both together are pooled into one cell."""
    a = np.asarray(counts_a, dtype=np.float64)
    b = np.asarray(counts_b, dtype=np.float64)
    rare = (a + b) < min_total
    a = np.append(a[~rare], a[rare].sum())
    b = np.append(b[~rare], b[rare].sum())
    keep = (a + b) > 0
    table = np.stack([a[keep], b[keep]])  # [2, C]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    return ChiSquare(statistic, dof, p_value(statistic, dof))
