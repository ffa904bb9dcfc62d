"""The block bootstrap: a trace's own requests in time blocks, permuted within strata;
chosen by auto from counts and lengths, sampled deterministically, validated clearly."""

from __future__ import annotations

import copy
import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from servetune.cli.root import app
from servetune.errors import ServetuneError
from servetune.schemas.base import document_from_data
from servetune.schemas.workload import Workload
from servetune.workloads.bootstrap import fit_block_bootstrap, sample_blocks
from servetune.workloads.fitting import (
    arrival_model,
    bootstrap_evidence,
    bootstrap_stratum_s,
    class_stats,
    fit_workload,
    load_workload,
    sample_trace,
    save_workload,
    workload_to_yaml,
)
from servetune.workloads.trace import Trace, from_arrays

# ------------------------------------------------------------------ a hand-written case

# Blocks of 10 s, strata of 2 blocks, a 35 s span: blocks b0..b3 of 10, 10, 10 and 5 s.
# Requests (prompt tokens name them): b0: 100 at 1 s, 200 at 4 s; b1: 300 at 2 s;
# b2: 400 at 3 s, 500 at 9 s; b3: 600 at 5 s (its end).
HAND = {
    "apiVersion": "servetune/v1", "kind": "Workload", "name": "hand",
    "classes": {
        name: {"arrival": {"process": "poisson", "rate_per_s": 3 / 35},
               "prompt_tokens": {"quantiles": [0, 1], "values": [100, 600]},
               "output_tokens": {"quantiles": [0, 1], "values": [1, 6]}}
        for name in ("a", "b")
    },
    "block_bootstrap": {
        "block_s": 10.0, "stratum_s": 20.0, "span_s": 35.0, "block_counts": [2, 1, 2, 1],
        "offset_s": [1.0, 4.0, 2.0, 3.0, 9.0, 5.0], "class_index": [0, 1, 0, 1, 0, 1],
        "prompt_tokens": [100, 200, 300, 400, 500, 600],
        "output_tokens": [1, 2, 3, 4, 5, 6],
    },
}
# (prompt, time in the cycle) for each order of the two strata's blocks
LAYOUTS = {
    (False, False): [(100, 1), (200, 4), (300, 12), (400, 23), (500, 29), (600, 35)],
    (True, False): [(300, 2), (100, 11), (200, 14), (400, 23), (500, 29), (600, 35)],
    (False, True): [(100, 1), (200, 4), (300, 12), (600, 25), (400, 28), (500, 34)],
    (True, True): [(300, 2), (100, 11), (200, 14), (600, 25), (400, 28), (500, 34)],
}


def _hand(**change) -> Workload:
    doc = copy.deepcopy(HAND)
    doc["block_bootstrap"].update(change)
    return document_from_data(doc, Workload, "hand.yaml")


def _layout_of(prompts: np.ndarray) -> tuple[bool, bool]:
    for key, rows in LAYOUTS.items():
        if prompts.tolist() == [p for p, _ in rows]:
            return key
    raise AssertionError(f"no layout has this order: {prompts.tolist()}")


def _times(key: tuple[bool, bool]) -> list[float]:
    return [float(t) for _, t in LAYOUTS[key]]


def test_hand_case_every_cycle_is_one_of_the_four_layouts():
    seen = set()
    for seed in range(24):
        s = sample_trace(_hand(), n_requests=12, seed=seed)
        first, second = _layout_of(s.prompt_tokens[:6]), _layout_of(s.prompt_tokens[6:])
        t = s.arrival_s + _times(first)[0]  # the sample starts at its first arrival
        np.testing.assert_allclose(t[:6], _times(first), atol=1e-9)
        np.testing.assert_allclose(t[6:] - 35.0, _times(second), atol=1e-9)
        seen.update([first, second])
        # requests keep their class and output (class b: 200, 400, 600)
        np.testing.assert_array_equal(s.output_tokens * 100, s.prompt_tokens)
        np.testing.assert_array_equal(s.class_id, (s.prompt_tokens // 100 + 1) % 2)
    assert seen == set(LAYOUTS)


def test_hand_case_order_comes_from_keys_seeded_by_seed_and_cycle():
    for seed, cycle in itertools.product((0, 7), (0, 1)):
        gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, cycle])))
        keys = gen.random(4)
        want = LAYOUTS[(bool(keys[0] > keys[1]), bool(keys[2] > keys[3]))]
        s = sample_trace(_hand(), n_requests=12, seed=seed)
        np.testing.assert_array_equal(s.prompt_tokens[6 * cycle: 6 * cycle + 6],
                                      [p for p, _ in want])


