"""Accuracy of the fitted GPU profiles, hold-out checks, and sanity of the derived ones.

    python benchmarks/profile_accuracy.py [--measurements DIR] [--json]

1. ``h200-llama-3.1-8b`` fitted from the H200 folder vs its whole-step file (target:
   median abs error <= 5%, max <= 15%).
2. Hold-outs: the launch-floor correction and the model refitted on part of the whole-step
   rows, tested on the rest (random halves with 20 seeds, shape-based splits, and the
   regime split decode-only -> mixed, which the method cannot extrapolate).
3. Qwen2.5-32B (per-op rows only) against physical bounds (no whole-step file exists).
4. Derived profiles: decode step at batch 1, decode throughput at batch 64 x 2k context,
   prefill throughput, and the ratios that public results speak to.
5. Time to fit a profile.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from servetune.profiles.build import fit_profile
from servetune.profiles.catalog import MODELS
from servetune.profiles.fit import build_perop, check_rows, learn_correction, step_time_from_perop
from servetune.profiles.measurements import load_measurements, step_rows
from servetune.profiles.shipped import load_profile, shipped_profiles

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / "gpu_profiles" / "calibration" / "h200"


def _fit_on(meas, rows, train_idx):
    arch = MODELS["llama-3.1-8b"]
    train = [rows[i] for i in train_idx]
    corr = learn_correction(meas, arch.name, arch, train, hbm_bandwidth_Bps=4.8e12).correction
    perop = build_perop(meas, arch.name, arch, 1, corr.launch_floor_s)
    return step_time_from_perop(perop, corr)


def holdouts(meas) -> dict:
    rows = step_rows(meas.steps["llama-3.1-8b"])
    n = len(rows)
    out: dict = {}
    rng = np.random.default_rng(0)
    med, mx = [], []
    for _ in range(20):
        perm = rng.permutation(n)
        train, test = sorted(perm[: n // 2]), sorted(perm[n // 2:])
        rep = check_rows(_fit_on(meas, rows, train), [rows[i] for i in test])
        med.append(rep["median_abs_pct_error"])
        mx.append(rep["max_abs_pct_error"])
    out["random_half_x20"] = {"median_of_medians": float(np.median(med)),
                              "worst_median": float(np.max(med)),
                              "median_of_max": float(np.median(mx)), "worst_max": float(np.max(mx))}
    splits = {
        "hold_out_context_8192": lambda r: r.context >= 8192,
        "hold_out_batch_256_plus": lambda r: r.decode_seqs >= 256,
        "hold_out_batch_8_and_64": lambda r: r.decode_seqs in (8, 64),
        "hold_out_batch_1": lambda r: r.decode_seqs <= 1,
        "regime_decode_only_to_mixed": lambda r: r.prefill_tokens > 0,
        "regime_mixed_to_decode_only": lambda r: r.prefill_tokens == 0,
    }
    for name, held in splits.items():
        train = [i for i, r in enumerate(rows) if not held(r)]
        test = [r for r in rows if held(r)]
        rep = check_rows(_fit_on(meas, rows, train), test)
        out[name] = {"train_rows": len(train), "test_rows": len(test),
                     "median_abs_pct_error": rep["median_abs_pct_error"],
                     "max_abs_pct_error": rep["max_abs_pct_error"]}
    return out


def derived_table() -> list[dict]:
    rows = []
    for name in shipped_profiles():
        p = load_profile(name)
        st = p.step_time
        b1 = st.seconds(1, 1, 1, 1024, 0)
        b64 = st.seconds(64, 64, 64, 64 * 2048, 0)
        pf2k = st.seconds(2048, 1, 0, 0, 2048 * 1024)
        pf8k = st.seconds(8192, 1, 0, 0, 8192 * 4096)
        rows.append({
            "profile": name, "calibration": p.calibration.kind, "tp": p.tensor_parallel,
            "kv_blocks": p.kv_blocks(), "decode_b1_ms": round(float(b1) * 1e3, 2),
            "decode_b64_2k_tok_s": round(64 / float(b64)),
            "prefill_2k_ms": round(float(pf2k) * 1e3, 1),
            "prefill_8k_tok_s": round(8192 / float(pf8k)),
        })
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measurements", default=str(DEFAULT_DIR))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    meas_dir = Path(args.measurements)

    t0 = time.perf_counter()
    profile, report = fit_profile(meas_dir, "llama-3.1-8b")
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    qwen, _ = fit_profile(meas_dir, "qwen2.5-32b")
    qwen_s = time.perf_counter() - t0
    meas = load_measurements(meas_dir)
    result = {
        "h200_8b_vs_step_graph": {k: report.check[k] for k in
                                  ("rows", "median_abs_pct_error", "max_abs_pct_error")},
        "correction": report.correction.as_dict(),
        "holdouts": holdouts(meas),
        "qwen_decode_b1_ms": round(qwen.step_time.seconds(1, 1, 1, 1024, 0) * 1e3, 2),
        "qwen_weight_stream_bound_ms": round(64 * 487.6e6 * 2 / 4.8e12 * 1e3, 2),
        "derived": derived_table(),
        "fit_seconds": {"llama-3.1-8b_with_correction": round(fit_s, 3),
                        "qwen2.5-32b": round(qwen_s, 3)},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    c = result["h200_8b_vs_step_graph"]
    print(f"8B vs step_graph: {c['rows']} rows, median {c['median_abs_pct_error']:.2f}%, "
          f"max {c['max_abs_pct_error']:.2f}%")
    print("correction:", {k: f"{v:.4g}" for k, v in result["correction"].items()})
    for name, h in result["holdouts"].items():
        print(f"  {name}: {h}")
    print(f"qwen decode b1 {result['qwen_decode_b1_ms']} ms (weight-stream bound "
          f"{result['qwen_weight_stream_bound_ms']} ms at 4.8 TB/s)")
    for r in result["derived"]:
        print("  ", r)
    print("fit seconds:", result["fit_seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
