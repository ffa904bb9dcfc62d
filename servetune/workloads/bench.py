"""Per-request results of a serving benchmark, read to check the simulator against them.

A :class:`BenchRun` holds, per successful request in send order: when the client sent it
(seconds from the first send), its prompt and output tokens, and the measured TTFT and
end-to-end latency; plus how the client drove the load (request rate, a closed-loop
``max_concurrency``) so that the replay can drive the simulator the same way.

Formats (the fields as each client writes them):

- ``vllm-bench``: ``vllm bench serve --save-result --save-detailed`` JSON. Per request
  (parallel lists): ``input_lens``, ``output_lens``, ``ttfts`` (s), ``itls`` (lists, s),
  ``errors`` (``""`` when it succeeded); newer clients add ``start_times`` (the client's
  ``perf_counter`` when the request was sent, after any ``--max-concurrency`` wait),
  ``latencies`` (s, sent to last token) and ``queue_times`` (s waited for a concurrency
  slot). Run facts: ``request_rate`` (``"inf"`` or req/s), ``max_concurrency``
  (null = open loop). Without ``latencies`` the end-to-end latency is TTFT + the sum of
  the ITLs.
- ``sglang-bench``: SGLang ``python -m sglang.bench_serving --output-file F.jsonl
  --output-details``: one JSON object per run, appended (the last line is read); the same
  parallel lists as vLLM's (``input_lens``, ``output_lens``, ``ttfts``, ``itls``,
  ``errors``; some versions nest them under ``details``) with ``request_rate`` and
  ``max_concurrency``. SGLang saves no per-request send times, so only runs whose send
  times follow from the run's facts can be replayed: ``--request-rate inf`` (every
  request sent at once, or as fast as ``--max-concurrency`` lets them).
- ``aiperf``: AIPerf ``profile_export.jsonl`` (one record per request):
  ``metadata.request_start_ns``, ``metrics.input_sequence_length``,
  ``output_sequence_length`` (or ``output_token_count``), ``time_to_first_token``,
  ``request_latency`` (each ``{value, unit}``), ``error``. The run's concurrency is not in
  the per-request file; pass it on the command line (``max_concurrency``).

Not supported: genai-perf's ``profile_export.json`` holds per-request timestamps but
only the prompt and response *texts*, not their token counts (which need the model's
tokenizer); its ``profile_export_genai_perf.json`` holds aggregates only. AIPerf (its
successor) writes token counts per request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from servetune.errors import ServetuneError
from servetune.io import decode_text, read_bytes, sha256_bytes
from servetune.workloads.bench_formats import BENCH_FORMATS
from servetune.workloads.formats import MAX_TOKENS

TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class BenchRun:
    """Successful requests of one benchmark run, in send order (see the module doc)."""

    path: str
    fmt: str
    sha256: str
    send_s: np.ndarray  # float64, seconds from the first send; ascending
    prompt_tokens: np.ndarray  # int64 >= 1
    output_tokens: np.ndarray  # int64 >= 1
    ttft_s: np.ndarray  # float64
    e2e_s: np.ndarray  # float64, send to last token
    intended_s: np.ndarray | None = None  # when the client meant to send (closed loop)
    max_concurrency: int | None = None
    request_rate: float | None = None  # req/s; inf = all at once; None = unknown
    failed: int = 0
    notices: tuple[str, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.send_s)

    @property
    def closed_loop(self) -> bool:
        return self.max_concurrency is not None

    @property
    def tpot_s(self) -> np.ndarray:
        """(E2E - TTFT) / (output - 1) per request; NaN for single-token outputs."""
        steps = (self.output_tokens - 1).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(steps > 0, (self.e2e_s - self.ttft_s) / steps, np.nan)


def _bad(path: str, where: str, what: str) -> ServetuneError:
    return ServetuneError(f"{path}: {where}: {what}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        value = float(value)
    except OverflowError:  # an integer beyond float range
        return None
    return value if math.isfinite(value) else None


def _rate(value: Any, path: str) -> float | None:
    """``request_rate``: ``"inf"``/inf -> inf, a number > 0 -> itself, missing -> None."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise _bad(path, "request_rate",
                       f"expected a number or \"inf\", got {value!r}") from None
    rate = _number(value) if not isinstance(value, float) else value  # inf stays inf
    if rate is None or not rate > 0:
        raise _bad(path, "request_rate", f"expected a number > 0 or \"inf\", got {value!r:.40}")
    return rate