def test_hand_case_duration_and_rate_scale():
    one = sample_trace(_hand(), duration_s=35.0, seed=3)  # exactly one cycle
    assert sorted(one.prompt_tokens.tolist()) == [100, 200, 300, 400, 500, 600]
    fast = sample_trace(_hand(), n_requests=30, seed=3, rate_scale=4.0)
    slow = sample_trace(_hand(), n_requests=30, seed=3)
    np.testing.assert_allclose(fast.arrival_s, slow.arrival_s / 4.0, atol=1e-12)
    np.testing.assert_array_equal(fast.prompt_tokens, slow.prompt_tokens)
    assert arrival_model(_hand()) == "block bootstrap: 4 blocks of 10 s in 2 strata"


# ------------------------------------------------------------------ fitted from a trace


def _bursty(seed: int = 0, span: float = 1800.0) -> Trace:
    """Poisson arrivals whose rate switches between 0.5 and 6 req/s, holding a level for a
    geometric number of 5 s windows (mean 4); prompts and outputs i.i.d."""
    rng = np.random.default_rng(seed)
    level, out, w = 0, [], 5.0
    for i in range(int(span / w)):
        if rng.random() < 0.25:
            level = 1 - level
        out.append(i * w + np.sort(rng.random(rng.poisson((0.5, 6.0)[level] * w))) * w)
    t = np.concatenate(out)
    return from_arrays(t - t[0], rng.integers(10, 3000, len(t)), rng.integers(1, 400, len(t)))


def _poisson(seed: int, span: float = 3600.0, rate: float = 3.0) -> Trace:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, int(span * rate)))
    n = len(t)
    return from_arrays(t - t[0], rng.integers(10, 3000, n), rng.integers(1, 400, n))


BURSTY = _bursty()
BURSTY_FIT = fit_workload(BURSTY, name="bursty")


def test_auto_chooses_the_bootstrap_for_planted_bursts():
    boot = BURSTY_FIT.block_bootstrap
    assert boot is not None
    assert (boot.block_s, boot.stratum_s) == (60.0, 300.0)
    assert len(boot.block_counts) == 30 and boot.n_strata == 6
    assert boot.n_requests == len(BURSTY)
    # the classes keep their parametric fit (the optimizer's models read it)
    assert BURSTY_FIT.classes["default"].arrival.modulation is not None
    parametric = fit_workload(BURSTY, arrival_process="parametric")
    assert parametric.block_bootstrap is None
    assert parametric.classes == BURSTY_FIT.classes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_keeps_the_parametric_fit_on_a_poisson_trace(seed):
    trace = _poisson(seed)
    w = fit_workload(trace)
    assert w.block_bootstrap is None
    ev = bootstrap_evidence(trace, w, 60.0, 300.0)
    assert not ev["modulated"] and not ev["variance_time_misfit"]
    assert not ev["top_prompts_clustered"]
    assert fit_workload(trace, arrival_process="bootstrap").block_bootstrap is not None


def test_auto_chooses_the_bootstrap_when_the_longest_prompts_cluster():
    trace = _poisson(4)
    prompt = trace.prompt_tokens.copy()
    late = np.flatnonzero((trace.arrival_s > 2000) & (trace.arrival_s < 2300))
    prompt[late[::10]] = 50_000  # ~1% of requests, all in one 5-minute stratum
    clustered = from_arrays(trace.arrival_s, prompt, trace.output_tokens)
    w = fit_workload(clustered)
    ev = bootstrap_evidence(clustered, fit_workload(clustered, arrival_process="parametric"),
                            60.0, 300.0)
    assert ev["top_prompts_clustered"] and not ev["modulated"]
    assert ev["top_prompt_chi2"] > 10 * ev["top_prompt_limit"]
    assert w.block_bootstrap is not None


