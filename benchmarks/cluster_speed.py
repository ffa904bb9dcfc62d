"""Cluster replay speed: servetune against NVIDIA Dynamo's offline trace replay, side by side.

Both tools replay the same Mooncake-format trace (plain JSON Lines: ``timestamp`` ms,
``input_length``, ``output_length``, ``hash_ids`` of 512-token prefix blocks) with vLLM
replicas and prefix caching on, in three modes: one replica; four replicas under round
robin; four under a KV-aware router. Each run is a fresh process timed end to end (start-up
and trace loading included): wall time, peak resident memory (``/usr/bin/time``'s maximum
RSS) and CPU time; then the tools' own TTFT, TPOT, prefix-cache hit rate and request counts.

Usage (from the repo root, servetune installed)::

    python benchmarks/cluster_speed.py [--trace T.jsonl[.gz] ...] [--long-copies 10]
        [--modes single rr4 kv4] [--repeats 1] [--peer-timing matched|polynomial]
        [--skip-servetune] [--skip-peer] [--json-out R.json] [--markdown-out R.md]

By default the traces are the shared ``mooncake_synthetic_trace.jsonl.gz`` and a ten-times
longer tiling of it (``benchmarks/make_mooncake_trace.py``), both written as plain JSONL to
a temporary folder (the peer does not read gzip; nothing is copied into the repo).

The peer is ``ai-dynamo==1.4.2`` (``pip install 'ai-dynamo==1.4.2'`` in a venv of its own),
run as ``python -m dynamo.replay``; its python is ``$DYNAMO_PYTHON`` or
``/work/dynamo-venv/bin/python``, and without either the peer is skipped with a message.

Settings, matched where the peer has a setting for it (:func:`matched_engine_args`):

=========================  ===================================  ==============================
what                       servetune                            peer (``--extra-engine-args``)
=========================  ===================================  ==============================
engine                     ``--engine vllm`` (default)          ``engine_type: vllm``
KV block                   profile ``memory.block_size`` (16)   ``block_size``
KV capacity                profile's usable blocks (56,821)     ``num_gpu_blocks``
batch width                policy ``max_num_seqs`` (1024)       ``max_num_seqs``
token budget               policy ``max_num_batched_tokens``    ``max_num_batched_tokens``
chunked prefill            on (vLLM)                            ``enable_chunked_prefill``
prefix caching             ``--prefix-caching on``              ``enable_prefix_caching``
preemption                 newest first (recompute)             ``preemption_mode: lifo``
prefill/decode speed       the profile's step-time model        ``planner_profile_data``: an
                                                                NPZ of the same model
                                                                (``--peer-timing matched``)
prefix block of an id      512 tokens                           ``--trace-block-size 512``
replicas                   ``--replicas N``                     ``--num-workers N``
router                     ``--router round_robin`` /           ``--router-mode round_robin``
                           ``--router prefix_aware``            / ``kv_router`` (defaults)
=========================  ===================================  ==============================

How the peer times a step (dynamo-mocker's vLLM scheduler; measured with probe traces, see
``benchmarks/RESULTS.md``, "Cluster replay speed"): ``prefill(total new prompt tokens in the
step) + decode(KV tokens held, mean context of the decoding requests)``, where with an NPZ
both are interpolated from its tables (``prefill_isl -> prefill_ttft_ms``, a 2-D
``decode_itl`` over ``decode_active_kv_tokens x decode_context_length``), and without one it
uses built-in polynomials (``--peer-timing polynomial``: the peer's defaults, not matched to
servetune). :func:`write_peer_timing` fills the NPZ from servetune's step time ``t(T, S, D,
C, W)``:

- decode(kv, ctx) = t(D, D, D, kv, 0) with ``D = max(1, kv / ctx)`` decoding sequences: a
  whole decode step, so the per-step cost (fixed, the GEMM weight-read floor) is here;
- prefill(n) = t(n, 0, 0, 0, n * (a + n / 2)) minus that per-step cost (a step that emits
  tokens charges it once, in its decode part); ``a`` is the trace's mean chunk start (the
  prompt tokens before a chunk, token-weighted, prompts cut into budget-sized chunks from
  their first token): the peer's prefill time depends on the token count only, so the
  attention over earlier context is charged at the trace's average.

The servetune side is the CLI (:func:`servetune_command`); change that one function when
its flags change. The command, settings, both tools' versions, the machine and every
number go to the JSON; the markdown tables are printed (and written with
``--markdown-out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_mooncake_trace  # noqa: E402  (the benchmark folder is not a package)

PROFILE = "h200-llama-3.1-8b"
POLICY = REPO / "configs" / "policies" / "vllm-serve-defaults.yaml"
PEER_PACKAGE = "ai-dynamo"
PEER_VERSION = "1.4.2"
PEER_INSTALL = (f"python3 -m venv /work/dynamo-venv && /work/dynamo-venv/bin/pip install "
                f"'{PEER_PACKAGE}=={PEER_VERSION}'")
PEER_VENV_PYTHON = Path("/work/dynamo-venv/bin/python")
TRACE_BLOCK_TOKENS = 512  # tokens per Mooncake hash id
TIME = "/usr/bin/time"
LONG_COPIES = 10


@dataclass(frozen=True)
class Mode:
    key: str
    title: str
    replicas: int
    servetune_router: str | None  # None: one replica, no router
    peer_router: str


MODES = {
    m.key: m for m in (
        Mode("single", "1 replica", 1, None, "round_robin"),
        Mode("rr4", "4 replicas, round robin", 4, "round_robin", "round_robin"),
        Mode("kv4", "4 replicas, KV-aware router", 4, "prefix_aware", "kv_router"),
    )
}


# --- the two commands ------------------------------------------------------------------------

def servetune_executable() -> list[str]:
    """The ``servetune`` console script beside this interpreter (what a user runs)."""
    script = Path(sys.executable).parent / "servetune"
    return [str(script)] if script.exists() else [sys.executable, "-m", "servetune.cli"]


def servetune_command(trace: Path, mode: Mode, out_json: Path) -> list[str]:
    """The servetune CLI run for ``mode`` on ``trace`` (adjust here when flags change)."""
    cmd = [*servetune_executable(), "simulate", "--trace", str(trace),
           "--trace-format", "mooncake", "--profile", PROFILE, "--policy", str(POLICY),
           "--prefix-caching", "on"]
    if mode.servetune_router is not None:
        cmd += ["--replicas", str(mode.replicas), "--router", mode.servetune_router]
    return cmd + ["--json-out", str(out_json), "-q"]


def peer_command(python: str, trace: Path, mode: Mode, engine_args: dict[str, Any],
                 report: Path) -> list[str]:
    """``python -m dynamo.replay`` for ``mode`` on ``trace``."""
    return [python, "-m", "dynamo.replay", str(trace),
            "--trace-format", "mooncake", "--trace-block-size", str(TRACE_BLOCK_TOKENS),
            "--replay-mode", "offline", "--num-workers", str(mode.replicas),
            "--router-mode", mode.peer_router,
            "--extra-engine-args", json.dumps(engine_args, sort_keys=True),
            "--report-json", str(report)]


def peer_python() -> str | None:
    """The peer's interpreter: ``$DYNAMO_PYTHON``, else the venv's, else None."""
    env = os.environ.get("DYNAMO_PYTHON")
    if env:
        return env if Path(env).exists() else None
    return str(PEER_VENV_PYTHON) if PEER_VENV_PYTHON.exists() else None


# --- matched settings ------------------------------------------------------------------------

def mean_chunk_start(prompts: list[int], budget: int) -> float:
    """Token-weighted mean of the prompt tokens that precede a prefill chunk, prompts cut
    into ``budget``-token chunks from their first token (``a`` in the module docstring)."""
    weighted = 0.0
    for p in prompts:
        full, rest = divmod(p, budget)
        # full chunks start at 0, B, ..., (full-1)B; the last partial one at full*B
        weighted += budget * budget * full * (full - 1) / 2 + rest * full * budget
    return weighted / sum(prompts)


def write_peer_timing(path: Path, prompts: list[int]) -> dict[str, Any]:
    """Write the peer's NPZ timing tables from servetune's profile (module docstring);
    return what was tabulated, for the record."""
    import numpy as np

    from servetune.profiles.shipped import load_profile
    from servetune.profiles.steptime import prefill_attn_pairs
    from servetune.schemas.base import load_document
    from servetune.schemas.policy import Policy

    profile = load_profile(PROFILE)
    policy = load_document(POLICY, Policy)
    step = profile.step_time.seconds
    budget = policy.batching.max_num_batched_tokens
    a = mean_chunk_start(prompts, budget)
    per_step = step(0, 0, 0, 0, 0)
    isl = np.linspace(1.0, float(budget), 257)
    prefill_ms = np.array([1e3 * (step(n, 0, 0, 0, n * a + prefill_attn_pairs(n, 0)) - per_step)
                           for n in isl])
    capacity = float(profile.kv_blocks() * profile.block_size)
    kv = np.linspace(0.0, capacity, 129)
    ctx = np.unique(np.round(np.geomspace(1.0, 2.0**18, 145)))
    itl = np.empty((len(kv), len(ctx)))
    for i, k in enumerate(kv):
        for j, c in enumerate(ctx):
            d = max(1.0, k / c)
            itl[i, j] = 1e3 * step(d, d, d, k, 0)
    np.savez(path, prefill_isl=isl, prefill_ttft_ms=prefill_ms,
             decode_active_kv_tokens=kv, decode_context_length=ctx, decode_itl=itl)
    return {
        "npz": str(path), "mean_chunk_start_tokens": round(a, 1),
        "per_step_ms": round(1e3 * per_step, 4),
        "prefill_ms_at": {str(int(n)): round(float(np.interp(n, isl, prefill_ms)), 3)
                          for n in (512, 2048, 8192)},
        "decode_ms_at": {f"{int(d)} seqs x {c} ctx": round(1e3 * step(d, d, d, d * c, 0), 3)
                         for d, c in ((1, 2048), (64, 2048), (256, 16384))},
        "grid": {"prefill_points": len(isl), "decode_kv_points": len(kv),
                 "decode_ctx_points": len(ctx)},
    }


def matched_engine_args(npz: Path | None) -> dict[str, Any]:
    """The peer's engine settings that match servetune's profile and policy (module
    docstring); ``npz`` None keeps the peer's own polynomial timing."""
    from servetune.profiles.shipped import load_profile
    from servetune.schemas.base import load_document
    from servetune.schemas.policy import Policy

    profile = load_profile(PROFILE)
    batching = load_document(POLICY, Policy).batching
    args: dict[str, Any] = {
        "engine_type": "vllm",
        "block_size": profile.block_size,
        "num_gpu_blocks": profile.kv_blocks(),
        "max_num_seqs": batching.max_num_seqs,
        "max_num_batched_tokens": batching.max_num_batched_tokens,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "preemption_mode": "lifo",
    }
    if npz is not None:
        args["planner_profile_data"] = str(npz)
    return args


