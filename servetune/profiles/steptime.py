"""Step-time model: seconds for one engine step from its contents.

A step (one forward pass of a continuous-batching engine) is summarised by five numbers:

- ``T``  tokens computed in the step (prefill chunk tokens + one per decoding sequence),
- ``S``  rows sampled by the LM head (decoding sequences + prefills that finish this step),
- ``D``  decoding sequences,
- ``C``  total context those decoding sequences attend to (KV tokens read),
- ``W``  prefill attention work: the sum over prefill chunks of ``chunk * (prefix + chunk/2)``
  (a causal chunk of ``chunk`` new tokens after ``prefix`` cached ones).

The model (all coefficients in seconds)::

    t(T, S, D, C, W) = fixed_s
                     + max_k (gemm_intercept_s[k] + gemm_slope_s_per_token[k] * T)
                     + allreduce_s_per_token * T
                     + decode_attn_s_per_context_token * C + decode_attn_s_per_seq * D
                     + prefill_attn_s_per_token_pair * W
                     + lm_head_s_per_row * S
                     + host_step_exposed + host_s_per_seq * S

The first seven terms are GPU time (what a CUDA-graph replay of the step measures). The
last two are the serving engine's host-side work, which a graph replay does not see: a
part per sequence that produces a token this step (``S``: sampling and logits processing
outside the graph and the per-request bookkeeping between two forward passes; a prefill
chunk that does not finish produces no output) and a part per step (scheduling, input
preparation, returning outputs). An engine that overlaps the per-step part with the GPU
(``host_overlap``; vLLM V1 with async scheduling) prepares the next step while this one
runs, so a step pays only what the GPU does not cover: ``host_step_exposed = max(0,
host_s_per_step - g_min)``, with ``g_min`` the profile's smallest GPU step (one sequence,
one token; every step takes at least that long, so this never undercharges); without
overlap ``host_step_exposed = host_s_per_step``. The three fields are ``None`` unless a
profile pins them (timed on its own host, fitted by ``servetune validate --calibrate``,
or 0 for a GPU-only what-if); ``None`` takes the engine's default from
:data:`servetune.engines.ENGINES` when the step time is evaluated for an engine
(:meth:`StepTimeModel.as_arrays`), so one GPU profile serves every engine and an engine
build (say, an older vLLM that does not overlap) is selected by pinning them. They are
kept apart from ``fixed_s`` (GPU launch and in-graph overhead) so the provenance of each
stays clear.

``gpu_time_scale`` (1 by default, and then not written to the file) multiplies the seven GPU
terms: a compute-efficiency correction fitted by ``servetune validate --calibrate`` when a
replay of a real benchmark run shows the GPU part of the steps slower (or faster) than the
timings the profile was fitted from.

The GEMM term is convex piecewise-linear in ``T``: its first piece is the floor of reading
all weights from HBM once (flat at small batch), later pieces the compute-bound growth.
A profile may instead fix ``constant_s`` (a constant step time for what-if replays).

Evaluation is a few multiply-adds; :func:`step_seconds` is numba-compilable and the
simulator's hot loop calls it with :meth:`StepTimeModel.as_arrays`.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from servetune.engines import host_overhead
from servetune.schemas.base import Strict

# Layout of the scalar coefficient vector handed to compiled code.
COEF_FIXED = 0
COEF_ALLREDUCE = 1
COEF_DECODE_CTX = 2
COEF_DECODE_SEQ = 3
COEF_PREFILL_PAIR = 4
COEF_LM_ROW = 5
COEF_CONSTANT = 6  # < 0 means "not constant"
COEF_HOST_STEP = 7
COEF_HOST_SEQ = 8
N_COEF = 9

# A per-step or per-sequence host cost of a second or more is a unit slip (ms given as s).
HOST_LIMIT_S = 1.0


class StepTimeModel(Strict):
    constant_s: float | None = Field(
        None, gt=0, description="if set, every step takes exactly this long"
    )
    fixed_s: float = Field(0.0, ge=0, description="per-step fixed cost (launch, sampling, CPU)")
    gemm_pieces: list[tuple[float, float]] = Field(
        default_factory=lambda: [(0.0, 0.0)],
        min_length=1,
        description="[[intercept_s, slope_s_per_token], ...]; GEMM time = max over pieces",
    )
    allreduce_s_per_token: float = Field(0.0, ge=0, description="TP all-reduce per token")
    decode_attn_s_per_context_token: float = Field(0.0, ge=0)
    decode_attn_s_per_seq: float = Field(0.0, ge=0)
    prefill_attn_s_per_token_pair: float = Field(0.0, ge=0)
    lm_head_s_per_row: float = Field(0.0, ge=0)
    host_s_per_step: float | None = Field(
        None, ge=0, lt=HOST_LIMIT_S,
        description="engine host work per step (scheduling, input preparation, output "
                    "processing), s; null = the engine's default (servetune.engines)",
    )
    host_s_per_seq: float | None = Field(
        None, ge=0, lt=HOST_LIMIT_S,
        description="engine host work per sequence that produces a token in the step, s; "
                    "null = the engine's default (servetune.engines)",
    )
    host_overlap: bool | None = Field(
        None,
        description="whether the engine overlaps its per-step host work with the GPU step "
                    "(vLLM V1 with async scheduling does; older builds do not); null = the "
                    "engine's default (servetune.engines)",
    )

    gpu_time_scale: float = Field(
        1.0, gt=0, le=100,
        description="multiplies every GPU term (fixed_s, GEMM, all-reduce, attention, LM "
                    "head), not the host terms nor constant_s; 1 unless a replay of a real "
                    "run corrected it (servetune validate --calibrate)",
    )

    @model_serializer(mode="wrap")
    def _omit_unit_scale(self, handler: SerializerFunctionWrapHandler) -> dict:
        # a profile that was never corrected keeps its file as it was (no scale line)
        data = handler(self)
        if isinstance(data, dict) and data.get("gpu_time_scale") == 1.0:
            data.pop("gpu_time_scale")
        return data

    @model_validator(mode="after")
    def _nonnegative_pieces(self) -> StepTimeModel:
        for i, (intercept, slope) in enumerate(self.gemm_pieces):
            if intercept < 0 or slope < 0:
                raise ValueError(f"gemm_pieces[{i}]: intercept and slope must be >= 0")
        return self

    def host_seconds(self, engine: str = "vllm") -> tuple[float, float, bool]:
        """(per step, per sequence, overlap) of the host work: the profile's own where it
        pins them, else engine ``engine``'s defaults."""
        row = host_overhead(engine)
        return (row.per_step_s if self.host_s_per_step is None else self.host_s_per_step,
                row.per_seq_s if self.host_s_per_seq is None else self.host_s_per_seq,
                row.overlap if self.host_overlap is None else self.host_overlap)

    def gpu_only(self) -> StepTimeModel:
        """The same model with no host cost (GPU time only, as graph replays measure)."""
        return self.model_copy(update={"host_s_per_step": 0.0, "host_s_per_seq": 0.0})

    def as_arrays(self, engine: str = "vllm") -> tuple[np.ndarray, np.ndarray]:
        """(coefficients[N_COEF], pieces[k, 2]) for :func:`step_seconds`, host costs
        resolved for ``engine`` (:meth:`host_seconds`) and the GPU terms multiplied by
        ``gpu_time_scale`` here, so the kernel and the fluid model see it without a term of
        their own."""
        g = self.gpu_time_scale
        coef = np.zeros(N_COEF, dtype=np.float64)
        coef[COEF_FIXED] = g * self.fixed_s
        coef[COEF_ALLREDUCE] = g * self.allreduce_s_per_token
        coef[COEF_DECODE_CTX] = g * self.decode_attn_s_per_context_token
        coef[COEF_DECODE_SEQ] = g * self.decode_attn_s_per_seq
        coef[COEF_PREFILL_PAIR] = g * self.prefill_attn_s_per_token_pair
        coef[COEF_LM_ROW] = g * self.lm_head_s_per_row
        coef[COEF_CONSTANT] = self.constant_s if self.constant_s is not None else -1.0
        pieces = g * np.asarray(self.gemm_pieces, dtype=np.float64).reshape(-1, 2)
        host_step, host_seq, overlap = self.host_seconds(engine)
        if overlap:  # hidden under the GPU step, up to the smallest one (coef: GPU only)
            host_step = max(0.0, host_step - step_seconds(coef, pieces, 1.0, 1.0, 1.0, 1.0, 0.0))
        coef[COEF_HOST_STEP], coef[COEF_HOST_SEQ] = host_step, host_seq
        return coef, pieces

    def seconds(
        self,
        tokens: float,
        sampled_rows: float,
        decode_seqs: float,
        decode_context_tokens: float,
        prefill_attn_pairs: float,
        engine: str = "vllm",
    ) -> float:
        """Seconds for one step under ``engine`` (pure Python; see the module docstring for
        the symbols)."""
        coef, pieces = self.as_arrays(engine)
        return step_seconds(
            coef, pieces, tokens, sampled_rows, decode_seqs, decode_context_tokens,
            prefill_attn_pairs,
        )