def _concurrency(value: Any, path: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(path, "max_concurrency", f"expected a whole number >= 1 or null, got {value!r}")
    return int(value)


def _list(doc: dict[str, Any], key: str, n: int | None, path: str, required: bool = True
          ) -> list[Any] | None:
    value = doc.get(key)
    if value is None:
        if required:
            raise _bad(path, key, "missing; expected a per-request list (was the run saved "
                       "with per-request details: vllm --save-detailed, sglang --output-details?)")
        return None
    if not isinstance(value, list):
        raise _bad(path, key, f"expected a list, got {type(value).__name__}")
    if n is not None and len(value) != n:
        raise _bad(path, key, f"has {len(value)} entries but input_lens has {n}")
    return value


@dataclass
class _Columns:
    send: list[float] = field(default_factory=list)
    intended: list[float] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)


def _whole(value: Any, low: int) -> int | None:
    """A token count: a whole number in [low, MAX_TOKENS], else None."""
    x = _number(value)
    if x is None or x != int(x) or not low <= x <= MAX_TOKENS:
        return None
    return int(x)


def _lists_run(doc: dict[str, Any], path: str, fmt: str, digest: str,
               max_concurrency: int | None) -> BenchRun:
    """vLLM's and SGLang's parallel per-request lists."""
    inputs = _list(doc, "input_lens", None, path)
    assert inputs is not None
    n = len(inputs)
    if n == 0:
        raise _bad(path, "input_lens", "empty: the run has no requests")
    outputs = _list(doc, "output_lens", n, path)
    ttfts = _list(doc, "ttfts", n, path)
    itls = _list(doc, "itls", n, path, required=False)
    latencies = _list(doc, "latencies", n, path, required=False)
    starts = _list(doc, "start_times", n, path, required=False)
    queues = _list(doc, "queue_times", n, path, required=False)
    errors = _list(doc, "errors", n, path, required=False) or [""] * n
    if itls is None and latencies is None:
        raise _bad(path, "itls", "missing, and no latencies: the end-to-end latency of each "
                   "request cannot be known (save the run with per-request details)")
    assert outputs is not None and ttfts is not None
    rate = _rate(doc.get("request_rate"), path)
    conc = max_concurrency if max_concurrency is not None else _concurrency(
        doc.get("max_concurrency"), path)
    if starts is None and rate != math.inf:
        shown = "unknown" if rate is None else f"{rate:g} req/s"
        tool = ("SGLang's bench_serving saves no per-request send times"
                if fmt == "sglang-bench" else "the file has no start_times")
        raise _bad(path, "start_times", f"{tool}, and the run's request rate is {shown}: "
                   "the requests' arrival times cannot be known. Replay needs per-request "
                   "send times (vllm bench serve --save-detailed, vLLM 0.10 or later) or a "
                   "run at --request-rate inf (optionally with --max-concurrency N)")
    cols = _Columns()
    failed = 0
    for i in range(n):
        row = f"request {i + 1}"
        if errors[i] not in ("", None):
            failed += 1
            continue
        p, o = _whole(inputs[i], 1), _whole(outputs[i], 0)
        if p is None:
            raise _bad(path, f"input_lens, {row}",
                       f"expected a whole number >= 1, got {inputs[i]!r}")
        if o is None:
            raise _bad(path, f"output_lens, {row}",
                       f"expected a whole number >= 0, got {outputs[i]!r}")
        if o == 0:
            failed += 1
            continue
        ttft = _number(ttfts[i])
        if ttft is None or ttft < 0:
            raise _bad(path, f"ttfts, {row}", f"expected seconds >= 0, got {ttfts[i]!r}")
        if latencies is not None:
            e2e = _number(latencies[i])
            if e2e is None or e2e < ttft:
                raise _bad(path, f"latencies, {row}",
                           f"expected seconds >= its TTFT ({ttft:g}), got {latencies[i]!r}")
        else:
            assert itls is not None
            gaps = itls[i]
            if not isinstance(gaps, list) or any(_number(g) is None or g < 0 for g in gaps):
                raise _bad(path, f"itls, {row}", "expected a list of seconds >= 0")
            e2e = ttft + float(sum(gaps))
            if not math.isfinite(e2e):
                raise _bad(path, f"itls, {row}", "the gaps add up to more than any run lasts")
        if starts is not None:
            t = _number(starts[i])
            if t is None:
                raise _bad(path, f"start_times, {row}", f"expected seconds, got {starts[i]!r}")
        else:
            t = 0.0  # request_rate inf: all sent at once (or as slots free up)
        wait = 0.0
        if queues is not None:
            q = _number(queues[i])
            if q is None or q < 0:
                raise _bad(path, f"queue_times, {row}", f"expected seconds >= 0, got {queues[i]!r}")
            wait = q
        cols.send.append(t)
        cols.intended.append(t - wait)
        cols.prompt.append(p)
        cols.output.append(o)
        cols.ttft.append(ttft)
        cols.e2e.append(e2e)
    notices = []
    if failed:
        notices.append(f"{failed} failed request(s) (an error or no output) left out")
    if latencies is None:
        notices.append("no per-request latencies in the file: end-to-end = TTFT + sum of ITLs")
    intended: list[float] | None = cols.intended
    if starts is None:
        intended = [0.0] * len(cols.send)
    elif queues is None and conc is not None and rate != math.inf:
        intended = None  # unknown: the closed loop is replayed from the measured sends
        notices.append("no queue_times: the client's intended send times are unknown; the "
                       "closed loop starts from the measured send times")
    return _finish(path, fmt, digest, cols, intended, conc, rate, failed, notices)