# --- running and measuring -------------------------------------------------------------------

def as_installed_env() -> dict[str, str]:
    """The environment for both tools' runs: as after ``pip install``, which byte-compiles
    what it installs, so the processes may read and write ``.pyc`` files. (An editable
    install does not byte-compile, and with ``PYTHONDONTWRITEBYTECODE`` set, as on the
    development machine, every servetune run compiled its modules from source, 0.2-0.3 s,
    while the peer's site-packages were compiled: :func:`byte_compile_servetune`.)"""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def byte_compile_servetune() -> None:
    """Byte-compile the servetune package, as a regular ``pip install`` does."""
    import servetune

    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(servetune.__file__)
                    .parent)], check=True, env=as_installed_env(), stdout=subprocess.DEVNULL)


def timed_run(cmd: list[str], timeout_s: float) -> dict[str, Any]:
    """Run ``cmd`` in a fresh process (:func:`as_installed_env`): wall time around it, and
    (under /usr/bin/time) its peak RSS and CPU seconds; the last lines of stderr when it
    fails."""
    with tempfile.TemporaryDirectory(prefix="cluster-speed-") as tmp:
        tfile = Path(tmp) / "time.txt"
        timed = Path(TIME).exists()
        full = [TIME, "-o", str(tfile), "-f", "%M %U %S", *cmd] if timed else cmd
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(full, capture_output=True, text=True, timeout=timeout_s,
                                  check=False, env=as_installed_env())
        except subprocess.TimeoutExpired:
            return {"rc": None, "wall_s": None, "error": f"timed out after {timeout_s:g} s"}
        wall = time.perf_counter() - t0
        out: dict[str, Any] = {"rc": proc.returncode, "wall_s": wall}
        if timed and tfile.exists():
            last = tfile.read_text().strip().splitlines()[-1].split()
            out["peak_rss_mib"] = int(last[0]) / 1024.0
            out["cpu_s"] = float(last[1]) + float(last[2])
        if proc.returncode != 0:
            tail = [x for x in proc.stderr.strip().splitlines() if x.strip()][-3:]
            out["error"] = " | ".join(tail) or f"exit {proc.returncode}"
        return out


