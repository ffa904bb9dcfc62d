"""Prefix reuse: statistics from chain-hash block ids (hand-worked and on the Mooncake
trace), the fitted prefix_reuse model, and the ids a sampled trace gets from it."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import shared_file, workload_from_yaml_text
from hypothesis import given, settings
from hypothesis import strategies as st

from servetune.errors import ServetuneError
from servetune.schemas.workload import PrefixReuse
from servetune.workloads import fitting, prefixes
from servetune.workloads.fitting import fit_workload, sample_trace, workload_to_yaml
from servetune.workloads.formats import load_trace
from servetune.workloads.prefixes import assign_prefix_ids, fit_prefix_reuse, grow_sessions
from servetune.workloads.reuse import reuse_stats
from servetune.workloads.trace import Trace


def ids_of(trace: Trace) -> list[list[int]]:
    o, f = trace.prefix_offsets, trace.prefix_block_ids
    assert o is not None and f is not None
    return [f[o[i]:o[i + 1]].tolist() for i in range(len(trace))]


def trace_with_ids(rows: list[tuple[float, int, int, list[int]]], block_tokens: int) -> Trace:
    lengths = [len(r[3]) for r in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Trace(
        arrival_s=np.array([r[0] for r in rows], dtype=np.float64),
        prompt_tokens=np.array([r[1] for r in rows], dtype=np.int64),
        output_tokens=np.array([r[2] for r in rows], dtype=np.int64),
        prefix_offsets=offsets,
        prefix_block_ids=np.array([h for r in rows for h in r[3]], dtype=np.int64),
        prefix_block_tokens=block_tokens,
    )


# ------------------------------------------------------------------ statistics, by hand

# Blocks of 4 tokens, ids over the prompt. Session A: r0 (10 tokens: blocks 1, 2 and a
# partial 3), r2 re-sends r0's full blocks and grows by 3 tokens (13: 1, 2, 4, 5), r4
# repeats r2. r1 and r3 start sessions of their own that share a 2-block system prompt
# (10, 11): r3 shares 2 of r1's 4 blocks, fewer than all but its last, so it is no
# continuation of r1.
HAND = [
    (0.0, 10, 1, [1, 2, 3]),
    (1.0, 16, 1, [10, 11, 12, 13]),
    (5.0, 13, 1, [1, 2, 4, 5]),
    (6.0, 12, 1, [10, 11, 20]),
    (12.0, 13, 1, [1, 2, 4, 5]),
]


def test_hand_worked_sessions_and_system_prompt():
    s = reuse_stats(trace_with_ids(HAND, 4))
    assert (s.references, s.repeated) == (18, 8)  # r2: 1, 2; r3: 10, 11; r4: all 4
    assert s.reuse_ratio == pytest.approx(8 / 18)
    assert not s.covers_output
    assert s.lead_blocks.tolist() == [0, 0, 2, 2, 4]
    assert s.parent.tolist() == [-1, -1, 0, -1, 2]
    assert s.session.tolist() == [0, 1, 0, 2, 0]
    assert s.turns_per_session().tolist() == [3, 1, 1]
    assert s.think_time_s().tolist() == [5.0, 7.0]
    assert s.growth_tokens().tolist() == [3, 0]  # 13 - 10, 13 - 13
    assert s.system_prompt.tolist() == [-1, 0, -1, 0, -1]
    assert s.system_prompt_blocks.tolist() == [2]
    assert s.system_prompt_sessions.tolist() == [2]
    assert s.own_tokens().tolist() == [8, 4]  # 16 - 8, 12 - 8
    summary = s.summary()
    assert summary["sessions"] == 3 and summary["system_prompts"] == 1
    assert summary["continuing_share"] == pytest.approx(2 / 5)


def test_ids_over_prompt_and_output_are_detected():
    # 4-token blocks over prompt + output: ceil((6 + 3) / 4) = 3 ids, more than the
    # prompt's 2; the next turn (prompt 9 = 6 + 3) shares the 2 full blocks
    rows = [(0.0, 6, 3, [0, 1, 2]), (2.0, 9, 2, [0, 1, 3])]
    s = reuse_stats(trace_with_ids(rows, 4))
    assert s.covers_output
    assert s.parent.tolist() == [-1, 0]
    assert s.growth_tokens().tolist() == [0]  # 9 - (6 + 3): no new user text


def test_repeats_inside_one_request_count():
    s = reuse_stats(trace_with_ids([(0.0, 12, 1, [7, 7, 8])], 4))
    assert (s.references, s.repeated) == (3, 1)


def test_a_trace_without_ids_is_an_error():
    trace = Trace(arrival_s=np.array([0.0]), prompt_tokens=np.array([5]),
                  output_tokens=np.array([1]), source="t.csv")
    with pytest.raises(ServetuneError, match="t.csv: has no prefix block ids"):
        reuse_stats(trace)
    assert fit_prefix_reuse(trace) is None


# ------------------------------------------------------------------ sampling, by hand

def _knots(lo: float, hi: float) -> dict:
    return {"quantiles": [0.0, 1.0], "values": [lo, hi]}


def _session(after: list[float], extra: list[int], *, first_prompt: int = 64,
             left: float = 100.0) -> dict:
    """One donor session whose later turns each continue the one before."""
    return {"first_prompt_tokens": [first_prompt], "time_left_s": [left],
            "later_turns": [len(after)], "parent": list(range(-1, len(after) - 1)),
            "after_s": after, "extra_tokens": extra, "output_tokens": [7] * len(after)}


# one donor: a next turn every 10 s with the same prompt and 7 output tokens
SESSION = {"later_turn_share": [0.5]} | _session([10.0, 20.0, 30.0], [0, 0, 0])


def test_hand_worked_sampled_sessions():
    # two first turns: 64 tokens at 0 s, 200 at 3 s. Each replays the donor (later turns
    # 10, 20 and 30 s after it, the same prompt: extra 0 over a prompt-only cover, 7
    # output tokens) up to the end at 25 s: turns at 0, 10, 20 and 3, 13, 23. A next
    # turn re-sends its previous turn's whole blocks: 4 of 64 tokens, 12 of 200 (the 13th
    # block is partial, so it is new)
    model = PrefixReuse(block_tokens=16, sessions=SESSION)
    t, c, p, o, parent = grow_sessions(
        model, np.array([0.0, 3.0]), np.array([0, 1]), np.array([64, 200]),
        np.array([5, 5]), seed=0, rate_scale=1.0, end_s=25.0, max_prompt_tokens=1000)
    assert t.tolist() == [0.0, 3.0, 10.0, 13.0, 20.0, 23.0]
    assert p.tolist() == [64, 200, 64, 200, 64, 200]
    assert o.tolist() == [5, 5, 7, 7, 7, 7]
    assert c.tolist() == [0, 1, 0, 1, 0, 1]  # a later turn keeps its session's class
    assert parent.tolist() == [-1, -1, 0, 1, 2, 3]
    offsets, ids = assign_prefix_ids(model, t, p, o, parent, seed=0)
    got = [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(6)]
    second = list(range(4, 16))
    assert got == [[0, 1, 2, 3], list(range(4, 17)), [0, 1, 2, 3], second + [17],
                   [0, 1, 2, 3], second + [18]]
    # a rate scale of 2 by time: the same sessions in half the time; by sessions: the
    # first turns come twice as fast, the think times stay 10 s
    fast = grow_sessions(model, np.array([0.0, 1.5]), np.array([0, 1]), np.array([64, 200]),
                         np.array([5, 5]), seed=0, rate_scale=2.0, end_s=12.5,
                         max_prompt_tokens=1000)
    assert fast[0].tolist() == [0.0, 1.5, 5.0, 6.5, 10.0, 11.5]
    by_sessions = model.model_copy(update={"sessions": model.sessions.model_copy(
        update={"scale_by": "sessions"})})
    slow = grow_sessions(by_sessions, np.array([0.0, 1.5]), np.array([0, 1]),
                         np.array([64, 200]), np.array([5, 5]), seed=0, rate_scale=2.0,
                         end_s=12.5, max_prompt_tokens=1000)
    assert slow[0].tolist() == [0.0, 1.5, 10.0, 11.5]


def test_a_session_ends_with_its_cycle():
    # cycles of 15 s: a session started at 0 s has turns at 0 and 10 (20 is in the next
    # cycle), one started at 8 s has none after it (18 > 15). At twice the rate by time
    # (first turns at 0 and 4, think 5 s) the cycles are 7.5 s: turns at 0 and 5; by
    # sessions (think 10 s), the time left in the trace's seconds: until 15 and 4 + 7
    model = PrefixReuse(block_tokens=16, sessions=SESSION)
    first = (np.array([0, 0]), np.array([64, 64]), np.array([5, 5]))

    def times(m: PrefixReuse, arrival: list[float], scale: float) -> list[float]:
        return grow_sessions(m, np.array(arrival), *first, seed=0, rate_scale=scale,
                             end_s=100.0, max_prompt_tokens=1000, cycle_s=15.0)[0].tolist()

    assert times(model, [0.0, 8.0], 1.0) == [0.0, 8.0, 10.0]
    assert times(model, [0.0, 4.0], 2.0) == [0.0, 4.0, 5.0]
    by_sessions = model.model_copy(update={"sessions": model.sessions.model_copy(
        update={"scale_by": "sessions"})})
    assert times(by_sessions, [0.0, 4.0], 2.0) == [0.0, 4.0, 10.0]


def test_growth_is_capped_by_the_longest_prompt():
    # the donor grows by 100 tokens a turn over prompt and output: 64 + 5 + 100 = 169,
    # then 169 + 7 + 100 = 276 and 383, i.e. 100, 207 and 314 beyond the first turn's 69
    # covered tokens; capped at the longest prompt, 200
    model = PrefixReuse(block_tokens=16, covers_output=True, sessions={
        "later_turn_share": [0.5]} | _session([10.0, 20.0, 30.0], [100, 207, 314]))
    _, _, p, _, _ = grow_sessions(model, np.array([0.0]), np.array([0]), np.array([64]),
                                  np.array([5]), seed=0, rate_scale=1.0, end_s=35.0,
                                  max_prompt_tokens=200)
    assert p.tolist() == [64, 169, 200, 200]


def test_a_first_turn_takes_a_donor_watched_as_long_as_it():
    # seven donors of one band, watched 10, 20, ..., 70 s, each with one later turn whose
    # extra tokens name it (1..7); cycles of 100 s. A first turn with 25 s left (arrival
    # 75) draws among the five with the least time left of at least 25 s (30..70 s:
    # extras 3..7); one with 5 s left among 10..50 s; one with 65 s left (arrival 35)
    # takes the only one watched as long (70 s), and so does one with 100 s left
    # (arrival 0), for which none was: the one watched longest. 400 first turns each
    sessions = {"later_turn_share": [0.5], "first_prompt_tokens": [64] * 7,
                "time_left_s": [10.0 * i for i in range(1, 8)], "later_turns": [1] * 7,
                "parent": [-1] * 7, "after_s": [1.0] * 7,
                "extra_tokens": list(range(1, 8)), "output_tokens": [7] * 7}
    model = PrefixReuse(block_tokens=16, sessions=sessions)
    n = 400
    for arrival, allowed in ((75.0, {3, 4, 5, 6, 7}), (95.0, {1, 2, 3, 4, 5}),
                             (35.0, {7}), (0.0, {7})):
        _, _, p, _, parent = grow_sessions(
            model, np.full(n, arrival), np.zeros(n, np.int32), np.full(n, 64),
            np.full(n, 5), seed=0, rate_scale=1.0, end_s=1e9, max_prompt_tokens=1000,
            cycle_s=100.0)
        assert set((p[parent >= 0] - 64).tolist()) == allowed, arrival


def test_a_donor_watched_longer_is_drawn_in_by_the_exponent():
    # one donor watched 100 s, later turns 40 and 90 s after its first; a first turn with
    # 20 s left in its 100-s cycle (arrival 80). Exponent 0: both fall after the cycle's
    # end; 1: times x 20/100, at 8 and 18 s, both held; 0.5: x sqrt(0.2) = 0.447, at
    # 17.9 (held) and 40.2 s
    def times(exponent: float) -> list[float]:
        sessions = {"later_turn_share": [0.5], "time_left_exponent": exponent} | _session(
            [40.0, 90.0], [0, 0])
        model = PrefixReuse(block_tokens=16, sessions=sessions)
        t = grow_sessions(model, np.array([80.0]), np.array([0]), np.array([64]),
                          np.array([5]), seed=0, rate_scale=1.0, end_s=1e9,
                          max_prompt_tokens=1000, cycle_s=100.0)[0]
        return [round(x - 80.0, 3) for x in t[1:]]

    assert times(0.0) == []
    assert times(1.0) == [8.0, 18.0]
    assert times(0.5) == [round(40 * 0.2 ** 0.5, 3)]


def test_own_first_turns_with_one_donor_each_give_the_trace_back(monkeypatch, tmp_path):
    # with one neighbour, the trace's own first turns each draw their own session (the
    # one with exactly their time left): the sessions grown are the trace's, turn by turn
    from test_session_column import chat_rows, write_csv

    monkeypatch.setattr(prefixes, "DONOR_NEIGHBOURS", 1)
    trace = load_trace(write_csv(tmp_path / "chat.csv", chat_rows(200, seed=2)),
                       columns="arrival=ts,prompt=in,output=out,session=conv")
    model = fit_prefix_reuse(trace)
    stats = reuse_stats(trace)
    first = ~stats.continues
    start = float(trace.arrival_s[0])
    span = float(trace.arrival_s[-1]) - start
    t, _, p, o, parent = grow_sessions(
        model, trace.arrival_s[first] - start, np.zeros(int(first.sum()), np.int32),
        trace.prompt_tokens[first], trace.output_tokens[first], seed=3, rate_scale=1.0,
        end_s=span, max_prompt_tokens=int(trace.prompt_tokens.max()), cycle_s=span)
    assert np.allclose(t, trace.arrival_s - start, atol=2e-6)
    assert p.tolist() == trace.prompt_tokens.tolist()
    assert o.tolist() == trace.output_tokens.tolist()
    assert parent.tolist() == stats.parent.tolist()
    # and so they hold all the trace's later turns: the calibration leaves the exponent 0
    own = [(trace.arrival_s[first] - start, trace.prompt_tokens[first],
            trace.output_tokens[first])] * prefixes.CALIBRATION_SEEDS
    assert prefixes.later_turns_held(model, own, trace) == 1.0
    assert prefixes.calibrate(model, trace, own) == model


def test_no_sample_goes_above_the_bound():
    # the same sessions with a bound of 25%: the 2nd request is new (4 + 13 = 17
    # references, nothing repeated); the 3rd may repeat floor(0.25 * 21) = 5 > 4: all 4;
    # the 4th: floor(0.25 * 34) - 4 = 4 of its 12; the 5th: floor(0.25 * 38) - 8 = 1
    model = PrefixReuse(block_tokens=16, sessions=SESSION, trace_reuse_ratio=0.25)
    t, _, p, o, parent = grow_sessions(
        model, np.array([0.0, 3.0]), np.array([0, 0]), np.array([64, 200]),
        np.array([5, 5]), seed=0, rate_scale=1.0, end_s=25.0, max_prompt_tokens=1000)
    offsets, ids = assign_prefix_ids(model, t, p, o, parent, seed=0)
    got = [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(6)]
    assert got[2] == [0, 1, 2, 3]
    assert got[3] == [4, 5, 6, 7] + list(range(17, 26))
    assert got[4] == [0, 26, 27, 28]
    seen: set[int] = set()
    refs = repeated = 0
    for row in got:
        refs += len(row)
        repeated += sum(h in seen for h in row)
        seen |= set(row)
        assert repeated <= 0.25 * refs


def test_hand_worked_sampled_system_prompt():
    # one 32-token system prompt; own tokens 0..100 (1-99%: 1..99): prompts of 40 and 50
    # tokens start with it; 20 is too short for it, 300 leaves too many own tokens. In a
    # second cycle (cycle_s 10) the prompt gets new ids.
    model = PrefixReuse(block_tokens=16, system_prompts={
        "share": [1.0], "own_tokens": _knots(0, 100), "tokens": [32], "sessions": [1]})
    offsets, ids = assign_prefix_ids(
        model, np.array([0.0, 1.0, 2.0, 3.0, 15.0]), np.array([40, 50, 20, 300, 40]),
        np.array([1, 1, 1, 1, 1]), seed=0, cycle_s=10.0)
    got = [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(5)]
    assert got == [[0, 1, 2], [0, 1, 3, 4], [5, 6], list(range(7, 26)), [26, 27, 28]]


def test_ids_cover_the_output_when_the_model_says_so():
    model = PrefixReuse(block_tokens=16, covers_output=True)
    offsets, _ = assign_prefix_ids(model, np.array([0.0]), np.array([20]), np.array([13]),
                                   seed=0)
    assert offsets.tolist() == [0, 3]  # ceil(33 / 16)


# ------------------------------------------------------------------ the Mooncake trace

MOONCAKE = 0.6396  # README: 64.0% of 121,877 references repeat an earlier id


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    return load_trace(shared_file("traces", "mooncake_synthetic_trace.jsonl.gz"))


@pytest.fixture(scope="module")
def fitted(mooncake: Trace) -> dict[str, object]:
    return {ap: fit_workload(mooncake, arrival_process=ap) for ap in ("auto", "parametric")}


def test_mooncake_reuse_statistics(mooncake):
    s = reuse_stats(mooncake)
    assert s.references == 121_877
    assert round(100 * s.reuse_ratio, 1) == 64.0
    summary = s.summary()
    # the numbers the module docstring of servetune.workloads.reuse reports
    assert int(s.continues.sum()) == 1477 and summary["sessions"] == 2516
    assert summary["turns_max"] == 24 and summary["system_prompts"] == 143
    assert int((s.system_prompt >= 0).sum()) == 443
    assert not s.covers_output


@pytest.mark.parametrize("arrival", ["auto", "parametric"])
def test_mooncake_sample_reuse_within_10_percent(mooncake, fitted, arrival):
    # issue 31's target (the curves, every size, are in benchmarks/reuse_fidelity.py)
    workload = fitted[arrival]
    assert workload.prefix_reuse is not None
    assert workload.prefix_reuse.trace_reuse_ratio == pytest.approx(MOONCAKE, abs=1e-4)
    assert (workload.block_bootstrap is not None) == (arrival == "auto")
    ratios = []
    for seed in range(3):
        sample = sample_trace(workload, seed=seed, n_requests=len(mooncake))
        assert sample.prefix_block_tokens == 512
        ratios.append(reuse_stats(sample).reuse_ratio)
        assert ratios[-1] <= workload.prefix_reuse.trace_reuse_ratio
    # the mean of three: a few documents asked about again and again move one sample's
    # ratio by some 3 points
    assert np.mean(ratios) == pytest.approx(MOONCAKE, rel=0.1)


def test_mooncake_long_sample_keeps_the_ratio(mooncake, fitted):
    # three spans: the system prompts are made anew per span, so hits do not pile up
    sample = sample_trace(fitted["auto"], seed=0, duration_s=3 * mooncake.duration_s)
    assert len(sample) > 2.5 * len(mooncake)
    assert abs(reuse_stats(sample).reuse_ratio - MOONCAKE) < 0.03


def test_sampled_ids_deterministic_and_prefix_of_longer(fitted):
    workload = fitted["parametric"]
    a = sample_trace(workload, seed=4, n_requests=1500)
    b = sample_trace(workload, seed=4, n_requests=1500)
    longer = sample_trace(workload, seed=4, n_requests=3000)
    other = sample_trace(workload, seed=5, n_requests=1500)
    assert np.array_equal(a.prefix_offsets, b.prefix_offsets)
    assert np.array_equal(a.prefix_block_ids, b.prefix_block_ids)
    assert ids_of(longer)[:1500] == ids_of(a)
    assert ids_of(other) != ids_of(a)


@pytest.mark.parametrize("arrival", ["auto", "parametric"])
def test_sessions_keep_the_rate_and_the_length_mix(mooncake, fitted, arrival):
    # first turns at the classes' rate less the later turns' share, plus the later turns
    # the sessions make: together the trace's rate and prompt lengths (over four samples:
    # a few long sessions move one sample's tail). Parametric first turns of the long
    # documents come at any time, not early as in the trace, so they hold fewer later
    # turns; drawing the donors' turns in as far as the calibration allows (exponent 1)
    # leaves them 4% short
    samples = [sample_trace(fitted[arrival], seed=s, duration_s=mooncake.duration_s)
               for s in range(4)]
    assert np.mean([len(s) for s in samples]) == pytest.approx(
        len(mooncake), rel=0.03 if arrival == "auto" else 0.05)
    assert np.mean([s.prompt_tokens.mean() for s in samples]) == pytest.approx(
        mooncake.prompt_tokens.mean(), rel=0.05)
    for q in (90, 99):
        assert np.mean([np.percentile(s.prompt_tokens, q) for s in samples]) == pytest.approx(
            np.percentile(mooncake.prompt_tokens, q), rel=0.15), q


def test_rate_scale_keeps_the_sessions(fitted):
    # scaled by time (the default), a sample at twice the rate is the same requests in
    # half the time with the same ids: the hit-rate curve is the same at every load
    workload = fitted["auto"]
    one = sample_trace(workload, seed=1, n_requests=2000)
    two = sample_trace(workload, seed=1, n_requests=2000, rate_scale=2.0)
    assert np.allclose(two.arrival_s, one.arrival_s / 2.0)
    assert ids_of(two) == ids_of(one)
    # scaled by sessions: twice the sessions at once, each as slow as in the trace
    sessions = workload.prefix_reuse.sessions.model_copy(update={"scale_by": "sessions"})
    by_sessions = workload.model_copy(update={"prefix_reuse": workload.prefix_reuse.model_copy(
        update={"sessions": sessions})})
    three = sample_trace(by_sessions, seed=1, n_requests=2000, rate_scale=2.0)
    # (a sample of 2000 requests then spans half the time and sees fewer of the long think
    # times, so its median think time is below the trace's, but far above half of it)
    think_one = np.median(reuse_stats(one).think_time_s())
    think_two = np.median(reuse_stats(two).think_time_s())
    assert think_two == pytest.approx(think_one / 2, rel=1e-6)
    assert np.median(reuse_stats(three).think_time_s()) > 1.2 * think_two


def test_auto_replays_the_second_half_in_its_own_order(mooncake):
    # Mooncake's second half begins with the first half's documents open: parametric first
    # turns come at any time, and sessions replayed from them hold some 70% of its later
    # turns, so auto takes the bootstrap (rule 4 of servetune.workloads.fitting); the
    # first half's hold more than 85%, and it keeps the parametric fit
    half = len(mooncake) // 2
    first, second = mooncake.take(slice(0, half)), mooncake.take(slice(half, len(mooncake)))
    assert fit_workload(first).block_bootstrap is None
    assert fit_workload(second).block_bootstrap is not None
    parametric = fit_workload(second, arrival_process="parametric")
    model = parametric.prefix_reuse.model_copy(update={"sessions": parametric.prefix_reuse
                                                       .sessions.model_copy(update={
                                                           "time_left_exponent": 0.0})})
    held = prefixes.later_turns_held(
        model, fitting._first_turns(parametric, model, second.duration_s), second)
    assert 0.6 < held < 0.8
    # the calibration draws the donors' turns in until the samples hold the trace's
    assert parametric.prefix_reuse.sessions.time_left_exponent > 0.5


def test_fitted_yaml_round_trips(fitted):
    workload = fitted["auto"]
    text = workload_to_yaml(workload)
    again = workload_from_yaml_text(text, "mooncake.yaml")
    assert again.prefix_reuse == workload.prefix_reuse
    assert workload_to_yaml(again) == text


# ------------------------------------------------------------------ the schema

BASE = """apiVersion: servetune/v1
kind: Workload
classes:
  default:
    arrival: {rate_per_s: 1.0}
    prompt_tokens: {quantiles: [0, 1], values: [10, 100]}
    output_tokens: {quantiles: [0, 1], values: [1, 10]}
