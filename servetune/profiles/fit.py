"""Fitting a profile's step-time model from per-operation and whole-step GPU timings.

The method, per layer of a model (all times in seconds, ``m(.)`` a measured per-op time):

1. **Per-operation curves.** Each GEMM ``op`` of a layer (qkv, o, gate_up, down) gives a
   table ``m_op(T)``; a GEMM on fewer rows is never slower than on more (it could be
   padded), so noise is removed by taking the lower envelope from the right. Decode
   attention is ``c_ctx * context_tokens + c_seq * seqs``, prefill attention
   ``w * pairs`` (a causal chunk of C after P cached tokens does C*(P + C/2) query-key
   pairs; the unmasked ``chunk_prefix`` rows do C*(P+C)); elementwise work is
   ``e * T`` (fitted where it is bandwidth-bound, above its CPU-dispatch plateau).
   The LM head (plus argmax) is its own table ``m_lm(S)`` over sampled rows.

2. **Launch-floor correction.** Each operation timed on its own pays a launch/timing
   floor that a CUDA-graph step does not (the README's 20-30 us). Standalone tables
   therefore overstate small kernels and cannot show the true small-batch cost of a GEMM,
   which is reading its weights. The graph-equivalent per-layer token term is

       G(T) = alpha * sum_op max(m_op(T) - phi, weight_bytes_op / B_gemv) + e * T

   and the step adds ``psi`` per layer for the small kernels of a layer that no per-op
   file times (splits, concatenations, rotary, residual adds inside the graph). Attention
   slopes come from affine fits of the rows clear of the floor (the intercept is the
   floor and is dropped) and are not scaled (they stream KV from HBM either way). The
   four constants (``phi`` launch floor, ``B_gemv`` weight-streaming
   bandwidth of small-batch GEMMs, ``alpha`` graph/standalone ratio of GEMM time, ``psi``
   per-layer in-graph overhead) describe the GPU and the timing method, not the model:
   they are learned once from a whole-step file and applied unchanged to any model
   measured the same way; this is how the Qwen2.5-32B profile is fitted from per-op rows
   only. ``phi`` is measured, not fitted: the median of the ten smallest GEMM and
   decode-attention timings (operations too small to take longer than the floor).
   ``B_gemv`` is searched within 85-100% of what standalone large-weight GEMMs at <= 16
   tokens demonstrate (bytes / (ms - phi), capped at the datasheet bandwidth), because
   weight streaming and per-layer overhead are both constant at small batch and one
   model's steps cannot tell them apart, while they scale differently to a bigger model;
   ``alpha`` and ``psi >= 0`` come from least squares of relative error; the score that
   picks ``B_gemv`` is median + max/4 of the relative errors.

3. **Step-time model** (:mod:`servetune.profiles.steptime`):
   ``gemm_pieces`` is a convex piecewise-linear fit of ``L * G(T)`` over T in [1, 8192]
   (an LP in HiGHS minimising max + mean relative error over a hinge basis with
   non-negative kinks, so the result is convex and every piece's intercept >= 0);
   ``decode_attn_*`` and ``prefill_attn_*`` are ``L`` times the per-layer terms;
   the LM head is ``a + b * S`` fitted the same way, ``a`` going to ``fixed_s`` together
   with ``L * psi``; for TP > 1, two all-reduces per layer of ``hidden`` values per token
   over the interconnect (ring: 2(TP-1)/TP of the bytes) give ``allreduce_s_per_token``
   and their latency goes to ``fixed_s``.

Derived profiles (:func:`derive_step_time`) reuse the measured per-op curves with each
term scaled by the ratio of datasheet figures: compute-bound GEMM and prefill-attention
time by peak FLOP/s, weight streaming, KV reads and elementwise work by memory bandwidth,
and by the ratio of FLOPs or bytes between the measured and the target shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from servetune.errors import ServetuneError
from servetune.profiles import memory
from servetune.profiles.lp import solve_lp
from servetune.profiles.measurements import (
    GEMM_OPS,
    STEP_COLUMNS,
    Measurements,
    StepRow,
    read_csv,
    step_rows,
)
from servetune.profiles.schema import Hardware, ModelArch, Profile
from servetune.profiles.steptime import StepTimeModel

# Interconnect assumptions for the TP all-reduce term (stated in every TP>1 profile).
ALLREDUCE_EFFICIENCY = 0.7  # achieved share of per-direction NVLink bandwidth (NCCL busbw)
ALLREDUCE_LATENCY_S = 10e-6  # per all-reduce inside a CUDA graph (small messages)

S_GRID = np.array([1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024], float)


# --------------------------------------------------------------------------------------
# per-operation curves
# --------------------------------------------------------------------------------------
def _interp(xs: np.ndarray, ys: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Piecewise-linear interpolation, flat below the table, linear extrapolation above."""
    x = np.asarray(x, dtype=float)
    out = np.interp(x, xs, ys)
    if len(xs) >= 2:
        hi = x > xs[-1]
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        out = np.where(hi, ys[-1] + (x - xs[-1]) * max(slope, 0.0), out)
    return out