def _stats(d: dict[str, Any], scale: float = 1.0) -> dict[str, float | None]:
    return {k: (None if d.get(k) is None else d[k] * scale) for k in ("mean", "p50", "p99")}


def servetune_hit_rate(summary: dict[str, Any]) -> float | None:
    """Prompt tokens served from the prefix cache / prompt tokens, from servetune's summary
    (the ``prefix_cache`` block is new: the names tried here are the likely ones)."""
    pc = summary.get("prefix_cache")
    if not isinstance(pc, dict):
        return None
    for key in ("hit_rate", "token_hit_rate", "hit_token_ratio", "reused_ratio"):
        if isinstance(pc.get(key), int | float):
            return float(pc[key])
    hit = pc.get("hit_tokens")
    total = pc.get("prompt_tokens")
    if isinstance(hit, int | float) and isinstance(total, int | float) and total > 0:
        return hit / total
    return None


def servetune_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    overall = summary.get("overall", {})
    return {
        "requests": summary.get("requests"),
        "completed": summary.get("completed"),
        "shed": summary.get("shed", 0), "rejected": summary.get("rejected", 0),
        "ttft_s": _stats(overall.get("ttft_s", {})),
        "tpot_s": _stats(overall.get("tpot_s", {})),
        "hit_rate": servetune_hit_rate(summary),
        "inner_s": summary.get("sim_wall_s"),
    }