prefix_reuse:
"""
KNOTS = "{quantiles: [0, 1], values: [0, 5]}"
SESSIONS = ("first_prompt_tokens: [64], time_left_s: [30], later_turns: [1], parent: [-1], "
            "after_s: [5], extra_tokens: [3], output_tokens: [9]")


@pytest.mark.parametrize(("section", "words"), [
    (f"  sessions: {{later_turn_share: [1.5], {SESSIONS}}}",
     "prefix_reuse.sessions.later_turn_share: entry 0 is 1.5; a share must be"),
    (f"  prompt_band_edges: [50]\n  sessions: {{later_turn_share: [0.5], {SESSIONS}}}",
     "sessions.later_turn_share has 1 entries but prompt_band_edges makes 2 bands"),
    (f"  sessions: {{later_turn_share: [0.5], scale_by: users, {SESSIONS}}}",
     "prefix_reuse.sessions.scale_by"),
    ("  prompt_band_edges: [50, 20]", "prompt_band_edges must be finite and strictly"),
    (f"  system_prompts: {{share: [1], own_tokens: {KNOTS}, tokens: [700], sessions: [2]}}",
     "system_prompts.tokens[0] is 700; a system prompt is a whole number of blocks"),
    (f"  system_prompts: {{share: [1], own_tokens: {KNOTS}, tokens: [512], sessions: [0]}}",
     "sessions[0] is 0; popularity must be >= 1"),
    (f"  system_prompts: {{share: [1], own_tokens: {KNOTS}, tokens: [512], sessions: [1, 2]}}",
     "tokens has 1 entries but sessions has 2"),
    (f"  sessions: {{later_turn_share: [1], {SESSIONS.replace('after_s: [5]', 'after_s: [-1]')}}}",
     "prefix_reuse.sessions: after_s[0] is -1.0; a later turn comes after its parent"),
    (f"  sessions: {{later_turn_share: [1], {SESSIONS.replace('parent: [-1]', 'parent: [0]')}}}",
     "parent[0] is 0; it must be -1 or an earlier later turn of the same session"),
    (f"  sessions: {{later_turn_share: [1], "
     f"{SESSIONS.replace('later_turns: [1]', 'later_turns: [2]')}}}",
     "parent has 1 entries but later_turns adds up to 2; give one per later turn"),
    ("  block_tokens: 0", "block_tokens"),
])
def test_bad_prefix_section_is_one_clear_line(section, words):
    with pytest.raises(ServetuneError) as err:
        workload_from_yaml_text(BASE + section + "\n", "w.yaml")
    text = str(err.value)
    assert "\n" not in text and text.startswith("w.yaml: ")
    assert words in text


@st.composite
def donor_sessions(draw: st.DrawFn) -> dict:
    """One to six donor sessions of up to five later turns, each continuing the first turn
    or an earlier later turn, with any times and growth."""
    out: dict[str, list] = {k: [] for k in (
        "first_prompt_tokens", "time_left_s", "later_turns", "parent", "after_s",
        "extra_tokens", "output_tokens")}
    for _ in range(draw(st.integers(1, 6))):
        turns = draw(st.integers(0, 5))
        out["first_prompt_tokens"].append(draw(st.integers(1, 300)))
        out["time_left_s"].append(draw(st.floats(0, 80)))
        out["later_turns"].append(turns)
        after: list[float] = []
        for k in range(turns):
            parent = draw(st.integers(-1, k - 1))
            out["parent"].append(parent)
            after.append((after[parent] if parent >= 0 else 0.0) + draw(st.floats(0, 20)))
            out["extra_tokens"].append(draw(st.integers(-50, 200)))
            out["output_tokens"].append(draw(st.integers(1, 30)))
        out["after_s"] += after
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 50), st.integers(1, 300), st.integers(1, 50)),
                min_size=1, max_size=60),
       st.floats(0, 1), donor_sessions(), st.floats(0, 1), st.booleans(), st.integers(0, 3),
       st.one_of(st.none(), st.floats(0, 1)), st.one_of(st.none(), st.floats(1, 60)))
def test_sampled_ids_are_chain_ids(rows, later, donors, with_prompt, covers_output, seed,
                                   bound, cycle):
    """Any first turns, donor sessions, shares, cycle and bound: sessions keep time order
    and put each turn after its previous one; each request gets ceil(covered / B) ids; an
    id always sits at the same position after the same id (a chain hash); a request shares
    at most the whole blocks of its prompt with earlier ones; repeated references never
    exceed the bound at any point."""
    rows.sort()
    t, p, o = (np.array(c) for c in zip(*rows, strict=True))
    model = PrefixReuse(
        block_tokens=16, covers_output=covers_output, prompt_band_edges=[100.0],
        sessions={"later_turn_share": [later, 1 - later]} | donors,
        system_prompts={"share": [with_prompt, with_prompt], "own_tokens": _knots(1, 200),
                        "tokens": [16, 48, 96], "sessions": [1, 3, 2]},
        trace_reuse_ratio=bound)
    t, c, p, o, parent = grow_sessions(model, t.astype(float), np.zeros(len(t), np.int32),
                                       p, o, seed=seed, rate_scale=1.0, end_s=80.0,
                                       max_prompt_tokens=400, cycle_s=cycle)
    assert np.all(np.diff(t) >= 0) and np.all(parent < np.arange(len(t)))
    assert np.all(p <= 400) and np.all(p >= 1)
    offsets, ids = assign_prefix_ids(model, t, p, o, parent, seed=seed)
    again = assign_prefix_ids(model, t, p, o, parent, seed=seed)
    assert np.array_equal(ids, again[1])
    covered = p + (o if covers_output else 0)
    assert np.diff(offsets).tolist() == (-(-covered // 16)).tolist()
    place: dict[int, tuple[int, int]] = {}
    seen: set[int] = set()
    refs = repeated = 0
    for j in range(len(t)):
        row = ids[offsets[j]:offsets[j + 1]].tolist()
        for m, h in enumerate(row):
            assert place.setdefault(h, (m, row[m - 1] if m else -1)) == (
                m, row[m - 1] if m else -1)
        lead = next((m for m, h in enumerate(row) if h not in seen), len(row))
        assert lead <= p[j] // 16
        refs += len(row)
        repeated += sum(h in seen for h in row)
        seen |= set(row)
        if bound is not None:
            assert repeated <= bound * refs + 1e-9