def _lower_envelope_from_right(ys: np.ndarray) -> np.ndarray:
    return np.minimum.accumulate(ys[::-1])[::-1]


@dataclass
class OpCurve:
    tokens: np.ndarray
    seconds: np.ndarray  # measured standalone, envelope-smoothed
    weight_bytes: float
    flops_per_token: float

    def graph_seconds(self, tokens: np.ndarray, corr: GraphCorrection) -> np.ndarray:
        kernel = _interp(self.tokens, self.seconds, tokens) - corr.launch_floor_s
        return np.maximum(kernel, self.weight_bytes / corr.gemv_bandwidth_Bps)


@dataclass
class PerOpModel:
    """One layer's operations of one model as measured, in seconds (attention slopes from
    affine fits whose intercept, the timing floor, is dropped; GEMM and LM-head tables
    as measured, ``launch_floor_s`` subtracted when they are evaluated)."""

    rows_name: str
    layers: int
    launch_floor_s: float
    gemm: dict[str, OpCurve]
    elementwise_s_per_token: float
    decode_s_per_context_token: float
    decode_s_per_seq: float
    prefill_s_per_pair: float
    lm_tokens: np.ndarray
    lm_seconds: np.ndarray
    lm_weight_bytes: float
    kv_read_Bps: float = 0.0  # KV read bandwidth decode attention is charged at
    files: list[Path] = field(default_factory=list)

    def token_term(self, tokens: np.ndarray, corr: GraphCorrection) -> np.ndarray:
        """Graph-equivalent seconds of the token-linear work of one layer, G(T)."""
        t = np.asarray(tokens, dtype=float)
        gemm = sum(op.graph_seconds(t, corr) for op in self.gemm.values())
        return corr.gemm_scale * gemm + self.elementwise_s_per_token * t

    def lm_head(self, rows: np.ndarray, corr: GraphCorrection) -> np.ndarray:
        kernel = _interp(self.lm_tokens, self.lm_seconds, rows) - corr.launch_floor_s
        return np.maximum(kernel, self.lm_weight_bytes / corr.gemv_bandwidth_Bps)


