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
    lognormal_quantile,
    normal_quantile,
    normal_sf,
    poisson_quantile,
    poisson_quantile_cf,
)
from servetune.profiles.steptime import COEF_HOST_STEP


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
    # A request holds about prompt + output/2 tokens over its decode life, and its
    # prompt over its own P / room + 1/2 prefill steps: E[P (P / room + 1/2)].
    assert float(st.kv_mean_tokens[0]) == pytest.approx(
        x * (fm.context + fm.prompt_sq / room + 0.5 * fm.prompt_mean)
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
    coef, _ = STEP.as_arrays("vllm")  # the per-step host time as a step exposes it
    assert lims[binding].floor_value == pytest.approx(5e-3 + coef[COEF_HOST_STEP], rel=0.05)


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


def test_normal_tail_and_lognormal_quantile_exact_cases():
    for z in (-3.0, -0.5, 0.0, 1.0, 2.326, 5.0):
        assert float(normal_sf(z)) == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)),
                                                    abs=1e-7)
    # lognormal(0, 1): mean e^0.5, variance (e - 1) e; its q-quantile is exp(z_q).
    mean, var = math.exp(0.5), (math.e - 1.0) * math.e
    for q in (0.5, 0.9, 0.99):
        assert float(lognormal_quantile(mean, var, q)) == pytest.approx(
            math.exp(normal_quantile(q)), rel=1e-9)
    assert float(lognormal_quantile(0.0, 0.0, 0.99)) == 0.0


def two_point_load(prompts: tuple[int, int], outputs: tuple[int, int]) -> LoadModel:
    """Half the requests of each prompt length, independently half of each output."""
    n = 20_000
    p = np.repeat(np.array(prompts), n // 2)
    o = np.tile(np.repeat(np.array(outputs), n // 4), 2)
    return LoadModel((ClassLoad.from_samples("default", 1.0, p, o),), 1.0)


def test_prefill_excess_against_the_shot_process_it_approximates():
    """Oracle: draw the process the formula describes (for each request, Poisson(x (L +
    n)) overlapping prompts per prompt length, each adding T(P) L / (L + n)) and take the
    99th percentile of the extra time per decode step; the approximation (larger of a
    lognormal tail and a single-shot tail) must not fall below it and land within 30%
    above it (1.04-1.27x when written), and its mean must be x E[T(P)] exactly."""
    fm = fluid(load=two_point_load((400, 30_000), (20, 300)))
    rng = np.random.default_rng(7)
    a, b = fm._chunk_token_s, fm._pair_s
    for x, chunk in ((0.002, 512.0), (0.02, 512.0), (0.02, 1e9), (0.2, 2048.0), (1.0, 2048.0)):
        q99 = fm._prefill_excess_solve("default", np.array([x]), np.array([chunk]), 0.99)
        mean, _ = fm.prefill_excess_quantile("default", np.array([x]), np.array([chunk]), 0.99)
        t = np.array([a * p + 0.5 * b * p * p for p in (400, 30_000)])
        assert float(mean[0]) == pytest.approx(x * t.mean(), rel=1e-9)
        draws = []
        for out in (20, 300):
            L = out - 1
            n = np.maximum(np.ceil(np.array([400, 30_000]) / chunk), 1.0)
            counts = rng.poisson(x * 0.5 * (L + n), size=(100_000, 2))
            draws.append((counts * (t * L / (L + n))).sum(axis=1) / L)
        exact = float(np.quantile(np.concatenate(draws), 0.99))
        assert exact <= float(q99[0]) <= 1.3 * exact, (x, chunk)


def test_a_chunk_cap_spreads_long_prompts_over_more_requests():
    """Long prompts and short outputs: a request that meets an unchunked 30k-token
    prefill takes all of it in a few steps; chunked at 512 tokens, it shares its few
    steps with only a slice of the prompt: the TPOT tail falls, the mean does not."""
    fm = fluid(load=two_point_load((400, 30_000), (20, 300)))
    x = np.array([0.01])
    whole_mean, whole = fm.prefill_excess_quantile("default", x, np.array([1e9]), 0.99)
    cut_mean, cut = fm.prefill_excess_quantile("default", x, np.array([512.0]), 0.99)
    assert float(cut_mean[0]) == pytest.approx(float(whole_mean[0]))
    assert float(cut[0]) < 0.8 * float(whole[0])


def test_kv_quantile_sees_the_spread_of_holdings():
    """Same mean occupancy, one load with every prompt equal and one with a heavy tail:
    the tail's occupancy quantile is higher (the Poisson count times the mean holding
    could not tell them apart)."""
    n = 20_000
    even = LoadModel((ClassLoad.from_samples(
        "default", 1.0, np.full(n, 10_000), np.full(n, 100)),), 1.0)
    rng = np.random.default_rng(5)
    tail_p = np.where(rng.random(n) < 0.1, 91_000, 1_000)
    tail = LoadModel((ClassLoad.from_samples(
        "default", 1.0, tail_p, np.full(n, 100)),), 1.0)
    k = Knobs(256, 1_000_000)
    a, b = fluid(load=even), fluid(load=tail)
    x = 0.01
    sa, sb = a.state(k, x), b.state(k, x)
    assert float(sa.kv_mean_tokens[0]) == pytest.approx(float(sb.kv_mean_tokens[0]), rel=0.05)
    assert float(sb.kv_q_tokens[0]) > 1.3 * float(sa.kv_q_tokens[0])


def test_prefill_excess_table_matches_the_direct_solve():
    """The interpolated grid stays within 10% of solving at the point itself, and is
    monotone in load (the limits need it)."""
    fm = fluid()
    rng = np.random.default_rng(11)
    x = np.exp(rng.uniform(np.log(1e-4), np.log(5.0), 40))
    chunk = np.exp(rng.uniform(np.log(64.0), np.log(20_000.0), 40))
    _, table = fm.prefill_excess_quantile("default", x, chunk, 0.99)
    direct = fm._prefill_excess_solve("default", x, chunk, 0.99)
    assert np.all(np.abs(table / direct - 1.0) < 0.10)
    xs = np.geomspace(1e-9, 1e4, 300)
    _, along = fm.prefill_excess_quantile("default", xs, np.full(300, 512.0), 0.99)
    assert np.all(np.diff(along) >= 0) and along[0] < 1e-6