def _finish(path: str, fmt: str, digest: str, cols: _Columns, intended: list[float] | None,
            conc: int | None, rate: float | None, failed: int, notices: list[str]) -> BenchRun:
    if not cols.send:
        raise ServetuneError(f"{path}: no successful request to compare with")
    send = np.asarray(cols.send, dtype=np.float64)
    order = np.argsort(send, kind="stable")
    base = float(send.min())
    inten = None
    if intended is not None:
        inten = np.asarray(intended, dtype=np.float64)[order] - base
        inten = np.minimum(np.maximum.accumulate(np.maximum(inten, 0.0)), send[order] - base)
    return BenchRun(
        path=path, fmt=fmt, sha256=digest,
        send_s=send[order] - base,
        prompt_tokens=np.asarray(cols.prompt, dtype=np.int64)[order],
        output_tokens=np.asarray(cols.output, dtype=np.int64)[order],
        ttft_s=np.asarray(cols.ttft, dtype=np.float64)[order],
        e2e_s=np.asarray(cols.e2e, dtype=np.float64)[order],
        intended_s=inten, max_concurrency=conc, request_rate=rate, failed=failed,
        notices=tuple(notices),
    )


def _metric_s(metrics: dict[str, Any], key: str, path: str, row: str) -> float | None:
    entry = metrics.get(key)
    if entry is None:
        return None
    value = entry.get("value") if isinstance(entry, dict) else entry
    unit = entry.get("unit", "ms") if isinstance(entry, dict) else "ms"
    x = _number(value)
    if x is None or x < 0 or not isinstance(unit, str) or unit not in TIME_UNITS:
        raise _bad(path, f"{row}, metrics.{key}",
                   f"expected {{value: >= 0, unit: s|ms|us|ns}}, got {entry!r}")
    return x * TIME_UNITS[unit]