def _relative_ls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of relative error: min sum ((x @ c - y) / y)^2."""
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    return coef


def build_perop(meas: Measurements, rows_name: str, arch: ModelArch, tensor_parallel: int,
                launch_floor_s: float) -> PerOpModel:
    """Per-layer operation model of ``rows_name``'s rows (a model, or a TP shard)."""
    meas.require_model(rows_name)
    tp = tensor_parallel
    lin = meas.tables["linear.csv"]
    gemm: dict[str, OpCurve] = {}
    for op in GEMM_OPS:
        pts: dict[int, tuple[float, float, float]] = {}
        for i in lin.for_model(rows_name):
            row = lin.rows[i]
            if row["op"].strip() != op or row["dtype"].strip() != arch.dtype:
                continue
            t = int(lin.number(i, "tokens", integer=True))
            k = lin.number(i, "k", integer=True)
            n = lin.number(i, "n", integer=True)
            pts[t] = (lin.number(i, "ms") * 1e-3, k, n)
        if len(pts) < 2:
            raise ServetuneError(
                f"{lin.path}: needs at least 2 rows with op {op!r}, dtype {arch.dtype!r} for "
                f"model {rows_name!r} in columns 'op'/'dtype' (found {len(pts)})"
            )
        tokens = np.array(sorted(pts), dtype=float)
        secs = np.array([pts[int(t)][0] for t in tokens])
        k, n = pts[int(tokens[-1])][1], pts[int(tokens[-1])][2]
        gemm[op] = OpCurve(tokens, _lower_envelope_from_right(secs),
                           weight_bytes=k * n * 2.0 if arch.dtype != "fp8" else k * n,
                           flops_per_token=2.0 * k * n)
    phi = launch_floor_s

    # elementwise: bandwidth-bound above its CPU-dispatch plateau
    el = meas.tables["elementwise.csv"]
    el_pts = sorted((el.number(i, "tokens", integer=True), el.number(i, "ms") * 1e-3)
                    for i in el.for_model(rows_name))
    plateau = min(s for _, s in el_pts)
    big = [(t, s) for t, s in el_pts if s >= 3 * plateau] or el_pts[-3:]
    bt = np.array([t for t, _ in big], float)
    bs = np.array([s for _, s in big])
    el_slope = float(_relative_ls(bt[:, None], bs)[0])

    # decode attention: c_ctx = KV bytes per token / the KV read bandwidth the file's
    # bandwidth-bound rows achieve (kv_read_bandwidth); then i + c_seq * B on the rows
    # clear of the timing floor (twice the file's smallest time) for what is left; the
    # intercept i is that floor, not kernel
    ad = meas.tables["attn_decode.csv"]
    dec = [(ad.number(i, "batch", integer=True), ad.number(i, "context", integer=True),
            ad.number(i, "ms") * 1e-3) for i in ad.for_model(rows_name)]
    kv_bytes = memory.kv_bytes_per_token(1, arch.kv_heads, arch.head_dim, 2.0, tp)
    kv_Bps = kv_read_bandwidth(meas, launch_floor_s, rows_name, kv_bytes)
    c_ctx = kv_bytes / kv_Bps
    dec_floor = min(s for _, _, s in dec)
    dec_big = [(b, n, s) for b, n, s in dec if s > 2 * dec_floor]
    if len(dec_big) < 3:
        dec_big = dec
    x = np.array([[1.0, b] for b, _, _ in dec_big], float)
    y = np.array([s for _, _, s in dec_big])
    rest = y - c_ctx * np.array([b * n for b, n, _ in dec_big], float)
    w_rel = 1.0 / y
    (_, c_seq), *_ = np.linalg.lstsq(x * w_rel[:, None], rest * w_rel, rcond=None)
    c_seq = max(float(c_seq), 0.0)

    # prefill attention: w * pairs
    ap = meas.tables["attn_prefill.csv"]
    pre = []
    for i in ap.for_model(rows_name):
        batch = ap.rows[i]["batch"].strip()
        c = ap.number(i, "tokens", integer=True)
        s = ap.number(i, "ms") * 1e-3
        if batch.startswith("chunk_prefix"):
            try:
                prefix = int(batch[len("chunk_prefix"):])
            except ValueError:
                raise ServetuneError(
                    f"{ap.path}: line {ap.lines[i]}, column 'batch': expected 1 or "
                    f"chunk_prefix<P> (got {batch!r})") from None
            pairs = c * (prefix + c)  # the unmasked kernel's work
        else:
            pairs = c * c / 2.0
        pre.append((pairs, s))
    pre_floor = min(s for _, s in pre)
    pre_big = [(p, s) for p, s in pre if s > 2 * pre_floor]
    if len(pre_big) < 2:
        pre_big = pre
    px = np.array([[1.0, p] for p, _ in pre_big], float)
    py = np.array([s for _, s in pre_big])
    w = float(_relative_ls(px, py)[1])

    lm = meas.tables["lm_head.csv"]
    lm_pts = sorted((lm.number(i, "tokens", integer=True), lm.number(i, "ms") * 1e-3)
                    for i in lm.for_model(rows_name))
    lm_tokens = np.array([t for t, _ in lm_pts], float)
    lm_secs = _lower_envelope_from_right(np.array([s for _, s in lm_pts]))
    vocab_shard = arch.vocab / tp
    return PerOpModel(
        rows_name=rows_name, layers=arch.layers, launch_floor_s=phi, gemm=gemm,
        elementwise_s_per_token=max(el_slope, 0.0),
        decode_s_per_context_token=float(c_ctx), decode_s_per_seq=float(c_seq),
        kv_read_Bps=kv_Bps,
        prefill_s_per_pair=max(w, 0.0), lm_tokens=lm_tokens, lm_seconds=lm_secs,
        lm_weight_bytes=vocab_shard * arch.hidden * 2.0,
        files=[t.path for t in meas.tables.values()],
    )


