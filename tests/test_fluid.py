"""The fluid (steady-state) model: its formulas against hand computations and
properties that must hold for the MILP built on it to be exact."""

from __future__ import annotations

import math

import numpy as np
import pytest
from optimizer_fixtures import STEP, fluid, synthetic_load

from servetune.models.fluid import (
    ClassLoad,
    Knobs,
    LoadModel,
    knobs_grid,
    poisson_quantile,
    poisson_quantile_cf,
)


def test_poisson_quantile_exact_small_cases():
    # Poisson(2): CDF(3) = 0.857, CDF(4) = 0.947 -> the 0.9 quantile is 4.
    assert poisson_quantile(2.0, 0.9) == 4
    # Poisson(1): P(0) = 0.368 -> the 0.3 quantile is 0.
    assert poisson_quantile(1.0, 0.3) == 0
    assert poisson_quantile(0.0, 0.99) == 0
    # Cornish-Fisher is within one of the exact quantile at moderate means.
    for m in (20.0, 100.0, 400.0):
        assert abs(poisson_quantile_cf(m, 0.99) - poisson_quantile(m, 0.99)) <= 1.0


def test_mean_step_time_charges_prefill_the_compute_bound_slope():
    """Decode rows take the GEMM's piecewise form (floor 4 ms, then 2.6e-5 s/token);
    prefill tokens the steepest slope, 2.6e-5 s/token; every other term is linear."""
    fm = fluid()
    for x in (0.05, 0.3, 3.0):
        d = x * fm.decode_rows
        no_gemm = STEP.seconds(
            tokens=0.0,
            sampled_rows=x * fm.output_mean,
            decode_seqs=d,
            decode_context_tokens=x * fm.context,
            prefill_attn_pairs=x * fm.pairs,
        ) - 4e-3  # seconds() at 0 tokens includes the 4 ms floor
        expected = no_gemm + max(4e-3, 2.6e-5 * d) + 2.6e-5 * x * fm.prompt_mean
        assert float(fm.mean_step_s(x)) == pytest.approx(expected, rel=1e-12)
        # Never below the profile's form at the mean composition (Jensen, convex GEMM).
        at_mean = STEP.seconds(
            tokens=x * fm.tokens, sampled_rows=x * fm.output_mean, decode_seqs=d,
            decode_context_tokens=x * fm.context, prefill_attn_pairs=x * fm.pairs,
        )
        assert float(fm.mean_step_s(x)) >= at_mean - 1e-15


def test_rate_and_arrivals_per_step_are_inverse():
    fm = fluid()
    for x in (0.01, 0.2, 1.5):
        rate = x / float(fm.mean_step_s(x))
        assert fm.x_at_rate(rate) == pytest.approx(x, rel=1e-9)
    # Beyond what the GPU can process, no steady state exists.
    c1 = max(c for _, c in fm.step_pieces())
    assert fm.x_at_rate(1.01 / c1) == math.inf


def test_moments_from_quantile_functions_match_samples():
    rng = np.random.default_rng(1)
    p = rng.integers(1, 5000, 200_000)
    o = rng.integers(1, 500, 200_000)
    direct = ClassLoad.from_samples("a", 1.0, p, o)
    via_q = ClassLoad.from_quantile_functions(
        "a", 1.0, direct.prompt_quantile, direct.output_quantile,
        prompt_mean=direct.prompt_mean, output_mean=direct.output_mean,
    )
    assert via_q.prompt_mean == pytest.approx(direct.prompt_mean)
    assert via_q.prompt_sq_mean == pytest.approx(direct.prompt_sq_mean, rel=0.02)
    assert via_q.output_sq_mean == pytest.approx(direct.output_sq_mean, rel=0.02)


def test_littles_law_and_kv_holding():
    fm = fluid()
    k = Knobs(256, 2048)
    x = 0.25
    st = fm.state(k, x)
    room = 2048 - x * fm.decode_rows
    prefill_steps = fm.prompt_mean / room + 0.5
    assert float(st.running[0]) == pytest.approx(x * (fm.decode_rows + prefill_steps))
    # A request holds about prompt + output/2 tokens over its decode life.
    assert float(st.kv_mean_tokens[0]) == pytest.approx(
        x * (fm.context + fm.prompt_mean * prefill_steps)
    )


def test_every_condition_is_monotone_in_load():
    fm = fluid()
    xs = np.linspace(1e-4, fm.x_upper(Knobs(64, 1024, 512, 0.05, 100, 50_000)), 200)
    for k in (Knobs(64, 1024, 512, 0.05, 100, 50_000), Knobs(256, 4096)):
        st = fm.state(k, xs)
        for name, (value, _) in fm.conditions(k, st).items():
            v = np.asarray(value, dtype=float)
            assert np.all(np.diff(v) >= -1e-9 * np.maximum(1, np.abs(v[1:]))), name


def test_limits_bracket_each_condition():
    fm = fluid()
    k = Knobs(64, 1024)
    for name, lim in fm.limits(k).items():
        if 0 < lim.x_max < fm.x_upper(k) * 0.999:
            value_lo, limit = fm.conditions(k, fm.state(k, lim.x_max))[name]
            value_hi, _ = fm.conditions(k, fm.state(k, lim.x_max * 1.001))[name]
            assert float(value_lo[0]) <= limit < float(value_hi[0]), name