def _metric_tokens(metrics: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        entry = metrics.get(key)
        if entry is not None:
            return entry.get("value") if isinstance(entry, dict) else entry
    return None


def _aiperf_run(lines: list[str], path: str, digest: str,
                max_concurrency: int | None) -> BenchRun:
    cols = _Columns()
    failed = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        row = f"line {lineno}"
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            raise _bad(path, row, "not valid JSON") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("metadata"), dict):
            raise _bad(path, row, "expected an AIPerf record with metadata and metrics")
        if rec.get("error") is not None or rec["metadata"].get("was_cancelled"):
            failed += 1
            continue
        metrics = rec.get("metrics")
        if not isinstance(metrics, dict):
            raise _bad(path, f"{row}, metrics", "missing for a request without an error")
        start = _number(rec["metadata"].get("request_start_ns"))
        if start is None:
            raise _bad(path, f"{row}, metadata.request_start_ns",
                       f"expected nanoseconds, got {rec['metadata'].get('request_start_ns')!r}")
        raw_p = _metric_tokens(metrics, ("input_sequence_length",))
        raw_o = _metric_tokens(metrics, ("output_sequence_length", "output_token_count"))
        p, o = _whole(raw_p, 1), _whole(raw_o, 0)
        if p is None:
            raise _bad(path, f"{row}, metrics.input_sequence_length",
                       f"expected a whole number >= 1, got {raw_p!r}")
        if o is None:
            raise _bad(path, f"{row}, metrics.output_sequence_length",
                       f"expected a whole number >= 0, got {raw_o!r}")
        if o == 0:
            failed += 1
            continue
        ttft = _metric_s(metrics, "time_to_first_token", path, row)
        e2e = _metric_s(metrics, "request_latency", path, row)
        if ttft is None or e2e is None:
            raise _bad(path, row, "needs metrics time_to_first_token and request_latency "
                       "(a streaming run)")
        cols.send.append(start * 1e-9)
        cols.intended.append(start * 1e-9)
        cols.prompt.append(p)
        cols.output.append(o)
        cols.ttft.append(ttft)
        cols.e2e.append(e2e)
    notices = [f"{failed} failed request(s) left out"] if failed else []
    if max_concurrency is not None:
        notices.append("closed loop from --max-concurrency; the file does not record the "
                       "intended send times, so the replay starts from the measured ones")
    return _finish(path, "aiperf", digest, cols, None if max_concurrency else cols.intended,
                   max_concurrency, None, failed, notices)


def detect_bench_format(text: str, path: str) -> str:
    """``vllm-bench`` | ``sglang-bench`` | ``aiperf`` from the file's content."""
    stripped = text.lstrip("\ufeff").strip()
    if not stripped:
        raise ServetuneError(f"{path}: the file is empty; expected a benchmark result")
    try:
        doc = json.loads(stripped)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict):
        if "experiments" in doc or "profile_export" in Path(path).name and "requests" in doc:
            raise ServetuneError(
                f"{path}: a genai-perf profile export: it holds per-request timestamps but "
                "not the prompt and output token counts, which replay needs; rerun with "
                "AIPerf and give its profile_export.jsonl"
            )
        if "metadata" in doc and "metrics" in doc:
            return "aiperf"
        if str(doc.get("backend", "")).startswith("sglang") or (
            "details" in doc and isinstance(doc["details"], dict)
        ):
            return "sglang-bench"
        return "vllm-bench"
    first = stripped.split("\n", 1)[0]
    try:
        rec = json.loads(first)
    except (ValueError, RecursionError):
        raise ServetuneError(
            f"{path}: not JSON or JSON Lines; expected a vllm bench serve --save-result "
            "JSON, an SGLang bench_serving --output-file JSONL or an AIPerf "
            "profile_export.jsonl"
        ) from None
    if isinstance(rec, dict) and "metadata" in rec:
        return "aiperf"
    return "sglang-bench"