def kv_read_bandwidth(meas: Measurements, launch_floor_s: float,
                      rows_name: str | None = None, bytes_per_token: float = 0.0) -> float:
    """KV read bandwidth (B/s) of decode attention: the median over the ``attn_decode.csv``
    rows clear of the timing floor (more than twice the file's smallest time) of KV bytes
    / (time - launch floor), the floor taken off as it is for GEMMs. Bytes are the file's
    ``kv_GBps`` x time, every model's rows (a property of the GPU and the kernel, not the
    model); a file without that column gives them as ``bytes_per_token`` x batch x context
    over the rows of ``rows_name``. On the shipped H200 file: 4.60 TB/s, 95.7% of the 4.8
    TB/s datasheet figure (single sequences reach 88-92%, large batches 97-98%; an affine
    fit's slope charged 100%: its intercept took part of the per-token cost)."""
    ad = meas.tables["attn_decode.csv"]
    if ad.rows and "kv_GBps" in ad.rows[0]:
        pts = [(ad.number(i, "ms") * 1e-3, ad.number(i, "kv_GBps") * 1e9 * ad.number(i, "ms")
                * 1e-3) for i in range(len(ad.rows))]
    else:
        pts = [(ad.number(i, "ms") * 1e-3,
                bytes_per_token * ad.number(i, "batch") * ad.number(i, "context"))
               for i in ad.for_model(rows_name or "")]
    if not pts:
        raise ServetuneError(f"{ad.path}: no decode-attention rows to measure the KV read "
                             "bandwidth from")
    floor = min(sec for sec, _ in pts)
    clear = [(sec, b) for sec, b in pts if sec > 2 * floor and sec > launch_floor_s]
    if not clear:  # no row clear of the floor: the slowest rows are the best evidence
        clear = sorted(pts)[-5:]
    rates = [b / max(sec - launch_floor_s, 0.5 * sec) for sec, b in clear]
    return float(np.median(rates))


def gemv_bandwidth_evidence(meas: Measurements, launch_floor_s: float,
                            hbm_bandwidth_Bps: float, min_weight_bytes: float = 200e6) -> float:
    """Weight-streaming bandwidth that standalone small-batch GEMMs demonstrate: median over
    the large-weight GEMM rows with tokens <= 16 (all models) of bytes / (ms - floor),
    capped at the datasheet bandwidth. A GEMM inside a graph streams its weights at about
    this rate too; the correction may go at most 15% below it."""
    lin = meas.tables["linear.csv"]
    rates = []
    for i, row in enumerate(lin.rows):
        if row["dtype"].strip() != "bf16":
            continue
        tokens = lin.number(i, "tokens", integer=True)
        wbytes = lin.number(i, "k", integer=True) * lin.number(i, "n", integer=True) * 2.0
        kernel = lin.number(i, "ms") * 1e-3 - launch_floor_s
        if tokens <= 16 and wbytes >= min_weight_bytes and kernel > 0:
            rates.append(min(wbytes / kernel, hbm_bandwidth_Bps))
    if not rates:
        return 0.8 * hbm_bandwidth_Bps
    return float(np.median(rates))


def launch_floor_estimate(meas: Measurements) -> float:
    """The floor of the tiniest timings: median of the 10 smallest decode-attention and
    GEMM times (seconds)."""
    vals = []
    for name in ("attn_decode.csv", "linear.csv"):
        t = meas.tables[name]
        vals += [t.number(i, "ms") * 1e-3 for i in range(len(t.rows))]
    vals.sort()
    return float(np.median(vals[:10]))


# --------------------------------------------------------------------------------------
# the graph correction
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GraphCorrection:
    launch_floor_s: float
    gemv_bandwidth_Bps: float
    gemm_scale: float
    layer_overhead_s: float
    learned_from: str = "default"

    def as_dict(self) -> dict[str, float]:
        return {
            "launch_floor_s": self.launch_floor_s,
            "gemv_bandwidth_Bps": self.gemv_bandwidth_Bps,
            "gemm_scale": self.gemm_scale,
            "layer_overhead_s": self.layer_overhead_s,
        }


# Learned by `learn_correction` from the H200 Llama-3.1-8B whole-step file; used when a
# measurement folder has no whole-step file of its own.
# (tests/test_profile_fit.py checks that relearning gives these values).
H200_CORRECTION = GraphCorrection(
    launch_floor_s=21.855e-6, gemv_bandwidth_Bps=3.83120e12, gemm_scale=1.10982,
    layer_overhead_s=8.55154e-6, learned_from="h200 step_graph_llama-3.1-8b.csv",
)


