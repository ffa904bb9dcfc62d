"""The engines servetune simulates and exports to: one row each, the one list of them.

Every engine name list in the code (the job schema's ``engine``, the simulator's
``ENGINES``, the CLI's ``--engine`` choices and help, the exporters, nightly's
``--engines``) is :data:`ENGINE_NAMES` or read from :data:`ENGINES`. A row holds:

- ``kernel_id``: the integer the simulator kernel knows the engine by (the ``E_*``
  constants of :mod:`servetune.sim._kernel`; rows are in that order, so a name's position
  in :data:`ENGINE_NAMES` is its id);
- ``exporter``: ``"module:function"`` of its config exporter, imported only when an export
  runs (the export modules import :mod:`servetune.export`, which reads this table, so a
  direct reference would be an import cycle);
- ``config_file``: the file name ``export`` and ``nightly`` write;
- ``default_batching``: the engine's own ``(max_num_seqs, max_num_batched_tokens)`` from
  the KV pool in tokens, on the GPUs ``defaults_for`` names (the defaults baselines are
  simulated with); ``None`` where servetune does not model them.

This module imports nothing heavy: the CLI reads it at start-up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# SGLang's defaults (server_args.py): chunked prefill 8192 on a GPU under 160 GB; the
# running-request cap is min(KV tokens / 2, the request pool, sized up to 4096 slots).
SGLANG_CHUNKED_PREFILL = 8192
SGLANG_REQ_POOL_MAX = 4096


def _vllm_default_batching(kv_tokens: int) -> tuple[int, int]:
    """``vllm serve`` on a GPU with >= 70 GiB that is not an A100 (usage context
    OPENAI_API_SERVER): 1024 sequences, 8192 batched tokens, whatever the pool."""
    return 1024, 8192


def _sglang_default_batching(kv_tokens: int) -> tuple[int, int]:
    seats = max(1, min(kv_tokens // 2, SGLANG_REQ_POOL_MAX))
    return seats, max(SGLANG_CHUNKED_PREFILL, seats)


@dataclass(frozen=True)
class Engine:
    """One serving engine (module docstring)."""

    name: str
    title: str
    kernel_id: int
    exporter: str
    config_file: str
    default_batching: Callable[[int], tuple[int, int]] | None = None
    defaults_for: str = ""

    def export_function(self) -> Callable[..., Any]:
        """The exporter, ``export(policy, facts) -> ExportResult``."""
        module, function = self.exporter.split(":")
        return getattr(importlib.import_module(module), function)


ENGINES: tuple[Engine, ...] = (
    Engine("vllm", "vLLM", 0, "servetune.export.vllm:export", "vllm.yaml",
           _vllm_default_batching, "a GPU with >= 70 GiB that is not an A100"),
    Engine("sglang", "SGLang", 1, "servetune.export.sglang:export", "sglang.yaml",
           _sglang_default_batching, "a GPU with < 160 GB"),
    Engine("trtllm", "TensorRT-LLM", 2, "servetune.export.trtllm:export", "trtllm.yaml"),
    Engine("tgi", "TGI", 3, "servetune.export.tgi:export", "tgi.sh"),
)

ENGINE_NAMES: tuple[str, ...] = tuple(e.name for e in ENGINES)
BY_NAME: dict[str, Engine] = {e.name: e for e in ENGINES}
CONFIG_FILES: dict[str, str] = {e.name: e.config_file for e in ENGINES}


def engine(name: str) -> Engine:
    """The row of engine ``name`` (KeyError when there is none; callers say what to do)."""
    return BY_NAME[name]


def kernel_id(name: str) -> int:
    """The simulator kernel's integer for engine ``name``."""
    return BY_NAME[name].kernel_id


__all__ = [
    "BY_NAME",
    "CONFIG_FILES",
    "ENGINES",
    "ENGINE_NAMES",
    "Engine",
    "engine",
    "kernel_id",
]