def test_limits_many_equals_limits_one_by_one():
    fm = fluid()
    points = knobs_grid(
        {"batching.max_num_seqs": [16, 256], "batching.max_num_batched_tokens": [512, 4096],
         "batching.long_prefill_token_threshold": [0, 256],
         "admission.max_queued_requests": [None, 50]}
    )
    many = fm.limits_many(points)
    for k, lims in zip(points, many, strict=True):
        one = fm.limits(k)
        assert set(one) == set(lims)
        for name in one:
            assert lims[name].x_max == pytest.approx(one[name].x_max, rel=1e-6, abs=1e-12)


def test_goodput_is_the_rate_at_the_binding_limit():
    fm = fluid()
    k = Knobs(256, 2048)
    rate, binding, lims = fm.goodput(k)
    x = min(lim.x_max for lim in lims.values())
    assert lims[binding].x_max == x
    assert rate == pytest.approx(x / float(fm.mean_step_s(x)))
    pred = fm.evaluate(k, rate * 0.99)
    assert pred["stable"]
    assert pred["tpot_q_s"]["default"] <= 0.1 + 1e-9
    assert pred["ttft_q_s"]["default"] <= 2.0 + 1e-9


def test_tight_tpot_target_is_infeasible_at_any_load():
    # below the minimum step of STEP under vLLM: 1 ms fixed + 4 ms GEMM floor (GPU) + the
    # engine table's vLLM host cost per step (the per-sequence host part vanishes at no load)
    fm = fluid(tpot_s=0.004)
    rate, binding, lims = fm.goodput(Knobs(64, 512))
    assert rate == 0.0
    assert binding.key == "tpot[default]"
    host_step, _ = STEP.host_seconds("vllm")
    assert lims[binding].floor_value == pytest.approx(5e-3 + host_step, rel=0.05)


def test_larger_kv_pool_never_lowers_goodput():
    small = fluid(kv_blocks=2_000)
    large = fluid(kv_blocks=200_000)
    for k in (Knobs(256, 2048), Knobs(1024, 8192)):
        assert large.goodput(k)[0] >= small.goodput(k)[0]


def test_trace_moments():
    from servetune.workloads.trace import from_arrays

    tr = from_arrays(np.arange(5, dtype=float), np.array([10, 20, 30, 40, 50]),
                     np.array([1, 2, 3, 4, 5]))
    ld = LoadModel.from_trace(tr)
    assert ld.rate_per_s == pytest.approx(5 / 4)
    c = ld.classes[0]
    assert c.prompt_mean == 30 and c.output_sq_mean == pytest.approx(11.0)
    assert synthetic_load().classes[0].share == 1.0


def test_knobs_round_trip_through_a_policy():
    from servetune.schemas.policy import Policy
    from servetune.schemas.space import apply_knobs

    k = Knobs(128, 2048, 512, 0.05, 300, 100_000)
    assert Knobs.from_policy(apply_knobs(Policy(), k.as_dotted())) == k
    grid = knobs_grid({"max_num_seqs": [512, 1024], "max_num_batched_tokens": [512, 8192]})
    assert grid == [Knobs(512, 512), Knobs(512, 8192), Knobs(1024, 8192)]


def test_tpot_noise_quantile_averages_over_a_requests_decode_steps():
    from servetune.models.fluid import _TPOT_TAU, normal_quantile, tpot_noise_quantiles

    prompts = np.full(1000, 500)
    z99 = normal_quantile(0.99)
    # Every request decodes 100 steps: its mean step has sd / 10, so z = z99 / 10 when
    # steps are independent (tau = 1); correlated over 25 steps, 4 independent ones: z99 / 2.
    same = ClassLoad.from_samples("a", 1.0, prompts, np.full(1000, 101))
    z = tpot_noise_quantiles(same, 0.99)
    assert z[0] == pytest.approx(z99 / 10, rel=1e-6)
    assert float(np.interp(np.log(25.0), np.log(_TPOT_TAU), z)) == pytest.approx(
        z99 / 2, rel=0.05)
    assert z[-1] == pytest.approx(z99, rel=1e-6)  # correlated past the request's life
    assert np.all(np.diff(z) >= -1e-12) and np.all(z <= z99 + 1e-12)
    # One decode step each: no averaging at all.
    short = ClassLoad.from_samples("b", 1.0, prompts, np.full(1000, 2))
    assert tpot_noise_quantiles(short, 0.99)[0] == pytest.approx(z99, rel=1e-6)


def test_chunked_prefill_variance_is_capped_by_the_chunk():
    """E[P min(P, c)]: E[P^2] when every prompt fits one chunk, c E[P] when every prompt
    is longer than a chunk; in between it grows with c."""
    rng = np.random.default_rng(3)
    prompts = rng.integers(200, 2000, 50_000)
    load = LoadModel((ClassLoad.from_samples("a", 1.0, prompts, np.full(50_000, 50)),), 5.0)
    fm = fluid(load=load)
    assert float(fm.prompt_chunked_sq(np.array([1e9]))[0]) == pytest.approx(fm.prompt_sq)
    small = float(fm.prompt_chunked_sq(np.array([100.0]))[0])
    assert small == pytest.approx(100.0 * fm.prompt_mean, rel=0.02)
    cs = np.array([100.0, 400.0, 800.0, 1600.0, 4000.0])
    vals = fm.prompt_chunked_sq(cs)
    assert np.all(np.diff(vals) > 0) and vals[-1] <= fm.prompt_sq * (1 + 1e-9)
