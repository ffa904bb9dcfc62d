"""``servetune profile measure``: time one layer's operations and whole steps on a CUDA GPU.

Writes the CSVs :mod:`servetune.profiles.measurements` reads (``linear.csv``, ``elementwise.csv``,
``attn_prefill.csv``, ``attn_decode.csv``, ``lm_head.csv``, ``step_graph_<model>.csv``,
``env.txt``), so that ``servetune profile fit`` can calibrate a profile for this GPU.

Method (the one behind ``gpu_measurements/``): random bf16 weights (timings do not
depend on values); each operation is warmed up, then timed repeatedly between two CUDA
events with a synchronisation after each, and the median is kept. Whole steps (every layer
plus the LM head and argmax, decode sequences against a contiguous KV cache plus an
optional causal prefill chunk) are captured once as a CUDA graph and replayed, which is how
serving engines run them, so they pay no Python launch cost.

These are GPU times only. A serving engine's host work per step (scheduling, input
preparation, sampling, detokenization, output processing) is not in them: a whole step
timed through a real engine would need that engine, which this module does not drive.
``env.txt`` records this (its ``host`` line), ``profile fit`` leaves the profile's
``host_s_per_step`` / ``host_s_per_seq`` null, and the simulator adds the engine's
defaults from :mod:`servetune.engines` to every step.

Needs the optional ``gpu`` extra (PyTorch); without PyTorch or without a CUDA device it
raises a ServetuneError (exit 2) before writing anything.

``device="cpu"`` (Python API only; the CLI always uses CUDA) runs the same code on the CPU
so that it can be tested without a GPU: ``time.perf_counter`` replaces CUDA events (and the
minimum of the repetitions their median), PyTorch runs on one thread, and whole steps run
eagerly (CUDA graphs are CUDA-only), so ``graph_ms`` is the eager time.
Those numbers time the CPU, not a GPU; ``env.txt`` then names no GPU and ``profile fit``
needs ``--gpu``. Use it with a tiny architecture and a small :class:`MeasureGrid`.
"""

from __future__ import annotations

import csv
import io
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servetune.errors import ServetuneError
from servetune.io import write_text_atomic
from servetune.profiles.catalog import MODELS
from servetune.profiles.schema import ModelArch

GEMM_TOKENS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
               3072, 4096, 6144, 8192, 12288, 16384)
PREFILL_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
CHUNKS = ((2048, 512), (8192, 512), (8192, 2048), (16384, 2048))  # (prefix, chunk)
DECODE_BATCH = (1, 4, 8, 16, 32, 64, 128, 256, 512)
DECODE_CONTEXT = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
LM_ROWS = (1, 8, 32, 64, 128, 256, 512, 1024)
STEP_GRID_DECODE = (0, 1, 8, 32, 64, 128, 256, 512)
STEP_GRID_CONTEXT = (512, 2048, 8192)
STEP_GRID_CHUNK = (0, 512, 2048)
# (decode_seqs, context, prefill_tokens) beyond the grid, as in scripts/step_graph.py: long
# prefill-only chunks and mixed steps, so that whole steps reach the token budgets engines use
STEP_EXTRA = ((0, 512, 256), (0, 512, 1024), (0, 512, 4096), (0, 512, 8192),
              (32, 2048, 256), (32, 2048, 1024), (32, 2048, 4096), (128, 1024, 1024))
DECODE_MAX_KV_TOKENS = 2_000_000  # batch * context above this is not timed


@dataclass(frozen=True)
class MeasureGrid:
    """The shapes that are timed (the GPU defaults are the module constants)."""

    gemm_tokens: tuple[int, ...] = GEMM_TOKENS
    prefill_tokens: tuple[int, ...] = PREFILL_TOKENS
    chunks: tuple[tuple[int, int], ...] = CHUNKS
    decode_batch: tuple[int, ...] = DECODE_BATCH
    decode_context: tuple[int, ...] = DECODE_CONTEXT
    decode_max_kv_tokens: int = DECODE_MAX_KV_TOKENS
    lm_rows: tuple[int, ...] = LM_ROWS
    step_decode: tuple[int, ...] = STEP_GRID_DECODE
    step_context: tuple[int, ...] = STEP_GRID_CONTEXT
    step_chunk: tuple[int, ...] = STEP_GRID_CHUNK
    step_extra: tuple[tuple[int, int, int], ...] = STEP_EXTRA

    def step_shapes(self) -> list[tuple[int, int, int]]:
        """Whole-step shapes (decode_seqs, context, prefill_tokens) in timing order; a
        prefill-only step is timed once per chunk size."""
        shapes = [(n_decode, ctx, chunk)
                  for chunk in self.step_chunk for n_decode in self.step_decode
                  for ctx in self.step_context
                  if n_decode or (chunk and ctx == self.step_context[0])]
        return shapes + [x for x in self.step_extra if x not in shapes]


