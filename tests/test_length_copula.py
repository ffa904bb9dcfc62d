"""Prompt/output dependence: a Gaussian copula fitted on normal scores, sampled
deterministically (prefix property), validated with clear errors, YAML round trip."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import shared_file
from hypothesis import given, settings
from hypothesis import strategies as st

from servetune.errors import ServetuneError
from servetune.schemas.base import document_from_data
from servetune.schemas.workload import Workload
from servetune.workloads.copula import fit_length_correlation, mid_ranks, rank_correlation
from servetune.workloads.fitting import (
    class_stats,
    fit_workload,
    load_workload,
    sample_trace,
    save_workload,
)
from servetune.workloads.formats import load_trace
from servetune.workloads.trace import from_arrays


def _doc(correlation: object = None) -> dict:
    cls: dict = {
        "arrival": {"process": "poisson", "rate_per_s": 10.0},
        # uniform on [1, 1001] for both lengths: easy to check by hand
        "prompt_tokens": {"quantiles": [0, 1], "values": [1, 1001]},
        "output_tokens": {"quantiles": [0, 1], "values": [1, 1001]},
    }
    if correlation is not None:
        cls["prompt_output_correlation"] = correlation
    return {"apiVersion": "servetune/v1", "kind": "Workload", "name": "x",
            "classes": {"default": cls}}


def _workload(correlation: object = None) -> Workload:
    return document_from_data(_doc(correlation), Workload, "w.yaml")


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    return rank_correlation(a, b)


def test_mid_ranks_share_ties_and_the_fit_inverts_spearman():
    np.testing.assert_array_equal(mid_ranks(np.array([30, 10, 20, 20])), [4, 1, 2.5, 2.5])
    x = np.arange(1, 101)
    # perfectly monotone: rho_S = 1 -> r = 2 sin(pi / 6) = 1, kept inside (-1, 1)
    assert fit_length_correlation(x, x * 3) == 0.9999
    assert fit_length_correlation(x, -x) == -0.9999
    assert rank_correlation(x, np.full(100, 7)) == 0.0


@pytest.mark.parametrize("r", [0.8, -0.5])
def test_sampled_lengths_have_the_copula_rank_correlation_and_the_marginals(r):
    s = sample_trace(_workload(r), n_requests=40_000, seed=3)
    # Gaussian copula: Spearman = (6 / pi) asin(r / 2)
    assert _spearman(s.prompt_tokens, s.output_tokens) == pytest.approx(
        6 / math.pi * math.asin(r / 2), abs=0.02)
    for x in (s.prompt_tokens, s.output_tokens):  # uniform on 1..1001 either way
        assert x.mean() == pytest.approx(501, rel=0.02)
        assert np.quantile(x, 0.9) == pytest.approx(901, rel=0.02)


def test_almost_perfect_negative_dependence_pairs_long_with_short():
    s = sample_trace(_workload(-0.9999), n_requests=5000, seed=0)
    # u_o ~= 1 - u_p, so prompt + output ~= 1 + 1001
    assert np.abs(s.prompt_tokens + s.output_tokens - 1002).max() < 40


def test_without_correlation_the_lengths_are_independent():
    s = sample_trace(_workload(), n_requests=40_000, seed=3)
    assert abs(_spearman(s.prompt_tokens, s.output_tokens)) < 0.02


def _copula_trace(r: float, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    z = rng.multivariate_normal([0, 0], [[1, r], [r, 1]], n)
    prompt = np.rint(np.exp(7 + 1.5 * z[:, 0])).astype(np.int64) + 1  # lognormal
    output = np.rint(200 * np.exp(z[:, 1])).astype(np.int64) + 1
    arrival = np.cumsum(rng.exponential(0.1, n))
    return from_arrays(arrival, prompt, output)


@pytest.mark.parametrize("r", [-0.6, 0.3])
def test_fit_recovers_a_known_copula(r):
    w = fit_workload(_copula_trace(r, 8000))
    assert w.classes["default"].prompt_output_correlation == pytest.approx(r, abs=0.03)


def test_fit_leaves_independent_lengths_independent():
    w = fit_workload(_copula_trace(0.0, 8000, seed=1))
    assert w.classes["default"].prompt_output_correlation is None
    # too few requests to tell: left out too
    assert fit_length_correlation(np.arange(1, 21), np.arange(1, 21)) is None
    # a constant length carries no dependence
    assert fit_length_correlation(np.arange(1, 101), np.full(100, 7)) is None


def test_round_trip_determinism_and_stats(tmp_path):
    w = fit_workload(_copula_trace(-0.6, 3000), name="cop")
    path = tmp_path / "w.yaml"
    save_workload(w, path)
    assert "prompt_output_correlation: -0." in path.read_text()
    back = load_workload(path)
    assert back == w
    a = sample_trace(back, n_requests=3000, seed=9)
    b = sample_trace(w, n_requests=3000, seed=9)
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens)
    c = sample_trace(w, n_requests=3000, seed=10)
    assert not np.array_equal(a.output_tokens, c.output_tokens)
    # the marginals (what the optimizer's models read) do not depend on the copula
    plain = w.model_copy(deep=True)
    plain.classes["default"].prompt_output_correlation = None
    assert class_stats(plain) == class_stats(w)


_COP = _workload(-0.7)


@settings(max_examples=10, deadline=None)
@given(short=st.integers(1, 3000), extra=st.integers(1, 140_000), seed=st.integers(0, 2**32))
def test_shorter_sample_is_a_prefix(short, extra, seed):
    a = sample_trace(_COP, n_requests=short, seed=seed)
    b = sample_trace(_COP, n_requests=short + extra, seed=seed)
    np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens[:short])
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens[:short])


@pytest.mark.parametrize("bad", [1.0, -1.0, 1.5, "nan", "strong"])
def test_bad_correlation_gives_one_clear_error(bad):
    with pytest.raises(ServetuneError) as err:
        _workload(float("nan") if bad == "nan" else bad)
    assert "prompt_output_correlation" in str(err.value)


def test_mooncake_long_context_prompts_come_with_short_outputs():
    trace = load_trace(shared_file("traces", "mooncake_synthetic_trace.jsonl.gz"))
    stationary = fit_workload(trace, rate_windows_s=None)
    r = stationary.classes["default"].prompt_output_correlation
    assert r is not None and -0.6 < r < -0.45
    # auto also fits the length drift (prompts grow, outputs shrink over the trace); the
    # copula's r is then the within-window part of the dependence
    auto = fit_workload(trace, arrival_process="parametric")
    assert auto.classes["default"].length_shift is not None
    r_within = auto.classes["default"].prompt_output_correlation
    assert r_within is not None and r < r_within < -0.3
    for w in (stationary, auto):
        s = sample_trace(w, n_requests=len(trace), seed=0)
        assert _spearman(s.prompt_tokens, s.output_tokens) == pytest.approx(
            _spearman(trace.prompt_tokens, trace.output_tokens), abs=0.03)