def peer_metrics(report: dict[str, Any]) -> dict[str, Any]:
    def stats(name: str) -> dict[str, float | None]:
        keys = {"mean": f"mean_{name}_ms", "p50": f"median_{name}_ms", "p99": f"p99_{name}_ms"}
        return {k: (None if report.get(v) is None else report[v] / 1e3)
                for k, v in keys.items()}

    return {
        "requests": report.get("num_requests"),
        "completed": report.get("completed_requests"),
        "shed": 0, "rejected": 0,
        "ttft_s": stats("ttft"), "tpot_s": stats("tpot"),
        # servetune counts cache hits at a request's first admission: so does this ratio
        "hit_rate": report.get("first_admission_prefix_cache_reused_ratio"),
        "hit_rate_all_admissions": report.get("prefix_cache_reused_ratio"),
        "inner_s": None if report.get("wall_time_ms") is None else report["wall_time_ms"] / 1e3,
        "simulated_s": None if report.get("duration_ms") is None else report["duration_ms"] / 1e3,
    }


def measure(cmd: list[str], result_file: Path, parse, repeats: int,
            timeout_s: float) -> dict[str, Any]:
    """``repeats`` timed runs of ``cmd``; the metrics of the last good one (the tools are
    deterministic), every wall time, and their median."""
    runs = []
    metrics = None
    for _ in range(repeats):
        result_file.unlink(missing_ok=True)
        run = timed_run(cmd, timeout_s)
        runs.append(run)
        if run.get("rc") == 0 and result_file.exists():
            metrics = parse(json.loads(result_file.read_text()))
    good = [r for r in runs if r.get("rc") == 0]
    rss = [r["peak_rss_mib"] for r in good if "peak_rss_mib" in r]
    cpu = [r["cpu_s"] for r in good if "cpu_s" in r]
    return {
        "command": cmd, "runs": runs,
        "wall_s": statistics.median(r["wall_s"] for r in good) if good else None,
        "peak_rss_mib": max(rss) if rss else None,
        "cpu_s": statistics.median(cpu) if cpu else None,
        "metrics": metrics,
        "error": next((r["error"] for r in runs if "error" in r), None),
    }


