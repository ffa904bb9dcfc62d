"""Rank correlation and the Gaussian copula that couples two lengths (pure functions).

A Gaussian copula with correlation r draws normal scores z_a and z_b = r z_a + sqrt(1 -
r^2) e and inverts each marginal at Phi(z): the marginals stay exactly as given, and the
Spearman rank correlation is rho_S = (6 / pi) asin(r / 2), so a fit inverts it from the
data's own rho_S. Used for a class's prompt and output lengths
(:mod:`servetune.workloads.fitting`) and a later turn's (:mod:`servetune.workloads.prefixes`).
"""

from __future__ import annotations

import math
import statistics

import numpy as np

COPULA_MIN_REQUESTS = 30
COPULA_SIGMAS = 3.0  # fitted when |r| exceeds this many standard errors (1/sqrt(n)) of 0


def mid_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``x``, ties sharing their mean rank (so ties add no order of their own)."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)
    return ((upper - (counts - 1) / 2.0)[inverse]).astype(np.float64)


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (mid-ranks for ties); 0 when either is constant."""
    ra, rb = mid_ranks(np.asarray(a)), mid_ranks(np.asarray(b))
    if not (ra.std() > 0 and rb.std() > 0):
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def fit_length_correlation(prompt: np.ndarray, output: np.ndarray) -> float | None:
    """The Gaussian-copula correlation r whose Spearman rank correlation equals the
    lengths' own rho_S: r = 2 sin(pi rho_S / 6), 4 decimals. None when there are fewer
    than COPULA_MIN_REQUESTS requests or |rho_S| <= COPULA_SIGMAS / sqrt(n - 1) (its
    standard error under independence: independence explains it)."""
    n = len(prompt)
    if n < COPULA_MIN_REQUESTS:
        return None
    rho = rank_correlation(prompt, output)
    if not abs(rho) > COPULA_SIGMAS / math.sqrt(n - 1):
        return None
    r = 2.0 * math.sin(math.pi * rho / 6.0)
    return float(min(max(round(r, 4), -0.9999), 0.9999))


INV_PHI = np.frompyfunc(statistics.NormalDist().inv_cdf, 1, 1)
PPF_CLIP = 1e-9  # Phi^-1 of a uniform clipped to (PPF_CLIP, 1 - PPF_CLIP)


def normal_ppf(u: np.ndarray) -> np.ndarray:
    """Phi^-1(u), elementwise, u clipped away from 0 and 1."""
    return INV_PHI(np.clip(np.asarray(u, dtype=np.float64), PPF_CLIP, 1 - PPF_CLIP)).astype(
        np.float64)


def couple(z_a: np.ndarray, u_b: np.ndarray, r: float) -> np.ndarray:
    """The uniform of a second length coupled to normal scores ``z_a`` by correlation
    ``r``, from independent uniforms ``u_b``: Phi(r z_a + sqrt(1 - r^2) Phi^-1(u_b))."""
    return normal_cdf(r * z_a + math.sqrt(1.0 - r * r) * normal_ppf(u_b))


def normal_scores(x: np.ndarray) -> np.ndarray:
    """Phi^-1((mid-rank - 1/2) / n) of each value, scaled to unit variance."""
    x = np.asarray(x)
    z = INV_PHI((mid_ranks(x) - 0.5) / len(x)).astype(np.float64)
    sd = float(z.std())
    return z / sd if sd > 0 else z


_ERF = np.frompyfunc(math.erf, 1, 1)


def normal_cdf(z: np.ndarray) -> np.ndarray:
    """Phi(z), elementwise (math.erf: exact to double precision, no scipy)."""
    return 0.5 * (1.0 + _ERF(z / math.sqrt(2.0)).astype(np.float64))
