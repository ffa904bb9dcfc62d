"""Small, hand-sized instances for the optimizer's tests (fluid model, MILP, CP-SAT,
loop): a step-time model with H200-like coefficients, a seeded synthetic workload, and
simulators whose answers are known."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servetune.models.fluid import ClassLoad, FluidModel, Knobs, LoadModel, Platform, Target
from servetune.profiles.steptime import StepTimeModel
from servetune.solvers.loop import SimPoint

STEP = StepTimeModel(
    fixed_s=1e-3,
    gemm_pieces=[(4e-3, 0.0), (0.0, 2.6e-5)],
    decode_attn_s_per_context_token=2.7e-8,
    decode_attn_s_per_seq=1e-5,
    prefill_attn_s_per_token_pair=1.3e-9,
    lm_head_s_per_row=3e-6,
)


def synthetic_load(n: int = 4000, seed: int = 0, rate: float = 5.0) -> LoadModel:
    rng = np.random.default_rng(seed)
    prompt = np.maximum(1, np.exp(rng.normal(np.log(800), 0.9, n))).astype(int)
    output = np.maximum(2, np.exp(rng.normal(np.log(150), 0.8, n))).astype(int)
    return LoadModel((ClassLoad.from_samples("default", 1.0, prompt, output),), rate)


def fluid(
    ttft_s: float | None = 2.0, tpot_s: float | None = 0.1, kv_blocks: int = 50_000,
    load: LoadModel | None = None,
) -> FluidModel:
    load = load or synthetic_load()
    return FluidModel(load, Platform(STEP, kv_blocks, 16),
                      {"default": Target(ttft_s=ttft_s, tpot_s=tpot_s, q=0.99)})


SMALL_SPACE = {
    "batching.max_num_seqs": [16, 64, 256],
    "batching.max_num_batched_tokens": [256, 1024, 4096],
    "batching.long_prefill_token_threshold": [0, 512],
    "admission.kv_watermark": [0.0, 0.05],
}


@dataclass
class ThresholdSim:
    """A simulator whose policy passes exactly below a known rate per knobs."""

    truth: dict[Knobs, float]  # knobs -> true goodput (req/s)
    base_rate_per_s: float = 5.0
    simulations: int = 0
    simulation_s: float = 0.0

    def run(self, policy, rate_scale: float) -> SimPoint:
        self.simulations += 1
        knobs = Knobs.from_policy(policy)
        rate = rate_scale * self.base_rate_per_s
        ok = rate <= self.truth.get(knobs, 0.0)
        return SimPoint(rate_scale, rate, ok, 1.0 if ok else 0.5, {})