# --- inputs ----------------------------------------------------------------------------------

def prepare_traces(sources: list[Path], long_copies: int, folder: Path) -> list[dict[str, Any]]:
    """Plain JSONL copies of the traces in ``folder`` (the first source also tiled
    ``long_copies`` times when > 1), with what each holds."""
    from servetune.io import sha256_file

    out = []
    for i, src in enumerate(sources):
        rows = make_mooncake_trace.read_rows(src)
        plain = folder / (src.name.removesuffix(".gz").removesuffix(".jsonl") + ".jsonl")
        make_mooncake_trace.write_rows(plain, rows)
        out.append({"name": src.name, "path": plain, "rows": rows})
        if i == 0 and long_copies > 1:
            tiled = make_mooncake_trace.tile(rows, long_copies)
            long_path = folder / f"{plain.stem}-x{long_copies}.jsonl"
            make_mooncake_trace.write_rows(long_path, tiled)
            out.append({"name": f"{src.name} x{long_copies} (make_mooncake_trace.py "
                                f"--copies {long_copies})", "path": long_path, "rows": tiled})
    for t in out:
        rows = t.pop("rows")
        t["requests"] = len(rows)
        t["span_s"] = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1e3
        t["sha256"] = sha256_file(t["path"])
        t["prompts"] = [r["input_length"] for r in rows]
    return out


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem,
            "python": platform.python_version(), "load_avg_1m": round(os.getloadavg()[0], 2),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}


def versions(py: str | None) -> dict[str, str | None]:
    from importlib.metadata import version

    out: dict[str, str | None] = {"servetune": version("servetune"), "peer": None}
    if py is not None:
        probe = subprocess.run(
            [py, "-c", f"from importlib.metadata import version; print(version('{PEER_PACKAGE}'))"],
            capture_output=True, text=True, check=False)
        out["peer"] = probe.stdout.strip() or None
    return out


# --- report ----------------------------------------------------------------------------------

def _fmt(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:,.{digits}f}"