@dataclass
class StepShapes:
    """Whole steps as arrays: D decode seqs, C their total context, P prefill tokens with
    ``prefix`` cached tokens before them (one chunk per step)."""

    decode_seqs: np.ndarray
    context_tokens: np.ndarray
    prefill_tokens: np.ndarray
    prefix_tokens: np.ndarray

    @classmethod
    def from_rows(cls, rows: list[StepRow]) -> StepShapes:
        return cls(
            np.array([r.decode_seqs for r in rows], float),
            np.array([r.decode_seqs * r.context for r in rows], float),
            np.array([r.prefill_tokens for r in rows], float),
            np.array([r.prefix for r in rows], float),
        )

    def tokens(self) -> np.ndarray:
        return self.decode_seqs + self.prefill_tokens

    def sampled_rows(self) -> np.ndarray:
        return self.decode_seqs + (self.prefill_tokens > 0)

    def prefill_pairs(self) -> np.ndarray:
        p = self.prefill_tokens
        return p * (self.prefix_tokens + p / 2.0)

    def step_arguments(self) -> tuple[np.ndarray, ...]:
        """(T, S, D, C, W) for :meth:`StepTimeModel.seconds`."""
        return (self.tokens(), self.sampled_rows(), self.decode_seqs, self.context_tokens,
                self.prefill_pairs())


def perop_parts(perop: PerOpModel, corr: GraphCorrection, shapes: StepShapes
                ) -> dict[str, np.ndarray]:
    """Seconds of each part of whole steps predicted from per-op curves."""
    L = perop.layers
    return {
        "gemm_elementwise": L * perop.token_term(shapes.tokens(), corr),
        "decode_attn": L * (perop.decode_s_per_context_token * shapes.context_tokens
                            + perop.decode_s_per_seq * shapes.decode_seqs),
        "prefill_attn": L * perop.prefill_s_per_pair * shapes.prefill_pairs(),
        "lm_head": perop.lm_head(shapes.sampled_rows(), corr),
        "layer_overhead": np.full(len(shapes.decode_seqs), L * corr.layer_overhead_s),
    }


