"""Building whole Profile documents: fitted from a measurement folder, or derived for
another GPU / model / TP degree from measured per-op curves and datasheet ratios.

:func:`fit_profile` is ``servetune profile fit``; :func:`derive_profile` is
``servetune profile derive`` and what ``gpu_profiles/regenerate.py`` uses for the shipped
``calibration: derived`` profiles. The method is in :mod:`servetune.profiles.fit`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from servetune.errors import ServetuneError
from servetune.profiles import catalog, memory
from servetune.profiles.fit import (
    ALLREDUCE_EFFICIENCY,
    ALLREDUCE_LATENCY_S,
    H200_CORRECTION,
    GraphCorrection,
    allreduce_terms,
    build_perop,
    check_rows,
    learn_correction,
    round_sig,
    rounded,
    scale_perop,
    scaled_correction,
    shape_ratios,
    step_time_from_perop,
)
from servetune.profiles.measurements import Measurements, load_measurements, step_rows
from servetune.profiles.schema import (
    Calibration,
    CalibrationFile,
    Hardware,
    MemoryBudget,
    ModelArch,
    Parallelism,
    Profile,
)
from servetune.profiles.steptime import StepTimeModel
from servetune.schemas.base import format_validation_error, read_yaml


def resolve_arch(model: str) -> ModelArch:
    """A catalog model name, or a YAML file with ModelArch fields."""
    key = model.lower()
    if key in catalog.MODELS:
        return catalog.MODELS[key]
    p = Path(model)
    if p.suffix in (".yaml", ".yml") or p.exists():
        data = read_yaml(p)
        try:
            return ModelArch.model_validate(data)
        except Exception as exc:  # pydantic ValidationError
            if hasattr(exc, "errors"):
                raise ServetuneError(format_validation_error(exc, str(p))) from None
            raise ServetuneError(f"{p}: {exc}") from None
    raise ServetuneError(
        f"argument `model` {model!r}: unknown architecture (built in: {', '.join(catalog.MODELS)}; "
        "or give a YAML file with name, layers, hidden, intermediate, heads, kv_heads, "
        "head_dim, vocab, params, dtype)"
    )


def resolve_gpu(gpu: str) -> Hardware:
    key = gpu.lower()
    if key in catalog.GPUS:
        return catalog.GPUS[key]
    found = catalog.gpu_key(gpu)
    if found:
        return catalog.GPUS[found]
    raise ServetuneError(f"argument `gpu` {gpu!r}: unknown GPU (known: {', '.join(catalog.GPUS)})")


def gpu_from_env(meas: Measurements) -> Hardware | None:
    """The GPU named in the folder's ``env.txt`` (``device NAME ... mem_total N``), with the
    memory the driver reported there."""
    env = meas.folder / "env.txt"
    if not env.is_file():
        return None
    text = env.read_text(encoding="utf-8", errors="replace")
    m = re.search(r"^device (.+?) sms \d+ mem_total (\d+)", text, re.MULTILINE)
    if not m:
        return None
    key = catalog.gpu_key(m.group(1))
    if key is None:
        return None
    return catalog.GPUS[key].model_copy(update={"memory_bytes": int(m.group(2))})


def rows_name_for(meas: Measurements, arch: ModelArch, tp: int) -> str:
    present = set.intersection(*(set(t.models()) for t in meas.tables.values()))
    if tp == 1 and arch.name in present:
        return arch.name
    shard = catalog.SHARD_ROWS.get((arch.name, tp))
    if shard and shard in present:
        return shard
    raise ServetuneError(
        f"{meas.folder}: no per-operation rows for {arch.name!r} at tensor_parallel {tp} in "
        f"column 'model' (models in every file: {', '.join(sorted(present)) or 'none'})"
    )


@dataclass
class FitReport:
    """What ``profile fit`` learned besides the profile: the launch-floor correction and,
    when the folder has whole-step timings, the profile's error on them."""

    correction: GraphCorrection
    check: dict | None