def _triple(s: dict[str, float | None] | None, scale: float, digits: int) -> str:
    if not s:
        return "-"
    return " / ".join(_fmt(s.get(k), scale, digits) for k in ("mean", "p50", "p99"))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(report: dict[str, Any]) -> str:
    """One row per (trace, mode, tool); the last column is the peer's wall time over
    servetune's, on servetune's row."""
    lines = ["| trace | mode | tool | wall (s) | peak RSS (MiB) | CPU (s) | accounted | "
             "TTFT mean / p50 / p99 (s) | TPOT mean / p50 / p99 (ms) | hit rate | "
             "peer / servetune wall |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in report["results"]:
        st, peer = row.get("servetune"), row.get("peer")
        ratio = ""
        if st and peer and st.get("wall_s") and peer.get("wall_s"):
            ratio = f"{peer['wall_s'] / st['wall_s']:.1f}x"
        for tool, r in (("servetune", st), (f"peer ({report['peer_timing']})", peer)):
            if r is None:
                continue
            m = r.get("metrics") or {}
            acc = "-"
            if m.get("requests") is not None:
                done = sum(m.get(k) or 0 for k in ("completed", "shed", "rejected"))
                acc = f"{done:,} / {row['requests']:,}"
            name = tool if r.get("error") is None else f"{tool} (failed: {r['error'][:120]})"
            cells = [row["trace"], row["mode"], name, _fmt(r.get("wall_s")),
                     _fmt(r.get("peak_rss_mib"), digits=0), _fmt(r.get("cpu_s")), acc,
                     _triple(m.get("ttft_s"), 1, 2), _triple(m.get("tpot_s"), 1e3, 1),
                     _pct(m.get("hit_rate")), ratio if tool == "servetune" else ""]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, action="append", default=None,
                        help="Mooncake trace (repeatable; default: the shared synthetic one)")
    parser.add_argument("--long-copies", type=int, default=LONG_COPIES,
                        help="also replay the first trace tiled this many times (1: not)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per cell")
    parser.add_argument("--peer-timing", choices=("matched", "polynomial"), default="matched")
    parser.add_argument("--skip-servetune", action="store_true")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the untimed first run of each tool (numba cache, imports)")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep traces, NPZ and reports here (default: a temporary folder)")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--markdown-out", type=Path, default=None)
    args = parser.parse_args(argv)

    py = None if args.skip_peer else peer_python()
    if not args.skip_peer and py is None:
        where = (f"DYNAMO_PYTHON={os.environ['DYNAMO_PYTHON']} does not exist"
                 if os.environ.get("DYNAMO_PYTHON")
                 else f"{PEER_VENV_PYTHON} not found and DYNAMO_PYTHON unset")
        print(f"cluster_speed: peer skipped: {where}; install it with: {PEER_INSTALL}",
              file=sys.stderr)
    sources = args.trace or [make_mooncake_trace.SHARED_TRACE]
    for s in sources:
        if not s.exists():
            print(f"cluster_speed: error: {s}: file not found", file=sys.stderr)
            return 2
    keep = args.workdir is not None
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cluster-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        traces = prepare_traces(sources, args.long_copies, work)
        timing = None
        if py is not None and args.peer_timing == "matched":
            timing = write_peer_timing(work / "servetune_timing.npz", traces[0]["prompts"])
        engine_args = matched_engine_args(work / "servetune_timing.npz" if timing else None)
        report: dict[str, Any] = {
            "machine": machine(), "versions": versions(py), "peer_install": PEER_INSTALL,
            "profile": PROFILE, "policy": str(POLICY.relative_to(REPO)),
            "peer_timing": args.peer_timing, "peer_engine_args": engine_args,
            "peer_timing_tables": timing,
            "traces": [{k: (str(v) if isinstance(v, Path) else v) for k, v in t.items()
                        if k != "prompts"} for t in traces],
            "results": [],
        }
        if not args.skip_servetune:
            byte_compile_servetune()
        if not args.no_warmup:  # untimed: numba's compile cache, the imports' page cache
            warm = [timed_run(servetune_command(traces[0]["path"], MODES[k], work / "warm.json"),
                              args.timeout_s)
                    for k in ([] if args.skip_servetune else args.modes)]
            report["servetune_warmup_s"] = [r.get("wall_s") for r in warm]
            if py is not None:
                timed_run(peer_command(py, traces[0]["path"], MODES[args.modes[0]],
                                       engine_args, work / "warm-peer.json"), args.timeout_s)
        for t in traces:
            for key in args.modes:
                mode = MODES[key]
                row: dict[str, Any] = {"trace": t["name"], "mode": mode.title,
                                       "requests": t["requests"]}
                tag = f"{Path(t['path']).stem}-{key}"
                if not args.skip_servetune:
                    out = work / f"servetune-{tag}.json"
                    row["servetune"] = measure(servetune_command(t["path"], mode, out), out,
                                               servetune_metrics, args.repeats, args.timeout_s)
                if py is not None:
                    out = work / f"peer-{tag}.json"
                    row["peer"] = measure(peer_command(py, t["path"], mode, engine_args, out),
                                          out, peer_metrics, args.repeats, args.timeout_s)
                report["results"].append(row)
                print(f"cluster_speed: {t['name']}, {mode.title}: " + ", ".join(
                    f"{tool} {_fmt(row[tool]['wall_s'])} s" for tool in ("servetune", "peer")
                    if tool in row), file=sys.stderr)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    table = markdown(report)
    print(table, end="")
    text = json.dumps(report, indent=1, default=str) + "\n"
    if args.json_out is not None:
        args.json_out.write_text(text)
    if args.markdown_out is not None:
        args.markdown_out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
