"""Step-time model: monotone in every input; constant and invalid models."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetune.profiles.shipped import load_profile, shipped_profiles
from servetune.profiles.steptime import StepTimeModel

SHIPPED = [load_profile(n).step_time for n in shipped_profiles()]

coef = st.floats(min_value=0.0, max_value=1e-3, allow_nan=False)
small = st.floats(min_value=0.0, max_value=1e-6, allow_nan=False)
pieces = st.lists(st.tuples(st.floats(0.0, 0.05), st.floats(0.0, 1e-4)), min_size=1,
                  max_size=6)


@st.composite
def models(draw) -> StepTimeModel:
    if draw(st.booleans()) and SHIPPED:
        return draw(st.sampled_from(SHIPPED))
    return StepTimeModel(
        fixed_s=draw(coef), gemm_pieces=draw(pieces), allreduce_s_per_token=draw(small),
        decode_attn_s_per_context_token=draw(small), decode_attn_s_per_seq=draw(small),
        prefill_attn_s_per_token_pair=draw(small), lm_head_s_per_row=draw(small),
    )


@st.composite
def steps(draw) -> tuple[float, float, float, float, float]:
    decode = draw(st.integers(0, 1024))
    prefill = draw(st.integers(0, 16384))
    prefix = draw(st.integers(0, 32768))
    ctx = decode * draw(st.integers(1, 32768)) if decode else 0
    tokens = decode + prefill
    sampled = decode + (1 if prefill else 0)
    return tokens, sampled, decode, ctx, prefill * (prefix + prefill / 2)


@settings(max_examples=300, deadline=None)
@given(models(), steps(), st.integers(1, 4096), st.integers(0, 4096 * 1024))
def test_more_tokens_or_context_never_cheaper(model, step, more_tokens, more_ctx):
    t, s, d, c, w = step
    base = model.seconds(t, s, d, c, w)
    assert base >= 0
    # a longer prefill chunk: more tokens and more attention pairs
    assert model.seconds(t + more_tokens, s, d, c, w + more_tokens * 10) >= base
    # more context for the same decoding sequences
    assert model.seconds(t, s, d, c + more_ctx, w) >= base
    # one more decoding sequence (one token, one sampled row, its context)
    assert model.seconds(t + 1, s + 1, d + 1, c + 1, w) >= base


def test_constant_step_time():
    model = StepTimeModel(constant_s=0.02)
    assert model.seconds(8192, 100, 99, 10**6, 10**7) == 0.02


def test_negative_piece_rejected():
    with pytest.raises(ValueError):
        StepTimeModel(gemm_pieces=[(0.001, -1e-6)])


# ---- host-side cost (issue 13) ------------------------------------------------------
HOSTED = StepTimeModel(
    fixed_s=0.0005, gemm_pieces=[(0.004, 1e-5)], decode_attn_s_per_context_token=3e-8,
    decode_attn_s_per_seq=1e-6, lm_head_s_per_row=1.5e-6,
    host_s_per_step=0.0012, host_s_per_seq=2e-5, host_overlap=False,
)


def test_step_with_host_cost_worked_by_hand():
    # 8 decoding sequences of 1,000 context tokens, nothing else:
    #   GPU  = 0.5 ms + (4 ms + 8 x 10 us) + 8,000 x 30 ns + 8 x 1 us + 8 x 1.5 us
    #        = 0.5 + 4.08 + 0.24 + 0.008 + 0.012 = 4.84 ms
    #   host = 1.2 ms + 8 x 20 us = 1.36 ms;  step = 6.20 ms
    assert HOSTED.seconds(8, 8, 8, 8000, 0) == pytest.approx(6.20e-3, rel=1e-12)
    assert HOSTED.gpu_only().seconds(8, 8, 8, 8000, 0) == pytest.approx(4.84e-3, rel=1e-12)
    # a constant step time ignores host costs (it is the whole step)
    assert StepTimeModel(constant_s=0.01, host_s_per_step=0.5).seconds(8, 8, 8, 8000, 0) \
        == 0.01


def test_unset_host_cost_takes_the_engines_default():
    from servetune.engines import ENGINES

    gpu = HOSTED.model_copy(update={"host_s_per_step": None, "host_s_per_seq": None,
                                    "host_overlap": None})
    base = gpu.gpu_only().seconds(8, 8, 8, 8000, 0)
    floor = gpu.gpu_only().seconds(1, 1, 1, 1, 0)
    for eng in ENGINES:
        step = max(0.0, eng.host.per_step_s - floor) if eng.host.overlap else eng.host.per_step_s
        want = base + step + 8 * eng.host.per_seq_s
        assert gpu.seconds(8, 8, 8, 8000, 0, engine=eng.name) == pytest.approx(want)
        assert eng.host.source
    # a profile's own figure wins over the engine's
    assert HOSTED.seconds(8, 8, 8, 8000, 0, engine="tgi") == pytest.approx(6.20e-3)


def test_numba_and_python_step_time_agree_with_host_cost():
    # the compiled kernel and the pure-Python reference replay the same steps: same times
    import numpy as np

    from servetune.schemas.policy import Policy
    from servetune.sim.api import simulate
    from servetune.workloads.trace import from_arrays

    profile = load_profile("h100-80gb-llama-3.1-8b")
    trace = from_arrays(np.array([0.0, 0.0, 0.01, 0.5]), np.array([1000, 3000, 200, 9000]),
                        np.array([50, 20, 80, 10]))
    for engine in ("vllm", "sglang"):
        fast = simulate(trace, Policy(), profile, engine=engine).metrics
        ref = simulate(trace, Policy(), profile, engine=engine, reference=True).metrics
        np.testing.assert_allclose(fast.e2e_s, ref.e2e_s, rtol=1e-12)
        np.testing.assert_allclose(fast.ttft_s, ref.ttft_s, rtol=1e-12)
    # and the host cost is in them: one request alone, 50 steps, each >= 1 vLLM host cost
    alone = simulate(from_arrays(np.zeros(1), np.array([100]), np.array([50])), Policy(),
                     profile).metrics
    gpu = profile.model_copy(update={"step_time": profile.step_time.gpu_only()})
    bare = simulate(from_arrays(np.zeros(1), np.array([100]), np.array([50])), Policy(),
                    gpu).metrics
    host_step, host_seq, overlap = profile.step_time.host_seconds("vllm")
    assert overlap and host_step == 0.0 and host_seq > 0  # vLLM V1: per sequence only
    assert alone.e2e_s[0] - bare.e2e_s[0] == pytest.approx(50 * host_seq)


def test_host_fields_round_trip_through_profile_yaml(tmp_path):
    from servetune.profiles.schema import Profile
    from servetune.profiles.shipped import load_profile
    from servetune.schemas.base import document_to_yaml

    profile = load_profile("h200-llama-3.1-8b")
    assert profile.step_time.host_s_per_step is None  # shipped profiles: GPU time only
    pinned = profile.model_copy(update={"step_time": profile.step_time.model_copy(
        update={"host_s_per_step": 0.0015, "host_s_per_seq": 1.2e-5})})
    path = tmp_path / "p.yaml"
    path.write_text(document_to_yaml(pinned), encoding="utf-8")
    import yaml

    back = Profile.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    assert back.step_time == pinned.step_time
    assert back.step_time.host_seconds("trtllm") == (0.0015, 1.2e-5, False)


@pytest.mark.parametrize("field,value", [
    ("host_s_per_step", -0.001), ("host_s_per_seq", -1e-6),
    ("host_s_per_step", 2.0), ("host_s_per_seq", float("nan")),
])
def test_bad_host_cost_is_rejected_naming_the_field(field, value):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        StepTimeModel(**{field: value})
    assert field in str(err.value)


def test_an_overlapped_per_step_cost_shows_only_above_the_smallest_gpu_step():
    # the smallest GPU step (1 sequence, 1 token, 1 context token) of HOSTED:
    #   0.5 ms + (4 ms + 10 us) + 30 ns + 1 us + 1.5 us = 4.51253 ms
    floor = HOSTED.gpu_only().seconds(1, 1, 1, 1, 0)
    assert floor == pytest.approx(4.51253e-3, rel=1e-12)
    gpu = HOSTED.gpu_only().seconds(8, 8, 8, 8000, 0)
    for per_step, exposed in ((0.0012, 0.0), (floor, 0.0), (0.006, 0.006 - floor)):
        over = HOSTED.model_copy(update={"host_s_per_step": per_step, "host_overlap": True})
        assert over.seconds(8, 8, 8, 8000, 0) == pytest.approx(gpu + exposed + 8 * 2e-5)
        serial = over.model_copy(update={"host_overlap": False})
        assert serial.seconds(8, 8, 8, 8000, 0) == pytest.approx(gpu + per_step + 8 * 2e-5)
    # the GPU scale moves the floor with the GPU time it hides under
    slow = HOSTED.model_copy(update={"host_s_per_step": 0.006, "host_overlap": True,
                                     "gpu_time_scale": 2.0})
    assert slow.seconds(8, 8, 8, 8000, 0) == pytest.approx(2 * gpu + 8 * 2e-5)


def test_engine_host_rows():
    from servetune.engines import VLLM_HOST_S_PER_SEQ, engine

    vllm = engine("vllm").host
    assert vllm.overlap and vllm.per_step_s == 0.0 and vllm.per_seq_s == VLLM_HOST_S_PER_SEQ
    assert 50e-6 < VLLM_HOST_S_PER_SEQ < 500e-6  # a fit, in microseconds, not a unit slip
    for name in ("sglang", "trtllm", "tgi"):  # no admitted measurement: nothing charged
        row = engine(name).host
        assert (row.per_step_s, row.per_seq_s) == (0.0, 0.0) and "calibrate" in row.source


def test_unknown_engine_is_named():
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        HOSTED.model_copy(update={"host_s_per_step": None}).as_arrays("nope")