def _new_profile(name: str, hardware: Hardware, arch: ModelArch, tp: int, utilization: float,
                 block_size: int, step_time: StepTimeModel, calibration: Calibration) -> Profile:
    """A profile of ``arch`` at tensor parallelism ``tp`` on ``hardware``, with the
    activation reserve estimated from the architecture."""
    reserve = memory.estimate_activation_reserve(arch.hidden, arch.intermediate, arch.vocab, tp)
    return Profile(
        name=name, hardware=hardware, model=arch, parallelism=Parallelism(tensor_parallel=tp),
        memory=MemoryBudget(gpu_memory_utilization=utilization, activation_reserve_bytes=reserve,
                            block_size=block_size),
        step_time=step_time, calibration=calibration,
    )


def _default_name(prefix: str, arch: ModelArch, tp: int) -> str:
    return f"{prefix}-{arch.name}" + (f"-tp{tp}" if tp > 1 else "")


def _calibration_files(meas: Measurements, base: Path | None) -> list[CalibrationFile]:
    """The timing files a profile was built from, with their hashes (paths relative to
    ``base`` when given)."""
    return [CalibrationFile(path=_relpath(t.path, base), sha256=t.sha256, rows=len(t.rows))
            for t in meas.files()]


def _relpath(path: Path, base: Path | None) -> str:
    if base is None:
        return str(path)
    try:
        return os.path.relpath(path.resolve(), base.resolve())
    except ValueError:
        return str(path)


def learn_from_folder(meas: Measurements, hardware: Hardware,
                      prefer_model: str | None = None,
                      prefer_arch: ModelArch | None = None) -> tuple[GraphCorrection, dict]:
    """The launch-floor correction from the folder's whole-step file (preferring the
    target model's own), or the shipped H200 constants when there is none."""
    models = list(meas.steps)
    if not models:
        return H200_CORRECTION, {}
    name = prefer_model if prefer_model in meas.steps else models[0]
    arch = catalog.MODELS.get(name)
    if arch is None and prefer_arch is not None and prefer_arch.name == name:
        arch = prefer_arch  # the target architecture given as a YAML file
    if arch is None:
        raise ServetuneError(f"{meas.steps[name].path}: whole steps of {name!r}, an "
                             f"architecture not built in ({', '.join(catalog.MODELS)})")
    rows = step_rows(meas.steps[name], name)
    fit = learn_correction(meas, name, arch, rows, hbm_bandwidth_Bps=hardware.hbm_bandwidth_Bps,
                           source=meas.steps[name].path.name)
    return fit.correction, {
        "correction_rows": fit.rows,
        "correction_median_abs_pct_error": round(fit.median_abs_pct_error, 3),
        "correction_max_abs_pct_error": round(fit.max_abs_pct_error, 3),
    }