def load_bench_run(
    path: str | Path,
    fmt: str | None = None,
    max_concurrency: int | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> BenchRun:
    """Read a benchmark result file (``fmt`` one of :data:`BENCH_FORMATS`, detected when
    None). ``max_concurrency`` overrides (or, for AIPerf, supplies) the run's closed-loop
    concurrency. Errors name the file, the field and the request."""
    p = str(path)
    if fmt is not None and fmt not in BENCH_FORMATS:
        raise ServetuneError(
            f"argument `bench_format` {fmt!r}: unknown; use one of {', '.join(BENCH_FORMATS)}"
        )
    if max_concurrency is not None and max_concurrency < 1:
        raise ServetuneError(f"argument `max_concurrency` must be >= 1 (got {max_concurrency})")
    data = read_bytes(p, "benchmark result")
    digest = sha256_bytes(data)
    text = decode_text(data, p, "benchmark result")
    fmt = fmt or detect_bench_format(text, p)
    if fmt == "aiperf":
        run = _aiperf_run(text.split("\n"), p, digest, max_concurrency)
    else:
        if fmt == "sglang-bench":
            lines = [ln for ln in text.split("\n") if ln.strip()]
            if not lines:
                raise ServetuneError(f"{p}: the file is empty; expected a benchmark result")
            try:
                doc = json.loads(lines[-1]) if len(lines) > 1 else json.loads(text)
            except (ValueError, RecursionError):
                raise _bad(p, f"line {len(lines)}", "not valid JSON") from None
        else:
            try:
                doc = json.loads(text)
            except (ValueError, RecursionError):
                raise ServetuneError(
                    f"{p}: not valid JSON; expected a vllm bench serve --save-result file"
                ) from None
        if not isinstance(doc, dict):
            raise ServetuneError(f"{p}: expected a JSON object (one benchmark run)")
        if isinstance(doc.get("details"), dict):
            doc = {**doc, **doc["details"]}
        run = _lists_run(doc, p, fmt, digest, max_concurrency)
        if fmt == "sglang-bench" and len([ln for ln in text.split("\n") if ln.strip()]) > 1:
            run = _with_notice(run, "the file holds several runs; the last one is compared")
    if on_notice is not None:
        for notice in run.notices:
            on_notice(notice)
    return run


def _with_notice(run: BenchRun, notice: str) -> BenchRun:
    return replace(run, notices=(*run.notices, notice))


def vllm_detailed_result(
    send_s: np.ndarray, prompt_tokens: np.ndarray, output_tokens: np.ndarray,
    first_token_s: np.ndarray, finish_s: np.ndarray, *, request_rate: float | str = "inf",
    max_concurrency: int | None = None, queue_s: np.ndarray | None = None,
) -> dict[str, Any]:
    """A ``vllm bench serve --save-result --save-detailed`` document from per-request
    times (absolute seconds): the layout the ``vllm-bench`` reader takes. The ITLs are
    evenly spread (a simulator does not time each token)."""
    n = len(send_s)
    ttft = np.asarray(first_token_s) - np.asarray(send_s)
    lat = np.asarray(finish_s) - np.asarray(send_s)
    itls = []
    for i in range(n):
        k = int(output_tokens[i]) - 1
        itls.append([float((lat[i] - ttft[i]) / k)] * k if k > 0 else [])
    duration = float(np.max(finish_s) - np.min(send_s))
    doc: dict[str, Any] = {
        "backend": "vllm", "request_rate": request_rate, "max_concurrency": max_concurrency,
        "duration": duration, "completed": n, "failed": 0,
        "total_input_tokens": int(np.sum(prompt_tokens)),
        "total_output_tokens": int(np.sum(output_tokens)),
        "request_throughput": n / duration if duration > 0 else 0.0,
        "output_throughput": float(np.sum(output_tokens)) / duration if duration > 0 else 0.0,
        "input_lens": [int(x) for x in prompt_tokens],
        "output_lens": [int(x) for x in output_tokens],
        "ttfts": [float(x) for x in ttft],
        "itls": itls,
        "latencies": [float(x) for x in lat],
        "start_times": [float(x) for x in send_s],
        "errors": [""] * n,
    }
    if queue_s is not None:
        doc["queue_times"] = [float(x) for x in queue_s]
    return doc
