"""``servetune profile measure``: time one layer's operations and whole steps on a CUDA GPU.

Writes the CSVs :mod:`servetune.measurements` reads (``linear.csv``, ``elementwise.csv``,
``attn_prefill.csv``, ``attn_decode.csv``, ``lm_head.csv``, ``step_graph_<model>.csv``,
``env.txt``), so that ``servetune profile fit`` can calibrate a profile for this GPU.

Method (the one behind ``gpu_measurements/``): random bf16 weights (timings do not
depend on values); each operation is warmed up, then timed repeatedly between two CUDA
events with a synchronisation after each, and the median is kept. Whole steps (every layer
plus the LM head and argmax, decode sequences against a contiguous KV cache plus an
optional causal prefill chunk) are captured once as a CUDA graph and replayed, which is how
serving engines run them, so they pay no Python launch cost.

Needs the optional ``gpu`` extra (PyTorch); without PyTorch or without a CUDA device it
raises a ServetuneError (exit 2) before writing anything.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servetune.catalog import MODELS
from servetune.errors import ServetuneError
from servetune.schemas.base import write_text_atomic

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


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ServetuneError(
            "profile measure needs PyTorch with CUDA: pip install 'servetune[gpu]' on a "
            "machine with an NVIDIA GPU"
        ) from None
    if not torch.cuda.is_available():
        raise ServetuneError(
            "profile measure needs a CUDA GPU, and torch.cuda.is_available() is False here; "
            "run it on the GPU machine you want to profile"
        )
    return torch


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
    models: list[str] | tuple[str, ...] = ("llama-3.1-8b",),
    whole_steps: bool = True,
    budget_s: float = 600.0,
    log: Callable[[str], None] = print,
) -> list[Path]:
    """Time everything for ``models`` and write the CSVs into ``output``; returns paths."""
    archs = []
    for name in models:
        if name not in MODELS:
            raise ServetuneError(f"--model {name!r}: unknown (built in: {', '.join(MODELS)})")
        archs.append(MODELS[name])
    torch = _torch()
    import torch.nn.functional as F

    out = Path(output)
    dev = "cuda"
    dt = torch.bfloat16
    start = time.monotonic()

    def out_of_time() -> bool:
        return time.monotonic() - start > budget_s

    def median_ms(fn: Callable[[], object], reps: int | None = None) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        once = max(begin.elapsed_time(end), 1e-3)
        n = reps or int(min(200, max(5, 30.0 / once)))
        times = []
        for _ in range(n):
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        times.sort()
        return times[len(times) // 2]

    linear = _Csv(["model", "op", "tokens", "k", "n", "dtype", "ms", "tflops"])
    element = _Csv(["model", "tokens", "ms"])
    prefill = _Csv(["model", "batch", "tokens", "ms"])
    decode = _Csv(["model", "batch", "context", "ms", "kv_GBps"])
    lm_head = _Csv(["model", "tokens", "vocab", "ms"])
    written: list[Path] = []

    for arch in archs:
        h, inter, qh, kvh, hd = arch.hidden, arch.intermediate, arch.heads, arch.kv_heads, \
            arch.head_dim
        shapes = {"qkv": (h, (qh + 2 * kvh) * hd), "o": (qh * hd, h),
                  "gate_up": (h, 2 * inter), "down": (inter, h)}
        weights = {op: torch.randn(n, k, device=dev, dtype=dt) * 0.02
                   for op, (k, n) in shapes.items()}
        norm_w = torch.ones(h, device=dev, dtype=dt)
        for tokens in GEMM_TOKENS:
            if out_of_time():
                break
            for op, (k, n) in shapes.items():
                x = torch.randn(tokens, k, device=dev, dtype=dt)
                w = weights[op]
                ms = median_ms(lambda x=x, w=w: F.linear(x, w))
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

            element.row(arch.name, tokens, f"{median_ms(layer_elementwise):.5f}")
        del weights
        log(f"{arch.name}: GEMMs and elementwise done")

        for n_tok in PREFILL_TOKENS:
            if out_of_time():
                break
            q = torch.randn(1, qh, n_tok, hd, device=dev, dtype=dt)
            kv = torch.randn(1, kvh, n_tok, hd, device=dev, dtype=dt)
            ms = median_ms(lambda q=q, kv=kv: F.scaled_dot_product_attention(
                q, kv, kv, is_causal=True, enable_gqa=True))
            prefill.row(arch.name, 1, n_tok, f"{ms:.5f}")
        for prefix, chunk in CHUNKS:
            if out_of_time():
                break
            q = torch.randn(1, qh, chunk, hd, device=dev, dtype=dt)
            kv = torch.randn(1, kvh, prefix + chunk, hd, device=dev, dtype=dt)
            # unmasked: an upper bound of the bottom-right causal chunk
            ms = median_ms(lambda q=q, kv=kv: F.scaled_dot_product_attention(
                q, kv, kv, enable_gqa=True))
            prefill.row(arch.name, f"chunk_prefix{prefix}", chunk, f"{ms:.5f}")
        for batch in DECODE_BATCH:
            for ctx in DECODE_CONTEXT:
                if batch * ctx > 2_000_000 or out_of_time():
                    continue
                q = torch.randn(batch, qh, 1, hd, device=dev, dtype=dt)
                kv = torch.randn(batch, kvh, ctx, hd, device=dev, dtype=dt)
                ms = median_ms(lambda q=q, kv=kv: F.scaled_dot_product_attention(
                    q, kv, kv, enable_gqa=True))
                kv_bytes = 2 * batch * kvh * ctx * hd * 2
                decode.row(arch.name, batch, ctx, f"{ms:.5f}", f"{kv_bytes / ms / 1e6:.1f}")
        log(f"{arch.name}: attention done")

        lm_w = torch.randn(arch.vocab, h, device=dev, dtype=dt) * 0.02
        for rows in LM_ROWS:
            x = torch.randn(rows, h, device=dev, dtype=dt)
            ms = median_ms(lambda x=x, w=lm_w: torch.argmax(F.linear(x, w).float(), dim=-1))
            lm_head.row(arch.name, rows, arch.vocab, f"{ms:.5f}")
        del lm_w
        torch.cuda.empty_cache()

        if whole_steps and not out_of_time():
            path = out / f"step_graph_{arch.name}.csv"
            text = _whole_steps(torch, F, arch, out_of_time, log)
            write_text_atomic(path, text)
            written.append(path)

    for name, table in (("linear.csv", linear), ("elementwise.csv", element),
                        ("attn_prefill.csv", prefill), ("attn_decode.csv", decode),
                        ("lm_head.csv", lm_head)):
        write_text_atomic(out / name, table.text())
        written.append(out / name)
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    write_text_atomic(out / "env.txt",
                      f"torch {torch.__version__} cuda {torch.version.cuda}\n"
                      f"device {props.name} sms {props.multi_processor_count} "
                      f"mem_total {total} mem_free {free}\n")
    written.append(out / "env.txt")
    return written


def _whole_steps(torch: Any, F: Any, arch: Any, out_of_time: Callable[[], bool],
                 log: Callable[[str], None]) -> str:
    """Whole steps replayed from CUDA graphs (see the module docstring)."""
    dev, dt = "cuda", torch.bfloat16
    h, inter, qh, kvh, hd = arch.hidden, arch.intermediate, arch.heads, arch.kv_heads, \
        arch.head_dim
    scale = 0.02
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
    free, _ = torch.cuda.mem_get_info()
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

    table = _Csv(["model", "decode_seqs", "context", "prefill_tokens", "graph_ms", "eager_ms"])
    for chunk in STEP_GRID_CHUNK:
        for n_decode in STEP_GRID_DECODE:
            for ctx in STEP_GRID_CONTEXT:
                if n_decode == 0 and (chunk == 0 or ctx != STEP_GRID_CONTEXT[0]):
                    continue
                if n_decode * ctx > kv_budget_tokens or out_of_time():
                    continue
                caches = [
                    (torch.randn(n_decode, kvh, ctx, hd, device=dev, dtype=dt),
                     torch.randn(n_decode, kvh, ctx, hd, device=dev, dtype=dt))
                    if n_decode else (None, None)
                    for _ in range(arch.layers)
                ]
                x = torch.randn(n_decode + chunk, h, device=dev, dtype=dt)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        forward(x, caches, n_decode, chunk)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    forward(x, caches, n_decode, chunk)
                for _ in range(3):
                    graph.replay()
                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                times = []
                for _ in range(15):
                    begin.record()
                    graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(begin.elapsed_time(end))
                times.sort()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(3):
                    forward(x, caches, n_decode, chunk)
                torch.cuda.synchronize()
                eager = (time.perf_counter() - t0) * 1e3 / 3
                table.row(arch.name, n_decode, ctx if n_decode else 0, chunk,
                          f"{times[len(times) // 2]:.4f}", f"{eager:.4f}")
                log(f"{arch.name} step decode={n_decode} ctx={ctx} chunk={chunk}: "
                    f"{times[len(times) // 2]:.3f} ms")
                del graph, caches, x
                torch.cuda.empty_cache()
    return table.text()