def fit_profile(
    measurements: str | os.PathLike[str],
    model: str,
    *,
    gpu: str | None = None,
    tensor_parallel: int = 1,
    name: str | None = None,
    gpu_memory_utilization: float = 0.92,
    block_size: int = 16,
    paths_relative_to: Path | None = None,
) -> tuple[Profile, FitReport]:
    """``servetune profile fit``: a measured profile from a timing folder."""
    meas = load_measurements(measurements)
    arch = resolve_arch(model)
    tp = tensor_parallel
    hardware = resolve_gpu(gpu) if gpu else gpu_from_env(meas)
    if hardware is None:
        raise ServetuneError(f"{meas.folder}/env.txt: no known GPU named there; pass "
                             f"argument `gpu` ({', '.join(catalog.GPUS)})")
    rows_name = rows_name_for(meas, arch, tp)
    corr, corr_fit = learn_from_folder(meas, hardware, prefer_model=arch.name,
                                       prefer_arch=arch)
    perop = build_perop(meas, rows_name, arch, tp, corr.launch_floor_s)
    ar = allreduce_terms(arch, tp, hardware.interconnect_bandwidth_Bps)
    step_time = rounded(step_time_from_perop(perop, corr, allreduce=ar))
    check = None
    if arch.name in meas.steps and tp == 1:
        check = check_rows(step_time, step_rows(meas.steps[arch.name], arch.name))
    assumptions = [
        "step time = per-operation timings of one layer x layers, with the launch-floor "
        "correction (launch_floor_s, gemv_bandwidth_Bps, gemm_scale, layer_overhead_s) "
        f"learned from {corr.learned_from} (servetune.profiles.fit docstring)",
        HOST_ASSUMPTION,
        _kv_assumption(perop.kv_read_Bps, hardware),
        "activation_reserve_bytes estimated by "
        "servetune.profiles.memory.estimate_activation_reserve "
        "(max_num_batched_tokens 8192, max_num_seqs 1024, 1.5 GiB CUDA graphs + non-torch)",
    ]
    if rows_name != arch.name:
        assumptions.append(f"per-GPU rows {rows_name!r} stand for {arch.name} at TP {tp}")
    if tp > 1:
        assumptions.append(_allreduce_assumption(hardware))
    fit = {**{k: round_sig(v) for k, v in corr.as_dict().items()}, **corr_fit,
           **_kv_fit(perop.kv_read_Bps, hardware)}
    if check is not None:
        fit["step_rows"] = check["rows"]
        fit["median_abs_pct_error"] = check["median_abs_pct_error"]
        fit["max_abs_pct_error"] = check["max_abs_pct_error"]
    calibration = Calibration(
        kind="measured",
        source=f"per-operation and whole-step timings in "
               f"{_relpath(meas.folder, paths_relative_to)} (rows of {rows_name!r}, "
               f"{hardware.name}), fitted by servetune profile fit",
        files=_calibration_files(meas, paths_relative_to), assumptions=assumptions, fit=fit,
    )
    profile = _new_profile(name or _default_name(_gpu_slug(hardware), arch, tp), hardware,
                           arch, tp, gpu_memory_utilization, block_size, step_time, calibration)
    return profile, FitReport(corr, check)


HOST_ASSUMPTION = (
    "GPU time only: the engine's host work per step and per sampled sequence (scheduling, "
    "input preparation, sampling, output processing) is added when a step is simulated, "
    "from the engine's defaults in servetune.engines (host_s_per_step, host_s_per_seq and "
    "host_overlap are null here)"
)


def _kv_fit(kv_read_Bps: float, hw: Hardware) -> dict[str, float]:
    return {"kv_read_bandwidth_Bps": round_sig(kv_read_Bps),
            "kv_bandwidth_fraction": round_sig(kv_read_Bps / hw.hbm_bandwidth_Bps, 4)}


def _kv_assumption(kv_read_Bps: float, hw: Hardware) -> str:
    return (f"decode attention reads KV at {kv_read_Bps / 1e12:.3f} TB/s, "
            f"{kv_read_Bps / hw.hbm_bandwidth_Bps:.1%} of the {hw.hbm_bandwidth_Bps / 1e12:.3g} "
            "TB/s datasheet figure: the median kv_GBps of the bandwidth-bound rows of "
            "attn_decode.csv (servetune.profiles.fit.kv_read_bandwidth)")


def _allreduce_assumption(hw: Hardware) -> str:
    return (
        f"TP all-reduce: 2 per layer of hidden bf16 values per token, ring 2(TP-1)/TP of the "
        f"bytes at {ALLREDUCE_EFFICIENCY:.0%} of {hw.interconnect_bandwidth_Bps / 1e9:.0f} GB/s "
        f"per direction, {ALLREDUCE_LATENCY_S * 1e6:.0f} us latency each in fixed_s"
    )


def _gpu_slug(hw: Hardware) -> str:
    key = catalog.gpu_key(hw.name)
    return key or re.sub(r"[^a-z0-9]+", "-", hw.name.lower()).strip("-")


