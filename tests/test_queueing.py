"""Queueing-theory oracles for the engine.

With one sequence at a time (``max_num_seqs = 1``), a constant step time ``c`` and a
prompt that fits one step's token budget, a request is served in ``output_tokens`` steps
(one prefill step that samples the first token, then one decode step per further token),
so the engine is a single FIFO server with service time ``S = output_tokens * c``. A
request is admitted at the first step start at or after its arrival when the seat is free:
its arrival if the engine is idle, else the finish of the request before it. So its
queueing wait (admission - arrival) is exactly Lindley's recursion
``W_n = max(0, W_{n-1} + S_{n-1} - (a_n - a_{n-1}))``, and with Poisson arrivals its mean
is the Pollaczek-Khinchine formula ``Wq = lambda E[S^2] / (2 (1 - rho))``:

- M/D/1: every output has the same length, ``Wq = rho S / (2 (1 - rho))``;
- M/M/1: geometric output lengths with mean 100 approximate exponential service; their
  second-moment ratio is ``2 - 1/100``, so the M/M/1 closed form ``Wq = rho E[S] / (1 - rho)``
  is 0.5% off the exact M/G/1 value; both are checked within 2%.

The formulas are evaluated at the sample's own arrival rate and service moments (a control
variate: it removes the part of the noise due to the realized load, about a third of the
variance at rho = 0.8), and the
mean wait must agree within 2%. The sizes are chosen from the estimator's spread, measured
over 20 seeds with the Lindley recursion: its standard deviation is 0.4-0.5% for M/D/1 at
500,000 requests (rho 0.5) and 2,000,000 (rho 0.8), and for M/M/1 at 1,000,000 (rho 0.5)
and 3,000,000 (rho 0.8; marked slow: 300 million engine steps), so 2% is a margin of about
four standard deviations (a little less against the M/M/1 closed form, which carries the
0.5% discretisation offset). The seeds are fixed, so the test is deterministic. The
engine's waits must also equal Lindley's recursion request by request (float rounding of
the clock aside).
"""

from __future__ import annotations

import numpy as np
import pytest

from servetune.profiles.schema import Profile
from servetune.schemas.policy import Policy
from servetune.sim import simulate
from servetune.workloads.trace import from_arrays

STEP_S = 0.001
PROMPT = 16
MD1_OUTPUT = 8
MM1_MEAN_OUTPUT = 100


def lindley_waits(arrival_s: np.ndarray, service_s: np.ndarray) -> np.ndarray:
    """FIFO single-server waits, vectorized: W_n = P_n - min_{k<=n} P_k with P the running
    sum of S_{k-1} - (a_k - a_{k-1}) (P_0 = 0)."""
    steps = np.concatenate([[0.0], service_s[:-1] - np.diff(arrival_s)])
    running = np.cumsum(steps)
    return running - np.minimum.accumulate(running)


def single_server_run(arrival_s: np.ndarray, output_tokens: np.ndarray):
    n = len(arrival_s)
    trace = from_arrays(arrival_s, np.full(n, PROMPT), output_tokens)
    policy = Policy(name="one-at-a-time",
                    batching={"max_num_seqs": 1, "max_num_batched_tokens": 256})
    blocks = int((PROMPT + output_tokens.max()) // 16 + 4)
    profile = Profile(name="constant-step", memory={"kv_blocks_override": blocks},
                      step_time={"constant_s": STEP_S})
    result = simulate(trace, policy, profile)
    out = result.output
    assert (np.asarray(out.status) == 0).all()
    return trace, out


def poisson_arrivals(rng: np.random.Generator, rate_per_s: float, n: int) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate_per_s, n - 1))])


def check_against_formula(arrival_s, output_tokens, kind: str) -> None:
    trace, out = single_server_run(arrival_s, output_tokens)
    service = output_tokens * STEP_S
    wait = np.asarray(out.admitted_s) - trace.arrival_s
    # Exact: the engine is Lindley's FIFO server (float rounding only).
    # The clock sums step times one by one; over ~1e5-1e6 simulated seconds its rounding
    # reaches microseconds, still a thousandth of a step.
    clock_atol = 1e-11 * max(1.0, float(trace.arrival_s[-1])) * 10 + 1e-9
    np.testing.assert_allclose(wait, lindley_waits(trace.arrival_s, service), rtol=0,
                               atol=clock_atol)
    np.testing.assert_allclose(np.asarray(out.finish_s) - np.asarray(out.admitted_s), service,
                               rtol=0, atol=clock_atol)
    np.testing.assert_allclose(np.asarray(out.first_token_s) - np.asarray(out.admitted_s),
                               STEP_S, rtol=0, atol=clock_atol)
    # Oracle: Pollaczek-Khinchine at the sample's rate and service moments.
    n = len(trace)
    rate = (n - 1) / trace.arrival_s[-1]
    mean_s = service.mean()
    rho = rate * mean_s
    pollaczek_khinchine = rate * np.mean(service**2) / (2 * (1 - rho))
    assert wait.mean() == pytest.approx(pollaczek_khinchine, rel=0.02), (kind, rho)
    if kind == "M/D/1":
        closed_form = rho * mean_s / (2 * (1 - rho))
    else:
        closed_form = rho * mean_s / (1 - rho)
    assert wait.mean() == pytest.approx(closed_form, rel=0.02), (kind, rho, wait.mean())


@pytest.mark.parametrize("load,n", [(0.5, 500_000), (0.8, 2_000_000)])
def test_md1_pollaczek_khinchine(load, n):
    rng = np.random.default_rng(20261201)
    service_s = MD1_OUTPUT * STEP_S
    arrival = poisson_arrivals(rng, load / service_s, n)
    check_against_formula(arrival, np.full(n, MD1_OUTPUT), "M/D/1")


@pytest.mark.parametrize(
    "load,n", [(0.5, 1_000_000), pytest.param(0.8, 3_000_000, marks=pytest.mark.slow)]
)
def test_mm1_geometric_outputs(load, n):
    rng = np.random.default_rng(20261202)
    output = rng.geometric(1.0 / MM1_MEAN_OUTPUT, n)
    arrival = poisson_arrivals(rng, load / (MM1_MEAN_OUTPUT * STEP_S), n)
    check_against_formula(arrival, output, "M/M/1")


def test_lindley_helper_by_hand():
    # Arrivals 0, 1, 1.5, 10; services 2, 2, 1, 1: waits 0, 1, 2.5, 0.
    waits = lindley_waits(np.array([0.0, 1.0, 1.5, 10.0]), np.array([2.0, 2.0, 1.0, 1.0]))
    np.testing.assert_allclose(waits, [0.0, 1.0, 2.5, 0.0])