def test_variance_time_rule_flags_a_fit_that_misses_the_bursts():
    renewal = fit_workload(BURSTY, arrival_process="poisson")  # loses the bursts
    ev = bootstrap_evidence(BURSTY, renewal, 60.0, 300.0)
    assert ev["variance_time_misfit"] and not ev["modulated"]
    worst = max(ev["variance_time"], key=lambda c: c["excess"])
    assert worst["trace"] > 3 * worst["fit"]
    windows = [c["window_s"] for c in ev["variance_time"]]
    assert windows == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]  # up to span / 20


def test_short_traces_keep_the_parametric_fit_and_forcing_says_why():
    short = _bursty(span=200.0)  # fewer than 4 blocks of 60 s: no 2 strata of 2 blocks
    assert bootstrap_stratum_s(short.duration_s, 60.0) is None
    assert fit_workload(short).block_bootstrap is None
    with pytest.raises(ServetuneError, match="needs strata of at least 2 blocks of 60 s"):
        fit_workload(short, arrival_process="bootstrap")
    # a shorter block fits: slow windows of 200/6 s round to 2 blocks of 20 s
    w = fit_workload(short, arrival_process="bootstrap", block_s=20.0)
    assert w.block_bootstrap.stratum_s == 40.0
    with pytest.raises(ServetuneError, match="argument `block_s` must be > 0"):
        fit_workload(short, block_s=0.0)


def test_strata_follow_the_rate_windows_setting():
    span = 3436.0
    assert bootstrap_stratum_s(span, 60.0) == 300.0  # 12 windows of 286 s -> 5 blocks
    assert bootstrap_stratum_s(1022.0, 60.0) == 180.0  # 6 windows of 170 s -> 3 blocks
    # a trace under 12 minutes: windows under 2 blocks, so strata of 2 blocks
    assert bootstrap_stratum_s(400.0, 60.0) == 120.0  # 6 windows of 67 s
    assert bootstrap_stratum_s(span, 60.0, 600.0) == 600.0
    assert bootstrap_stratum_s(span, 60.0, None) == 3480.0  # one stratum: all 58 blocks
    w = fit_workload(BURSTY, rate_windows_s=None, arrival_process="bootstrap")
    assert w.block_bootstrap.n_strata == 1


def test_a_cycle_holds_each_request_once_and_class_stats_agree():
    trace = BURSTY
    classes = np.where(trace.prompt_tokens > 2000, 1, 0)
    two = from_arrays(trace.arrival_s, trace.prompt_tokens, trace.output_tokens,
                      class_id=classes.astype(np.int32), class_names=("short", "long"))
    w = fit_workload(two, split="class", arrival_process="bootstrap")
    n = len(two)
    rows = sorted(zip(two.class_ids().tolist(), two.prompt_tokens.tolist(),
                      two.output_tokens.tolist(), strict=True))
    s = sample_trace(w, n_requests=3 * n, seed=5)
    for c in range(3):
        cycle = slice(c * n, (c + 1) * n)
        got = sorted(zip(s.class_id[cycle].tolist(), s.prompt_tokens[cycle].tolist(),
                         s.output_tokens[cycle].tolist(), strict=True))
        assert got == rows  # nothing lost, nothing duplicated
    span = w.block_bootstrap.span_s
    for k, stats in enumerate(class_stats(w)):
        mine = s.class_id[:n] == k
        assert mine.sum() / span == pytest.approx(stats.rate_per_s, rel=2.0 / n)
        p = s.prompt_tokens[:n][mine]
        assert np.quantile(p, [0.5, 0.99, 1.0]) == pytest.approx(
            [stats.prompt_p50, stats.prompt_p99, stats.prompt_max], abs=0.01)
    assert set(s.priority.tolist()) == {0}