GPU_GRID = MeasureGrid()
CPU_KV_BUDGET_BYTES = 1 << 30  # stands for free GPU memory when whole steps run on the CPU


class _Clock:
    """Times one call in milliseconds: between CUDA events on the GPU, with
    ``time.perf_counter`` on the CPU (where every operation is synchronous)."""

    def __init__(self, torch: Any, device: str) -> None:
        self.torch = torch
        self.cuda = device == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time_ms(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            self.begin.record()
            fn()
            self.end.record()
            self.torch.cuda.synchronize()
            return float(self.begin.elapsed_time(self.end))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def summary(self, times: list[float]) -> float:
        """The median on the GPU (the method of ``gpu_measurements/``); the minimum on the
        CPU, whose timings other processes only ever lengthen (tests share the cores)."""
        ordered = sorted(times)
        return ordered[len(ordered) // 2] if self.cuda else ordered[0]


def _torch(device: str = "cuda") -> Any:
    try:  # lazy: torch is an optional extra (servetune[gpu])
        import torch
    except ImportError:
        raise ServetuneError(
            "profile measure needs PyTorch with CUDA: pip install 'servetune[gpu]' on a "
            "machine with an NVIDIA GPU"
        ) from None
    if _version(torch.__version__) < (2, 5):
        raise ServetuneError(
            f"profile measure needs PyTorch >= 2.5 (scaled_dot_product_attention with "
            f"enable_gqa, rms_norm); this is {torch.__version__}: pip install -U 'torch>=2.5'"
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise ServetuneError(
            "profile measure needs a CUDA GPU, and torch.cuda.is_available() is False here; "
            "run it on the GPU machine you want to profile"
        )
    return torch


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as ``2.13.0+cpu``."""
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


class _Csv:
    def __init__(self, header: list[str]) -> None:
        self.buf = io.StringIO()
        self.writer = csv.writer(self.buf, lineterminator="\n")
        self.writer.writerow(header)

    def row(self, *values: object) -> None:
        self.writer.writerow(values)

    def text(self) -> str:
        return self.buf.getvalue()


def measure(
    output: str | Path,
    *,
    models: list[str | ModelArch] | tuple[str | ModelArch, ...] = ("llama-3.1-8b",),
    whole_steps: bool = True,
    budget_s: float = 600.0,
    log: Callable[[str], None] = print,
    device: str = "cuda",
    grid: MeasureGrid = GPU_GRID,
) -> list[Path]:
    """Time everything for ``models`` (catalog names or architectures) and write the CSVs
    into ``output``; returns the paths written. ``device="cpu"`` is for tests (module
    docstring)."""
    if device not in ("cuda", "cpu"):
        raise ServetuneError(f"device {device!r}: expected 'cuda' (or 'cpu' for tests)")
    archs = []
    for model in models:
        if isinstance(model, ModelArch):
            archs.append(model)
        elif model in MODELS:
            archs.append(MODELS[model])
        else:
            raise ServetuneError(
                f"argument `models` {model!r}: unknown (built in: {', '.join(MODELS)})"
            )
    for arch in archs:
        if arch.dtype != "bf16":
            raise ServetuneError(
                f"argument `models` {arch.name!r}: dtype {arch.dtype!r}; profile measure "
                "times bf16 kernels only (fit expects rows of the model's dtype)"
            )
    torch = _torch(device)
    if device == "cuda":
        return _measure(torch, archs, Path(output), whole_steps, budget_s, log, device, grid)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # other processes on the cores would stall a multi-threaded op
    try:
        return _measure(torch, archs, Path(output), whole_steps, budget_s, log, device, grid)
    finally:
        torch.set_num_threads(threads)


def _measure(torch: Any, archs: list[ModelArch], out: Path, whole_steps: bool,
             budget_s: float, log: Callable[[str], None], device: str, grid: MeasureGrid
             ) -> list[Path]:
    import torch.nn.functional as F  # lazy: the optional torch, present (see _torch)

    dev = device
    dt = torch.bfloat16
    clock = _Clock(torch, device)
    start = time.monotonic()

    def out_of_time() -> bool:
        return time.monotonic() - start > budget_s

    def typical_ms(fn: Callable[[], object], reps: int | None = None) -> float:
        """Warm up, then time ``fn`` about 30 ms' worth of times (5 to 200) and summarise."""
        for _ in range(3):
            fn()
        clock.sync()
        once = max(clock.time_ms(fn), 1e-3)
        n = reps or int(min(200, max(5, 30.0 / once)))
        return clock.summary([clock.time_ms(fn) for _ in range(n)])

    linear = _Csv(["model", "op", "tokens", "k", "n", "dtype", "ms", "tflops"])
    element = _Csv(["model", "tokens", "ms"])
    prefill = _Csv(["model", "batch", "tokens", "ms"])
    decode = _Csv(["model", "batch", "context", "ms", "kv_GBps"])
    lm_head = _Csv(["model", "tokens", "vocab", "ms"])
    written: list[Path] = []
    step_tables: list[tuple[Path, str]] = []

    for arch in archs:
        h, inter, qh, kvh, hd = arch.hidden, arch.intermediate, arch.heads, arch.kv_heads, \
            arch.head_dim
        shapes = {"qkv": (h, (qh + 2 * kvh) * hd), "o": (qh * hd, h),
                  "gate_up": (h, 2 * inter), "down": (inter, h)}
        weights = {op: torch.randn(n, k, device=dev, dtype=dt) * 0.02
                   for op, (k, n) in shapes.items()}
        norm_w = torch.ones(h, device=dev, dtype=dt)
        for tokens in grid.gemm_tokens:
            if out_of_time():
                break
            for op, (k, n) in shapes.items():
                x = torch.randn(tokens, k, device=dev, dtype=dt)
                w = weights[op]
                ms = typical_ms(lambda x=x, w=w: F.linear(x, w))
                linear.row(arch.name, op, tokens, k, n, "bf16", f"{ms:.5f}",
                           f"{2 * tokens * k * n / ms / 1e9:.2f}")
            hidden = torch.randn(tokens, h, device=dev, dtype=dt)
            gate_up = torch.randn(tokens, 2 * inter, device=dev, dtype=dt)
            qk = torch.randn(tokens, (qh + kvh) * hd, device=dev, dtype=dt)
            rot = torch.randn_like(qk)

            def layer_elementwise(hidden=hidden, gate_up=gate_up, qk=qk, rot=rot, h=h,
                                  norm_w=norm_w):
                normed = F.rms_norm(hidden, (h,), norm_w)
                resid = hidden + normed
                normed2 = F.rms_norm(resid, (h,), norm_w)
                g, u = gate_up.chunk(2, dim=-1)
                return resid + normed2, F.silu(g) * u, qk * rot + qk

            element.row(arch.name, tokens, f"{typical_ms(layer_elementwise):.5f}")
        del weights
        log(f"{arch.name}: GEMMs and elementwise done")

        for n_tok in grid.prefill_tokens:
            if out_of_time():
                break
            q = torch.randn(1, qh, n_tok, hd, device=dev, dtype=dt)
            kv = torch.randn(1, kvh, n_tok, hd, device=dev, dtype=dt)
            ms = typical_ms(lambda q=q, kv=kv: F.scaled_dot_product_attention(
                q, kv, kv, is_causal=True, enable_gqa=True))
            prefill.row(arch.name, 1, n_tok, f"{ms:.5f}")
        for prefix, chunk in grid.chunks:
            if out_of_time():
                break
            q = torch.randn(1, qh, chunk, hd, device=dev, dtype=dt)
            kv = torch.randn(1, kvh, prefix + chunk, hd, device=dev, dtype=dt)
            # unmasked: an upper bound of the bottom-right causal chunk
            ms = typical_ms(lambda q=q, kv=kv: F.scaled_dot_product_attention(
                q, kv, kv, enable_gqa=True))
            prefill.row(arch.name, f"chunk_prefix{prefix}", chunk, f"{ms:.5f}")
        for batch in grid.decode_batch:
            for ctx in grid.decode_context:
                if batch * ctx > grid.decode_max_kv_tokens or out_of_time():
                    continue
                q = torch.randn(batch, qh, 1, hd, device=dev, dtype=dt)
                kv = torch.randn(batch, kvh, ctx, hd, device=dev, dtype=dt)
                ms = typical_ms(lambda q=q, kv=kv: F.scaled_dot_product_attention(
                    q, kv, kv, enable_gqa=True))
                kv_bytes = 2 * batch * kvh * ctx * hd * 2
                decode.row(arch.name, batch, ctx, f"{ms:.5f}", f"{kv_bytes / ms / 1e6:.1f}")
        log(f"{arch.name}: attention done")

        lm_w = torch.randn(arch.vocab, h, device=dev, dtype=dt) * 0.02
        for rows in grid.lm_rows:
            x = torch.randn(rows, h, device=dev, dtype=dt)
            ms = typical_ms(lambda x=x, w=lm_w: torch.argmax(F.linear(x, w).float(), dim=-1))
            lm_head.row(arch.name, rows, arch.vocab, f"{ms:.5f}")
        del lm_w
        if device == "cuda":
            torch.cuda.empty_cache()

        if whole_steps and not out_of_time():
            text = _whole_steps(torch, F, arch, out_of_time, log, device, grid)
            if text.count("\n") > 1:  # a header and at least one row
                step_tables.append((out / f"step_graph_{arch.name}.csv", text))

    # every file at the end, so that an error part-way leaves no output behind
    for path, text in step_tables:
        write_text_atomic(path, text)
        written.append(path)
    for name, table in (("linear.csv", linear), ("elementwise.csv", element),
                        ("attn_prefill.csv", prefill), ("attn_decode.csv", decode),
                        ("lm_head.csv", lm_head)):
        write_text_atomic(out / name, table.text())
        written.append(out / name)
    write_text_atomic(out / "env.txt", _env_text(torch, device))
    written.append(out / "env.txt")
    return written


HOST_NOTE = ("host not timed: whole steps are graph replays (GPU time only); the engine's "
             "host cost per step is added from servetune.engines defaults\n")


def _env_text(torch: Any, device: str) -> str:
    """``env.txt`` as in ``gpu_measurements/`` (``profile fit`` reads the device line)."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        return (f"torch {torch.__version__} cuda {torch.version.cuda}\n"
                f"device {props.name} sms {props.multi_processor_count} "
                f"mem_total {total} mem_free {free}\n" + HOST_NOTE)
    # no GPU name, so that fit cannot mistake CPU timings for a GPU's (it needs --gpu)
    return (f"torch {torch.__version__} cpu\n"
            f"device cpu sms {os.cpu_count() or 1} mem_total 0 mem_free 0\n"
            "note: timed on the CPU (servetune tests), not a GPU profile\n" + HOST_NOTE)


def _whole_steps(torch: Any, F: Any, arch: ModelArch, out_of_time: Callable[[], bool],
                 log: Callable[[str], None], device: str = "cuda",
                 grid: MeasureGrid = GPU_GRID) -> str:
    """Whole steps replayed from CUDA graphs (see the module docstring); run eagerly on the
    CPU."""
    dev, dt = device, torch.bfloat16
    cuda = device == "cuda"
    clock = _Clock(torch, device)
    h, inter, qh, kvh, hd = arch.hidden, arch.intermediate, arch.heads, arch.kv_heads, \
        arch.head_dim
    scale = 0.02
    oom = torch.OutOfMemoryError
    table = _Csv(["model", "decode_seqs", "context", "prefill_tokens", "graph_ms", "eager_ms"])
    try:
        layers = [
            {
                "qkv": torch.randn((qh + 2 * kvh) * hd, h, device=dev, dtype=dt) * scale,
                "o": torch.randn(h, qh * hd, device=dev, dtype=dt) * scale,
                "gate_up": torch.randn(2 * inter, h, device=dev, dtype=dt) * scale,
                "down": torch.randn(h, inter, device=dev, dtype=dt) * scale,
                "norm": torch.ones(h, device=dev, dtype=dt),
            }
            for _ in range(arch.layers)
        ]
        lm_w = torch.randn(arch.vocab, h, device=dev, dtype=dt) * scale
    except oom:
        log(f"{arch.name}: whole steps skipped, its {arch.layers} layers of weights do not "
            f"fit in {device} memory")
        if cuda:
            torch.cuda.empty_cache()
        return table.text()
    free = torch.cuda.mem_get_info()[0] if cuda else CPU_KV_BUDGET_BYTES
    kv_budget_tokens = int(0.6 * free / (arch.layers * kvh * hd * 2 * 2))

    def forward(x, caches, n_decode, n_prefill):
        for layer, (k_cache, v_cache) in zip(layers, caches, strict=True):
            qkv = F.linear(F.rms_norm(x, (h,), layer["norm"]), layer["qkv"])
            q, k, v = qkv.split([qh * hd, kvh * hd, kvh * hd], dim=-1)
            q = q + q * 1e-4  # rotary stand-in
            k = k + k * 1e-4
            parts = []
            if n_decode:
                qd = q[:n_decode].view(n_decode, qh, 1, hd)
                parts.append(F.scaled_dot_product_attention(
                    qd, k_cache, v_cache, enable_gqa=True).reshape(n_decode, qh * hd))
            if n_prefill:
                def heads(t, n):
                    return t[n_decode:].view(1, n_prefill, n, hd).transpose(1, 2)

                a = F.scaled_dot_product_attention(heads(q, qh), heads(k, kvh), heads(v, kvh),
                                                   is_causal=True, enable_gqa=True)
                parts.append(a.transpose(1, 2).reshape(n_prefill, qh * hd))
            attn = torch.cat(parts) if len(parts) > 1 else parts[0]
            x = x + F.linear(attn, layer["o"])
            g, u = F.linear(F.rms_norm(x, (h,), layer["norm"]), layer["gate_up"]).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, layer["down"])
        rows = x[:n_decode] if not n_prefill else torch.cat([x[:n_decode], x[-1:]])
        return torch.argmax(F.linear(rows, lm_w).float(), dim=-1)

    for n_decode, ctx, chunk in grid.step_shapes():
        if n_decode * ctx > kv_budget_tokens or out_of_time():
            continue
        try:
            graph_ms, eager = _time_step(torch, clock, forward, arch, device, n_decode, ctx,
                                         chunk)
        except oom:  # as in scripts/step_graph.py: skip the shape, keep the others
            log(f"{arch.name} step decode={n_decode} ctx={ctx} chunk={chunk}: out of memory")
            if cuda:
                torch.cuda.empty_cache()
            continue
        if cuda:
            torch.cuda.empty_cache()  # this shape's graph pool and KV caches
        table.row(arch.name, n_decode, ctx if n_decode else 0, chunk,
                  f"{graph_ms:.4f}", f"{eager:.4f}")
        log(f"{arch.name} step decode={n_decode} ctx={ctx} chunk={chunk}: {graph_ms:.3f} ms")
    return table.text()


def _time_step(torch: Any, clock: _Clock, forward: Callable[..., Any], arch: ModelArch,
               device: str, n_decode: int, ctx: int, chunk: int) -> tuple[float, float]:
    """(median graph-replay ms, mean eager ms) of one whole step (both eager on the CPU)."""
    dev, dt, cuda = device, torch.bfloat16, device == "cuda"
    kvh, hd = arch.kv_heads, arch.head_dim
    caches = [
        (torch.randn(n_decode, kvh, ctx, hd, device=dev, dtype=dt),
         torch.randn(n_decode, kvh, ctx, hd, device=dev, dtype=dt))
        if n_decode else (None, None)
        for _ in range(arch.layers)
    ]
    x = torch.randn(n_decode + chunk, arch.hidden, device=dev, dtype=dt)

    def step():
        return forward(x, caches, n_decode, chunk)

    graph = None
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = graph.replay
    else:
        replay = step  # CUDA graphs are CUDA-only: the CPU runs eagerly
    for _ in range(3):
        replay()
    clock.sync()
    graph_ms = clock.summary([clock.time_ms(replay) for _ in range(15)])
    clock.sync()
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    clock.sync()
    eager = (time.perf_counter() - t0) * 1e3 / 3
    return graph_ms, eager  # the caller frees the graph and caches