def _errors(pred: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return np.abs(pred / measured - 1.0)


@dataclass
class CorrectionFit:
    correction: GraphCorrection
    median_abs_pct_error: float
    max_abs_pct_error: float
    rows: int


def learn_correction(
    meas: Measurements, rows_name: str, arch: ModelArch, steps: list[StepRow],
    *, hbm_bandwidth_Bps: float, source: str = "",
    launch_floors: list[float] | None = None,
) -> CorrectionFit:
    """Fit (B_gemv, alpha, psi) so per-op sums match whole CUDA-graph steps; phi is the
    measured floor (:func:`launch_floor_estimate`) unless ``launch_floors`` lists
    candidates to choose from."""
    if not steps:
        raise ServetuneError(f"{source or rows_name}: no whole-step rows to learn from")
    measured = np.array([r.seconds for r in steps])
    shapes = StepShapes.from_rows(steps)
    floor = launch_floor_estimate(meas)
    best: tuple[float, GraphCorrection, np.ndarray] | None = None

    def score_phi(phi: float) -> None:
        nonlocal best
        base_perop = build_perop(meas, rows_name, arch, 1, phi)
        evidence = gemv_bandwidth_evidence(meas, phi, hbm_bandwidth_Bps)
        el = arch.layers * base_perop.elementwise_s_per_token * shapes.tokens()
        for frac in np.linspace(0.85, 1.0, 7):
            trial = GraphCorrection(phi, float(frac * evidence), 1.0, 0.0)
            parts = perop_parts(base_perop, trial, shapes)
            g = parts["gemm_elementwise"] - el
            rest = parts["decode_attn"] + parts["prefill_attn"] + parts["lm_head"] + el
            x = np.stack([g, np.full_like(g, arch.layers)], axis=1)
            alpha, psi = _relative_ls(x, measured - rest)
            if psi < 0:
                psi = 0.0
                alpha = float(_relative_ls(g[:, None], measured - rest)[0])
            if alpha <= 0:
                continue
            err = _errors(alpha * g + arch.layers * psi + rest, measured)
            score = float(np.median(err) + 0.25 * err.max())
            if best is None or score < best[0]:
                corr = GraphCorrection(phi, trial.gemv_bandwidth_Bps, float(alpha),
                                       float(psi), learned_from=source or rows_name)
                best = (score, corr, err)

    candidates = [floor] if launch_floors is None else list(launch_floors)
    for phi in candidates:
        score_phi(float(phi))
    if best is None:
        raise ServetuneError(f"{source or rows_name}: could not fit the launch-floor "
                             "correction (no positive GEMM scale)")
    _, corr, err = best
    return CorrectionFit(corr, float(np.median(err) * 100), float(err.max() * 100), len(steps))


# --------------------------------------------------------------------------------------
# step-time model
# --------------------------------------------------------------------------------------
def fit_convex_pwl(x: np.ndarray, y: np.ndarray, knots: np.ndarray | None = None,
                   max_pieces: int = 6) -> list[tuple[float, float]]:
    """Convex piecewise-linear f(x) = max_k (a_k + b_k x) with every a_k, b_k >= 0,
    minimising max + mean of |f(x_i) - y_i| / y_i (an LP over a hinge basis with kinks >= 0).

    The pieces are then greedily merged down to ``max_pieces`` by refitting on fewer knots.
    """
    x = np.asarray(x, float)
    y = np.asarray(y, float)
    if knots is None:
        knots = x[1:-1]
    knots = np.asarray(sorted(set(float(k) for k in knots)), float)
    pieces = _pwl_lp(x, y, knots)
    while len(pieces) > max_pieces:
        # drop the knot whose removal costs least
        best = None
        for j in range(len(knots)):
            trial_knots = np.delete(knots, j)
            trial = _pwl_lp(x, y, trial_knots)
            resid = np.abs(_pwl_eval(trial, x) / y - 1)
            cost = float(resid.max() + resid.mean())
            if best is None or cost < best[0]:
                best = (cost, trial_knots, trial)
        assert best is not None
        _, knots, pieces = best
    return pieces


def _pwl_eval(pieces: list[tuple[float, float]], x: np.ndarray) -> np.ndarray:
    return np.max([a + b * np.asarray(x, float) for a, b in pieces], axis=0)


def _pwl_lp(x: np.ndarray, y: np.ndarray, knots: np.ndarray) -> list[tuple[float, float]]:
    """The LP of :func:`fit_convex_pwl`: minimise max_i |r_i| + mean_i |r_i| of the relative
    residuals r_i (the max keeps every measured shape within a bound where the data is not
    convex; the mean picks the best fit among equal maxima)."""
    n, k = len(x), len(knots)
    # variables: a, b0, c_1..c_k, e+_1..e+_n, e-_1..e-_n, z
    nv = 2 + k + 2 * n + 1
    z = nv - 1
    hinge = np.maximum(0.0, x[:, None] - knots[None, :])
    a_eq = np.zeros((n, nv))
    a_eq[:, 0] = 1.0 / y
    a_eq[:, 1] = x / y
    a_eq[:, 2:2 + k] = hinge / y[:, None]
    a_eq[np.arange(n), 2 + k + np.arange(n)] = -1.0
    a_eq[np.arange(n), 2 + k + n + np.arange(n)] = 1.0
    b_eq = np.ones(n)
    # cumulative intercepts a - sum_{j<=i} c_j * knot_j >= 0; residuals <= z
    a_ub = np.zeros((k + 2 * n, nv))
    for i in range(k):
        a_ub[i, 0] = -1.0
        a_ub[i, 2:2 + i + 1] = knots[: i + 1]
    for i in range(2 * n):
        a_ub[k + i, 2 + k + i] = 1.0
        a_ub[k + i, z] = -1.0
    b_ub = np.zeros(k + 2 * n)
    cost = np.zeros(nv)
    cost[2 + k:z] = 1.0 / n
    cost[z] = 1.0
    sol = solve_lp(cost, a_eq=a_eq, b_eq=b_eq, a_ub=a_ub, b_ub=b_ub)
    a, b = sol[0], sol[1]
    pieces = [(a, b)]
    tol = 1e-9 * max(1.0, float(np.max(y)) / max(float(np.max(x)), 1.0))
    for i in range(k):
        c = sol[2 + i]
        if c > tol:
            a, b = a - c * knots[i], b + c
            pieces.append((a, b))
    return [(max(float(p), 0.0), max(float(q), 0.0)) for p, q in pieces]


def allreduce_terms(arch: ModelArch, tensor_parallel: int,
                    interconnect_Bps: float) -> tuple[float, float]:
    """(seconds per token, fixed seconds per step) of TP all-reduces: two per layer of
    ``hidden`` bf16 values per token, ring algorithm moving 2(TP-1)/TP of the bytes."""
    tp = tensor_parallel
    if tp <= 1:
        return 0.0, 0.0
    if interconnect_Bps <= 0:
        raise ServetuneError("hardware.interconnect_bandwidth_Bps must be > 0 for "
                             f"tensor_parallel {tp}")
    bytes_per_token = 2 * arch.layers * arch.hidden * 2.0 * 2.0 * (tp - 1) / tp
    per_token = bytes_per_token / (ALLREDUCE_EFFICIENCY * interconnect_Bps)
    fixed = 2 * arch.layers * ALLREDUCE_LATENCY_S
    return per_token, fixed


def step_time_from_perop(perop: PerOpModel, corr: GraphCorrection, *,
                         allreduce: tuple[float, float] = (0.0, 0.0),
                         max_pieces: int = 5) -> StepTimeModel:
    """The step-time model (module docstring, step 3) of a per-op model."""
    L = perop.layers
    # fit at the token counts that were measured (log-spaced, 1..8192, the budgets engines
    # use; above, the last piece extrapolates the compute-bound slope): between them the
    # tables are only interpolated, and tile-quantisation bumps are not worth a piece
    grid = np.unique(np.concatenate([op.tokens for op in perop.gemm.values()]))
    grid = grid[grid <= 8192]
    g = L * perop.token_term(grid, corr)
    pieces = fit_convex_pwl(grid, g, grid[1:-1], max_pieces=max_pieces)
    lm = perop.lm_head(S_GRID, corr)
    ((lm_a, lm_b),) = _pwl_lp(S_GRID, lm, np.zeros(0))
    return StepTimeModel(
        fixed_s=L * corr.layer_overhead_s + lm_a + allreduce[1],
        gemm_pieces=pieces,
        allreduce_s_per_token=allreduce[0],
        decode_attn_s_per_context_token=L * perop.decode_s_per_context_token,
        decode_attn_s_per_seq=L * max(perop.decode_s_per_seq, 0.0),
        prefill_attn_s_per_token_pair=L * perop.prefill_s_per_pair,
        lm_head_s_per_row=lm_b,
    )


def predict(model: StepTimeModel, shapes: StepShapes) -> np.ndarray:
    """GPU seconds of each step (host costs left out: the whole-step files are graph
    replays, GPU time only)."""
    gpu = model.gpu_only()
    t, s, d, c, w = shapes.step_arguments()
    return np.array([gpu.seconds(*args) for args in zip(t, s, d, c, w, strict=True)])


def check_rows(model: StepTimeModel, rows: list[StepRow]) -> dict:
    """The ``profile check`` report: predicted vs measured per row, and error summary."""
    shapes = StepShapes.from_rows(rows)
    pred = predict(model, shapes)
    meas = np.array([r.seconds for r in rows])
    err = (pred / meas - 1.0) * 100.0
    per_row = [
        {
            "line": r.line, "decode_seqs": r.decode_seqs, "context": r.context,
            "prefill_tokens": r.prefill_tokens, "prefix": r.prefix,
            "measured_ms": round(r.seconds * 1e3, 4), "predicted_ms": round(p * 1e3, 4),
            "error_pct": round(float(e), 2),
        }
        for r, p, e in zip(rows, pred, err, strict=True)
    ]
    return {
        "rows": len(rows),
        "median_abs_pct_error": round(float(np.median(np.abs(err))), 3) if rows else None,
        "max_abs_pct_error": round(float(np.max(np.abs(err))), 3) if rows else None,
        "per_row": per_row,
    }


def check_profile(profile: Profile, measured: str | Path, model: str | None = None) -> dict:
    """:func:`check_rows` of ``profile`` against a whole-step CSV: the rows of ``model``, by
    default the profile's own model when the file has it, else every row."""
    table = read_csv(measured, STEP_COLUMNS)
    want = model
    if want is None and profile.model is not None and profile.model.name in table.models():
        want = profile.model.name
    rows = step_rows(table, want)
    if not rows:
        raise ServetuneError(f"{measured}: no rows for model {want!r} in column 'model' "
                             f"(models present: {', '.join(table.models())})")
    return check_rows(profile.step_time, rows)


# --------------------------------------------------------------------------------------
# derived profiles: scale measured per-op curves to another GPU / shape
# --------------------------------------------------------------------------------------
def scale_perop(perop: PerOpModel, *, base_hw: Hardware, target_hw: Hardware,
                flops_ratio: float = 1.0, bytes_ratio: float = 1.0,
                kv_ratio: float = 1.0, attn_flops_ratio: float = 1.0,
                lm_ratio: float = 1.0, layers: int | None = None) -> PerOpModel:
    """A per-op model for ``target_hw`` (and optionally a shape ``*_ratio`` times the
    measured one): compute-bound time scales with peak FLOP/s, memory-bound with
    bandwidth.

    A GEMM row of T tokens is placed on the measured GPU's roofline by
    ``r = (FLOPs / peak FLOP/s) / (weight bytes / bandwidth)`` (about T over the ridge
    point). Only its compute share, ``min(1, r)`` of the measured time, is scaled (by the
    ratio of peak FLOP/s); reading the weights is charged by the weight-streaming floor
    ``weight bytes / gemv_bandwidth_Bps`` of the target GPU (:meth:`OpCurve.graph_seconds`
    takes the larger of the two). So a small-batch GEMM, a weight read on every GPU, costs
    what the target's bandwidth allows, and a prefill-sized one scales with FLOP/s.
    (Scaling whole rows by FLOP/s charged an A100 compute time for weight reads: its
    derived batch-1 decode was about 40% slow.)"""
    f = base_hw.peak_flops / target_hw.peak_flops
    m = base_hw.hbm_bandwidth_Bps / target_hw.hbm_bandwidth_Bps
    phi = perop.launch_floor_s

    def kernel_scaled(seconds: np.ndarray, factor: float) -> np.ndarray:
        # the launch floor belongs to the timing method, not the kernel: keep it as is
        return phi + np.maximum(seconds - phi, 0.0) * factor

    def gemm_scaled(op: OpCurve) -> np.ndarray:
        kernel = np.maximum(op.seconds - phi, 0.0)
        compute_s = op.flops_per_token * op.tokens / base_hw.peak_flops
        r = compute_s / (op.weight_bytes / base_hw.hbm_bandwidth_Bps)
        return phi + kernel * np.minimum(1.0, r) * f * flops_ratio

    gemm = {
        name: OpCurve(op.tokens, gemm_scaled(op),
                      op.weight_bytes * bytes_ratio, op.flops_per_token * flops_ratio)
        for name, op in perop.gemm.items()
    }
    return replace(
        perop, layers=layers or perop.layers, gemm=gemm,
        elementwise_s_per_token=perop.elementwise_s_per_token * m * bytes_ratio,
        decode_s_per_context_token=perop.decode_s_per_context_token * m * kv_ratio,
        decode_s_per_seq=perop.decode_s_per_seq * m,
        kv_read_Bps=perop.kv_read_Bps / m,
        prefill_s_per_pair=perop.prefill_s_per_pair * f * attn_flops_ratio,
        lm_seconds=kernel_scaled(perop.lm_seconds, f * lm_ratio),
        lm_weight_bytes=perop.lm_weight_bytes * lm_ratio,
    )


def scaled_correction(corr: GraphCorrection, base_hw: Hardware, target_hw: Hardware
                      ) -> GraphCorrection:
    """The same efficiencies on another GPU: weight streaming scales with its bandwidth."""
    ratio = target_hw.hbm_bandwidth_Bps / base_hw.hbm_bandwidth_Bps
    return replace(corr, gemv_bandwidth_Bps=corr.gemv_bandwidth_Bps * ratio)


def shape_ratios(base: ModelArch, base_tp: int, target: ModelArch, target_tp: int
                 ) -> dict[str, float]:
    """Per-layer ratios target/base of GEMM FLOPs (= weight bytes), KV bytes, attention
    FLOPs and LM-head size, per GPU."""
    def layer_params(a: ModelArch, tp: int) -> float:
        q = a.heads * a.head_dim
        kv = 2 * a.kv_heads * a.head_dim
        return (a.hidden * (q + kv) + q * a.hidden + 3 * a.hidden * a.intermediate) / tp

    def kv(a: ModelArch, tp: int) -> float:
        return max(1, a.kv_heads // tp) * a.head_dim

    return {
        "flops_ratio": layer_params(target, target_tp) / layer_params(base, base_tp),
        "bytes_ratio": layer_params(target, target_tp) / layer_params(base, base_tp),
        "kv_ratio": kv(target, target_tp) / kv(base, base_tp),
        "attn_flops_ratio": (target.heads / target_tp * target.head_dim)
        / (base.heads / base_tp * base.head_dim),
        "lm_ratio": (target.vocab / target_tp * target.hidden) / (base.vocab / base_tp
                                                                   * base.hidden),
    }


def round_sig(x: float, digits: int = 6) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits}g}")


def rounded(model: StepTimeModel) -> StepTimeModel:
    """Coefficients to 6 significant digits (readable files, same predictions to 1e-5)."""
    data = model.model_dump()
    for key, value in data.items():
        if isinstance(value, float):
            data[key] = round_sig(value)
    data["gemm_pieces"] = [(round_sig(a), round_sig(b)) for a, b in model.gemm_pieces]
    return StepTimeModel.model_validate(data)