# vLLM's paged decode attention on an H100 80GB reads KV at this fraction of the 3.35 TB/s
# datasheet bandwidth: the vLLM blog's single-request fit for Llama-3.1-8B bf16 (vLLM
# 0.19.1, FlashAttention 3; blog.vllm.ai/2026/04/22/fp8-kvcache.html, "Single Request
# Benchmarking") is ITL = 6.44 ms + 4.37e-5 ms per input token, and each token of context
# is 131,072 bytes of KV read per step (32 layers x 8 KV heads x 128 x 2 x 2 bytes), so
# 131,072 B / 43.7 ns = 3.00 TB/s. The contiguous kernel of attn_decode.csv reaches 95.7%
# of the H200's bandwidth; a serving engine's paged kernel, which splits the KV of a few
# long sequences across the SMs and merges the parts, less. Derived profiles charge this.
_LLAMA_8B = catalog.MODELS["llama-3.1-8b"]
VLLM_KV_FRACTION = round(
    memory.kv_bytes_per_token(_LLAMA_8B.layers, _LLAMA_8B.kv_heads, _LLAMA_8B.head_dim, 2.0)
    / 4.37e-8 / catalog.GPUS["h100-80gb"].hbm_bandwidth_Bps, 4)


def derive_profile(
    measurements: str | os.PathLike[str],
    model: str,
    gpu: str,
    *,
    tensor_parallel: int = 1,
    base_gpu: str | None = None,
    name: str | None = None,
    gpu_memory_utilization: float = 0.92,
    block_size: int = 16,
    paths_relative_to: Path | None = None,
) -> Profile:
    """A ``calibration: derived`` profile: the measured per-op curves of the closest
    measured shape (the same model, else a TP shard of it), scaled to ``gpu`` by datasheet
    ratios and to the target shape by FLOP/byte ratios; the launch-floor correction
    learned on the measured GPU."""
    meas = load_measurements(measurements)
    arch = resolve_arch(model)
    target_hw = resolve_gpu(gpu)
    base_hw = resolve_gpu(base_gpu) if base_gpu else gpu_from_env(meas)
    if base_hw is None:
        raise ServetuneError(f"{meas.folder}/env.txt: no known GPU named there; pass "
                             "argument `base_gpu`")
    tp = tensor_parallel
    present = set.intersection(*(set(t.models()) for t in meas.tables.values()))
    base_arch, base_tp, rows_name = None, 1, None
    if arch.name in present:
        base_arch, base_tp, rows_name = arch, 1, arch.name
    else:
        for (mname, mtp), shard in catalog.SHARD_ROWS.items():
            if mname == arch.name and shard in present:
                base_arch, base_tp, rows_name = arch, mtp, shard
                break
    if base_arch is None or rows_name is None:
        raise ServetuneError(
            f"{meas.folder}: no per-operation rows of {arch.name!r} or a TP shard of it "
            f"(models in every file: {', '.join(sorted(present))})")
    corr, corr_fit = learn_from_folder(meas, base_hw)
    perop = build_perop(meas, rows_name, base_arch, base_tp, corr.launch_floor_s)
    ratios = shape_ratios(base_arch, base_tp, arch, tp)
    scaled = scale_perop(perop, base_hw=base_hw, target_hw=target_hw, **ratios)
    kv_Bps = target_hw.hbm_bandwidth_Bps * VLLM_KV_FRACTION
    scaled = replace(scaled, kv_read_Bps=kv_Bps, decode_s_per_context_token=(
        scaled.decode_s_per_context_token * scaled.kv_read_Bps / kv_Bps))
    target_corr = scaled_correction(corr, base_hw, target_hw)
    ar = allreduce_terms(arch, tp, target_hw.interconnect_bandwidth_Bps)
    step_time = rounded(step_time_from_perop(scaled, target_corr, allreduce=ar))
    gpu_key = catalog.gpu_key(target_hw.name) or gpu
    base_key = catalog.gpu_key(base_hw.name) or "measured GPU"
    assumptions = [
        f"per-op curves of {rows_name!r} measured on {base_hw.name} "
        f"({_relpath(meas.folder, paths_relative_to)}); "
        f"launch-floor correction learned from {corr.learned_from}",
        "compute-bound GEMM and prefill-attention time scaled by peak bf16 FLOP/s "
        f"({base_hw.peak_flops / 1e12:.0f} -> {target_hw.peak_flops / 1e12:.0f} TFLOP/s); a "
        "GEMM row's compute share is its place on the measured GPU's roofline (FLOP time "
        "over weight-read time), the rest is a weight read charged at this GPU's bandwidth "
        "(changed 2026-12-07: whole small-batch rows were scaled by FLOP/s, which made an "
        "A100's batch-1 decode about 40% slow against a published A100 run; "
        "servetune.profiles.fit.scale_perop)",
        "weight streaming, KV reads, elementwise work and the small-batch GEMM floor scaled by "
        f"memory bandwidth ({base_hw.hbm_bandwidth_Bps / 1e12:.2f} -> "
        f"{target_hw.hbm_bandwidth_Bps / 1e12:.3f} TB/s)",
        "efficiencies (fraction of peak reached) assumed equal to the measured GPU's",
        f"decode attention reads KV at {scaled.kv_read_Bps / 1e12:.3f} TB/s, "
        f"{VLLM_KV_FRACTION:.1%} of the datasheet bandwidth: what vLLM's paged decode "
        "attention reaches on an H100 (the published single-request ITL slope, "
        "servetune.profiles.build.VLLM_KV_FRACTION), assumed on this GPU too (changed "
        "2026-12-07: was the contiguous kernel timed on "
        f"{base_hw.name}, {perop.kv_read_Bps / base_hw.hbm_bandwidth_Bps:.1%} of its "
        "bandwidth in attn_decode.csv, which made batched long-context decode fast)",
        HOST_ASSUMPTION,
        "shape ratios target/measured per GPU: "
        + ", ".join(f"{k}={v:.3g}" for k, v in ratios.items()),
        "activation_reserve_bytes estimated by "
        "servetune.profiles.memory.estimate_activation_reserve",
        "memory_bytes: the total the driver reports (servetune.profiles.catalog)",
    ]
    if tp > 1:
        assumptions.append(_allreduce_assumption(target_hw))
    sources = [catalog.DATASHEETS[k] for k in dict.fromkeys((gpu_key, base_key))
               if k in catalog.DATASHEETS]
    calibration = Calibration(
        kind="derived",
        source="derived by servetune profile derive from measured H200 per-operation "
               "timings and datasheets: " + "; ".join(sources),
        files=_calibration_files(meas, paths_relative_to), assumptions=assumptions,
        fit={**{k: round_sig(v) for k, v in target_corr.as_dict().items()}, **corr_fit,
             **_kv_fit(scaled.kv_read_Bps, target_hw)},
    )
    return _new_profile(name or _default_name(gpu_key, arch, tp), target_hw, arch, tp,
                        gpu_memory_utilization, block_size, step_time, calibration)


def profile_header(profile: Profile) -> str:
    """The comment block every shipped profile starts with: memory, KV pool, source."""
    s = profile.memory_summary()
    lines = [f"servetune GPU profile {profile.name} ({profile.calibration.kind})"]
    if profile.hardware is not None:
        lines.append(f"GPU memory: {profile.hardware.memory_bytes:,} B "
                     f"({profile.hardware.memory_bytes / 2**30:.2f} GiB) per GPU, "
                     f"{profile.hardware.name}")
    if "weight_bytes_per_gpu" in s:
        lines.append(
            f"KV pool at gpu_memory_utilization {profile.gpu_memory_utilization}: "
            f"{s['kv_blocks']:,} usable blocks of {profile.block_size} tokens "
            f"({s['kv_tokens']:,} tokens; {s['kv_bytes_per_token']:,.0f} B/token; "
            f"weights {s['weight_bytes_per_gpu'] / 2**30:.2f} GiB/GPU)")
    lines.append(f"Source: {profile.calibration.source}")
    return "\n".join(lines)

