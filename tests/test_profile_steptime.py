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