def test_sample_keeps_each_stratum_exactly():
    boot = BURSTY_FIT.block_bootstrap
    t, _, prompt, _, later = sample_blocks(boot, seed=2, n_requests=None,
                                           horizon_s=boot.span_s,
                                           rate_scale=1.0)  # one cycle, times not re-based
    assert not later.any()  # no prefix ids, no sessions
    assert len(t) == len(BURSTY)
    strata = np.minimum(t // 300, 5).astype(int)
    want = np.minimum(BURSTY.arrival_s // 300, 5).astype(int)
    np.testing.assert_array_equal(np.bincount(strata), np.bincount(want))
    for j in range(6):  # and its lengths
        assert sorted(prompt[strata == j]) == sorted(BURSTY.prompt_tokens[want == j])
    assert not np.array_equal(prompt, BURSTY.prompt_tokens)  # blocks did move


def test_deterministic_and_rate_scale():
    a = sample_trace(BURSTY_FIT, n_requests=20_000, seed=9)
    b = sample_trace(BURSTY_FIT, n_requests=20_000, seed=9)
    for col in ("arrival_s", "prompt_tokens", "output_tokens", "class_id"):
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col))
    other = sample_trace(BURSTY_FIT, n_requests=20_000, seed=10)
    assert not np.array_equal(a.prompt_tokens, other.prompt_tokens)
    fast = sample_trace(BURSTY_FIT, n_requests=20_000, seed=9, rate_scale=2.5)
    np.testing.assert_allclose(fast.arrival_s, a.arrival_s / 2.5, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(fast.prompt_tokens, a.prompt_tokens)
    long = sample_trace(BURSTY_FIT, duration_s=4000.0, seed=9)
    assert long.arrival_s[-1] <= 4000.0
    assert len(long) == pytest.approx(4000.0 * BURSTY_FIT.total_rate_per_s, rel=0.1)


@settings(max_examples=15, deadline=None)
@given(cycles=st.integers(1, 3), extra=st.integers(1, 30_000), seed=st.integers(0, 2**32))
def test_whole_cycles_are_a_prefix(cycles, extra, seed):
    short = cycles * len(BURSTY)
    a = sample_trace(BURSTY_FIT, n_requests=short, seed=seed)
    b = sample_trace(BURSTY_FIT, n_requests=short + extra, seed=seed)
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s[:short])
    np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens[:short])
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens[:short])


def test_a_part_cycle_takes_every_stratum():
    # half the hand case's requests: the first-ranked block of each stratum (b0 or b1,
    # then b2 or b3), never the first stratum only; laid out in stratum order
    for seed in range(8):
        s = sample_trace(_hand(), n_requests=3, seed=seed)
        first, second = s.prompt_tokens[s.prompt_tokens <= 300], s.prompt_tokens[
            s.prompt_tokens > 300]
        assert len(first) >= 1 and len(second) >= 1, s.prompt_tokens
        assert s.prompt_tokens.tolist() == first.tolist() + second.tolist()
    # and by time: 20 s of the 35 s hand case is one block of each stratum
    for seed in range(8):
        s = sample_trace(_hand(), duration_s=20.0, seed=seed)
        assert (s.prompt_tokens <= 300).any() and (s.prompt_tokens > 300).any()


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_a_part_cycle_keeps_the_mix(fraction):
    boot = BURSTY_FIT.block_bootstrap
    n = int(fraction * len(BURSTY))
    t, _, prompt, _, _ = sample_blocks(boot, seed=5, n_requests=n, horizon_s=math.inf,
                                       rate_scale=1.0)
    assert len(t) == n
    assert np.mean(prompt) == pytest.approx(np.mean(BURSTY.prompt_tokens), rel=0.05)
    # the rate: a few bursty blocks of each stratum, so only roughly the trace's
    assert n / t[-1] == pytest.approx(len(BURSTY) / BURSTY.duration_s, rel=0.25)


def test_cap_keeps_whole_strata_at_the_trace_rate():
    trace = BURSTY
    cap = len(trace) // 2
    boot = fit_block_bootstrap(trace, None, 60.0, 300.0, max_requests=cap)
    assert boot is not None and boot.n_requests <= cap
    assert boot.blocks_per_stratum == 5 and len(boot.block_counts) % 5 == 0
    # the rate of the kept strata is the whole trace's
    assert boot.n_requests / boot.span_s == pytest.approx(len(trace) / trace.duration_s,
                                                          rel=1e-6)
    assert fit_block_bootstrap(trace, None, 60.0, 300.0, max_requests=10) is None