def step_seconds(
    coef: np.ndarray,
    pieces: np.ndarray,
    tokens: float,
    sampled_rows: float,
    decode_seqs: float,
    decode_context_tokens: float,
    prefill_attn_pairs: float,
) -> float:
    """t(T, S, D, C, W) from the coefficient arrays (plain Python, numba-compilable)."""
    if coef[COEF_CONSTANT] > 0.0:
        return coef[COEF_CONSTANT]
    gemm = pieces[0, 0] + pieces[0, 1] * tokens
    for k in range(1, pieces.shape[0]):
        value = pieces[k, 0] + pieces[k, 1] * tokens
        if value > gemm:
            gemm = value
    return (
        coef[COEF_FIXED]
        + gemm
        + coef[COEF_ALLREDUCE] * tokens
        + coef[COEF_DECODE_CTX] * decode_context_tokens
        + coef[COEF_DECODE_SEQ] * decode_seqs
        + coef[COEF_PREFILL_PAIR] * prefill_attn_pairs
        + coef[COEF_LM_ROW] * sampled_rows
        + coef[COEF_HOST_STEP]
        + coef[COEF_HOST_SEQ] * sampled_rows
    )


def prefill_attn_pairs(chunk_tokens: float, prefix_tokens: float) -> float:
    """W contribution of one prefill chunk: chunk * (prefix + chunk / 2)."""
    return chunk_tokens * (prefix_tokens + chunk_tokens / 2.0)
