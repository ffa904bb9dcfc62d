"""Typed optimization conditions: keys, parsing, wording."""

from __future__ import annotations

import pytest

from servetune.conditions import Condition, Family

EVERY_CONDITION = [
    Condition(f, "chat") if f.per_class else Condition(f) for f in Family
]


@pytest.mark.parametrize("cond", EVERY_CONDITION, ids=lambda c: c.key)
def test_key_round_trips(cond):
    assert Condition.parse(cond.key) == cond
    assert str(cond) == cond.key


def test_keys_are_what_the_outputs_always_said():
    assert Condition(Family.TTFT, "chat").key == "ttft[chat]"
    assert Condition(Family.TPOT, "default").key == "tpot[default]"
    assert Condition(Family.E2E, "batch").key == "e2e[batch]"
    assert [Condition(f).key for f in Family if not f.per_class] == [
        "budget", "seats", "kv_memory", "queue", "queue_requests", "queue_prompt_tokens",
        "stability",
    ]
    assert Condition.parse("ttft[a[b]") == Condition(Family.TTFT, "a[b")


@pytest.mark.parametrize("key", ["kv_peak_tokens", "sample_window_s", "ttft", "ttft[chat",
                                 "budget[chat]", "TTFT[chat]", ""])
def test_parse_rejects_what_names_no_condition(key):
    with pytest.raises(ValueError):
        Condition.parse(key)


def test_a_per_class_family_needs_its_class_and_only_it():
    with pytest.raises(ValueError):
        Condition(Family.TPOT)
    with pytest.raises(ValueError):
        Condition(Family.SEATS, "chat")


def test_conditions_order_by_key():
    keys = ["tpot[a]", "budget", "ttft[b]", "kv_memory", "queue", "ttft[a]"]
    assert [c.key for c in sorted(Condition.parse(k) for k in keys)] == sorted(keys)


def test_family_of_an_slo_metric():
    assert [Family.of_metric(m) for m in ("ttft_s", "tpot_s", "e2e_s")] == [
        Family.TTFT, Family.TPOT, Family.E2E,
    ]


def test_only_budget_seats_and_kv_decide_stability():
    assert {c.key for c in EVERY_CONDITION if c.stability} == {"budget", "seats", "kv_memory"}


WORDS = {
    "budget": "the per-step token budget (demand must stay below max_num_batched_tokens)",
    "seats": "the running seats (max_num_seqs)",
    "kv_memory": "KV-cache memory",
    "queue": "the queue caps (shedding)",
    "queue_requests": "the cap on queued requests",
    "queue_prompt_tokens": "the cap on queued prompt tokens",
    "stability": "stability",
    "ttft[chat]": "the TTFT target of class 'chat'",
    "tpot[chat]": "the TPOT target of class 'chat'",
    "e2e[chat]": "e2e[chat]",
    "rejected[chat]": "the share of class 'chat' turned away (max_rejected_share)",
}


@pytest.mark.parametrize("cond", EVERY_CONDITION, ids=lambda c: c.key)
def test_words_for_each_family(cond):
    assert cond.words() == WORDS[cond.key]


FLOOR_SENTENCES = {
    "tpot[chat]": "TPOT cannot go below 12 ms on this GPU and model; target 10 ms",
    "ttft[chat]": "TTFT cannot go below 0.012 s on this GPU and model; target 0.01 s",
    "kv_memory": "the KV cache (0 tokens after the watermark) cannot hold even a few "
                 "requests (0 tokens needed)",
    "seats": "max_num_seqs is too small for even the lightest load",
    "budget": "budget cannot be met even at vanishing load",
    "e2e[chat]": "e2e[chat] cannot be met even at vanishing load",
}


@pytest.mark.parametrize("key", sorted(FLOOR_SENTENCES))
def test_floor_sentence_for_each_family(key):
    assert Condition.parse(key).floor_sentence(0.012, 0.01) == FLOOR_SENTENCES[key]


def test_advice_for_each_family():
    assert Condition.parse("tpot[c]").advice(0.0123) == [
        "raise the TPOT target to at least 12 ms",
        "use a faster GPU profile or tensor parallelism",
    ]
    assert Condition.parse("ttft[c]").advice(2.345) == [
        "raise the TTFT target to at least 2.35 s",
        "add larger max_num_batched_tokens values to the space",
        "use a faster GPU profile, or serve very long prompts elsewhere",
    ]
    assert Condition(Family.KV_MEMORY).advice(1.0) == [
        "use a GPU with more memory, an fp8 KV cache, or a lower kv_watermark"
    ]
    for family in (Family.BUDGET, Family.SEATS, Family.QUEUE_REQUESTS, Family.STABILITY):
        assert Condition(family).advice(1.0) == ["widen the search space"]


def test_simulated_floor_sentence_uses_milliseconds_for_tpot_only():
    assert Condition.parse("tpot[c]").simulated_floor_sentence(0.05, 0.03, 1.234) == (
        "TPOT stays at 50 ms or more in simulation, even at 1.23 req/s (target 30 ms); "
        "relax the TPOT target, widen the search space or use a faster GPU"
    )
    assert Condition.parse("ttft[c]").simulated_floor_sentence(2.6, 2.0, 0.25) == (
        "TTFT stays at 2.6 s or more in simulation, even at 0.25 req/s (target 2 s); "
        "relax the TTFT target, widen the search space or use a faster GPU"
    )
    assert Condition.parse("e2e[c]").simulated_floor_sentence(700.0, 600.0, 1.0).startswith(
        "E2E stays at 700 s or more"
    )