def test_yaml_round_trip_flow_lists_and_bytes(tmp_path):
    path = tmp_path / "w.yaml"
    save_workload(BURSTY_FIT, path)
    text = path.read_text()
    assert "  block_counts: [" in text and "  prompt_tokens: [" in text
    assert "class_index" not in text  # one class
    back = load_workload(path)
    assert back == BURSTY_FIT
    assert workload_to_yaml(back) == text
    np.testing.assert_array_equal(sample_trace(back, n_requests=500, seed=1).arrival_s,
                                  sample_trace(BURSTY_FIT, n_requests=500, seed=1).arrival_s)


@pytest.mark.parametrize(("change", "words"), [
    ({"stratum_s": 25.0}, "stratum_s 25 s must be a whole number of blocks"),
    ({"block_counts": [2, 1, 3]}, "block_counts has 3 blocks but span_s 35 s"),
    ({"span_s": 45.0}, "block_counts has 4 blocks but span_s 45 s"),
    ({"block_counts": [2, 1, 2, -1]}, "block_counts[3] is -1"),
    ({"offset_s": [1.0, 4.0, 2.0]}, "offset_s has 3 entries but block_counts add up to 6"),
    ({"offset_s": [1.0, 4.0, 2.0, 3.0, 9.0, 6.0]}, "offset_s[5] is 6 s, beyond the 5 s"),
    ({"offset_s": [1.0, -4.0, 2.0, 3.0, 9.0, 5.0]}, "offset_s[1] is -4.0"),
    ({"prompt_tokens": [100, 200, 0, 400, 500, 600]}, "prompt_tokens: entry 2 is 0"),
    ({"output_tokens": [1, 2, 3]}, "output_tokens has 3 entries"),
    ({"class_index": None}, "block_bootstrap.class_index is missing: the workload has 2"),
    ({"class_index": [0, 1, 2, 0, 0, 0]}, "block_bootstrap.class_index[2] is 2"),
    ({"block_s": float("inf")}, "block_s: must be a finite number"),
    ({"block_s": 0}, "block_s"),
    ({"blocks": 4}, "block_bootstrap.blocks: unknown key"),
])
def test_bad_bootstrap_gives_one_clear_error(change, words):
    with pytest.raises(ServetuneError) as err:
        _hand(**change)
    text = str(err.value)
    assert "\n" not in text and text.startswith("hand.yaml: ")
    assert words in text and "block_bootstrap" in text


def test_cli_fit_summary_and_forced_bootstrap_error(tmp_path):
    src = tmp_path / "t.csv"
    src.write_text("ts,in,out\n" + "\n".join(
        f"{t:.4f},{p},{o}" for t, p, o in zip(BURSTY.arrival_s, BURSTY.prompt_tokens,
                                              BURSTY.output_tokens, strict=True)) + "\n")
    runner = CliRunner()
    base = ["workload", "fit", str(src), "--columns", "arrival=ts,prompt=in,output=out"]
    out = tmp_path / "w.yaml"
    result = runner.invoke(app, [*base, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "arrivals: block bootstrap: 30 blocks of 60 s in 6 strata" in result.output
    assert load_workload(out).block_bootstrap is not None
    shown = runner.invoke(app, ["workload", "show", str(out), "--json"])
    assert json.loads(shown.stdout)["arrival_model"] == (
        "block bootstrap: 30 blocks of 60 s in 6 strata")
    short = tmp_path / "short.csv"
    short.write_text("ts,in,out\n0,10,1\n100,10,1\n200,10,2\n")
    bad = runner.invoke(app, ["workload", "fit", str(short), "--columns",
                              "arrival=ts,prompt=in,output=out", "-o",
                              str(tmp_path / "x.yaml"), "--arrival", "bootstrap"])
    assert bad.exit_code == 2
    assert "needs strata of at least 2 blocks" in bad.output
    assert "Traceback" not in bad.output and not (tmp_path / "x.yaml").exists()
