"""The engines servetune simulates and exports to: one row each, the one list of them.

Every engine name list in the code (the job schema's ``engine``, the simulator's check,
the CLI's ``--engine`` choices and help, the exporters, nightly's ``--engines``) is
:data:`ENGINE_NAMES` or read from :data:`ENGINES`. A row holds:

- ``kernel_id``: the integer the simulator kernel knows the engine by (the ``E_*``
  constants of :mod:`servetune.sim._kernel`; rows are in that order, so a name's position
  in :data:`ENGINE_NAMES` is its id);
- ``exporter``: ``"module:function"`` of its config exporter, imported only when an export
  runs (the export modules import :mod:`servetune.export`, which reads this table, so a
  direct reference would be an import cycle);
- ``config_file``: the file name ``export`` and ``nightly`` write;
- ``default_batching``: the engine's own ``max_num_seqs`` / ``max_num_batched_tokens`` on
  a GPU (:class:`GpuFacts`), with the rule that gave them (the defaults baseline is
  simulated with them and reports name the rule); ``None`` where servetune does not
  model them;
- ``chunked_prefill``: whether the engine chunks prefills by default; a policy that leaves
  ``batching.enable_chunked_prefill`` unset (None) runs and exports with it (vLLM, SGLang
  and TGI on; ``trtllm-serve`` off: its ``--enable_chunked_prefill`` is off by default,
  docs/engines.md 4);
- ``host``: the engine's host-side cost per step (:class:`HostOverhead`): the scheduling,
  input preparation, sampling and output processing a CUDA-graph replay of the GPU work
  does not contain. GPU profiles hold GPU time only and take these defaults when a step
  is evaluated for the engine (``servetune.profiles.steptime``), unless a profile pins its
  own. The defaults live here, not in each profile, because they belong to the engine
  (its process layout, whether it overlaps host work with the GPU) and its host CPU, not
  to the GPU a profile describes: one profile serves four engines, and a new engine
  release changes one row instead of every profile;
- ``priority_preemption_threshold``: under priority scheduling, a running request is
  preempted for a waiting one more important by more than this (SGLang's default
  ``--priority-scheduling-preemption-threshold``, 10, docs/engines.md 2.4; the simulator
  and the exporter read it); None for an engine without it;
- ``disagg_decode``: whether the simulator runs the engine as the decode side of a
  disaggregated pair (its rule for a request whose KV arrives from a prefill replica is
  vLLM's KV connector: vLLM only).

This module imports nothing heavy: the CLI reads it at start-up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30


# vLLM's host seconds per sampled sequence (VLLM_HOST below): benchmarks/published_vllm.py
# --fit-host fits it; RESULTS.md "Published vLLM end to end" records the fit.
VLLM_HOST_S_PER_SEQ = 170.7e-6

# Engine replicas one cluster simulation holds, from a topology file or the flags.
MAX_REPLICAS = 1024
# What each replica of a cluster simulation holds: arrays over the whole trace (the router
# may send it any request) and over its KV pool. Measured on the H200 8B profile (56,821
# blocks; peak RSS over one replica's run): under round_robin, 128 replicas x 200,000
# requests took 2.49 GB more and 1,024 x 19,531 took 6.63 GB more (72 B per request and
# 89 B per block per replica); under least_loaded, 16 x 2,725,965 took about 94 B per
# request. The bound charges 100 B per request and 89 per block, and one simulation's
# replicas hold at most MAX_CLUSTER_STATE_BYTES (the process then stays under 4 GB;
# benchmarks/RESULTS.md, "Resource bounds").
CLUSTER_BYTES_PER_REQUEST = 100
CLUSTER_BYTES_PER_KV_BLOCK = 89
MAX_CLUSTER_STATE_BYTES = 5 * GIB // 2

@dataclass(frozen=True)
class GpuFacts:
    """What an engine's defaults depend on: the GPU's name and memory as the driver
    reports them, and the KV pool in tokens."""

    name: str
    memory_bytes: int
    kv_tokens: int


@dataclass(frozen=True)
class DefaultBatching:
    """An engine's own ``max_num_seqs`` / ``max_num_batched_tokens`` on a GPU, and the rule
    that gave them, in words (reports name it)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    rule: str


def _vllm_default_batching(gpu: GpuFacts) -> DefaultBatching:
    """``vllm serve`` (usage context OPENAI_API_SERVER, how users serve): 1024 sequences and
    8192 batched tokens on a GPU with >= 70 GiB whose name does not contain "a100", else
    256 and 2048 (vLLM ``EngineArgs.get_batch_defaults``, vllm/engine/arg_utils.py)."""
    if gpu.memory_bytes >= 70 * GIB and "a100" not in gpu.name.lower():
        return DefaultBatching(1024, 8192, "vllm serve on a GPU with >= 70 GiB that is not an "
                                           "A100: 1024 sequences, 8192 batched tokens")
    return DefaultBatching(256, 2048, "vllm serve on a GPU with < 70 GiB or an A100: "
                                      "256 sequences, 2048 batched tokens")


# SGLang's chunked-prefill size by GPU memory (server_args.py, _handle_gpu_memory_settings;
# thresholds in GiB, as it compares MiB), and its request-pool bound on running requests.
SGLANG_CHUNK_BY_MEMORY_GIB = ((20, 2048), (35, 2048), (60, 4096), (90, 8192), (160, 8192))
SGLANG_CHUNK_LARGEST = 16384
SGLANG_REQ_POOL_MAX = 4096


def _sglang_default_batching(gpu: GpuFacts) -> DefaultBatching:
    """SGLang: chunked prefill by GPU memory; running requests min(KV tokens / 2, the
    request pool) (server_args.py)."""
    memory_gib = gpu.memory_bytes / GIB
    chunk = next((c for limit, c in SGLANG_CHUNK_BY_MEMORY_GIB if memory_gib < limit),
                 SGLANG_CHUNK_LARGEST)
    seats = max(1, min(gpu.kv_tokens // 2, SGLANG_REQ_POOL_MAX))
    return DefaultBatching(
        seats, max(chunk, seats),
        f"SGLang on a {memory_gib:.0f} GiB GPU: chunked prefill {chunk}, running requests "
        f"min(KV tokens / 2, {SGLANG_REQ_POOL_MAX}) = {seats}")


@dataclass(frozen=True)
class HostOverhead:
    """An engine's host seconds per step and per sequence that produces a token, whether
    it overlaps the per-step part with the GPU, and where the numbers come from (reports
    and profile docs quote it).

    ``overlap``: the engine prepares step n+1 (scheduling, input preparation, processing
    step n-1's outputs) while the GPU runs step n, so a step pays only the per-step host
    time the GPU step does not cover; servetune charges ``max(0, per_step_s - the
    profile's smallest GPU step)``. The per-sequence part is charged in full either way:
    it is the work on each sampled row that sits between two forward passes (sampling
    and logits processing outside the CUDA graph, and the per-request bookkeeping before
    the next step's inputs are final)."""

    per_step_s: float
    per_seq_s: float
    source: str
    overlap: bool = False


# Engines whose host cost no admitted measurement has fitted: 0, the profiles' GPU time
# alone. `servetune validate --calibrate` fits the terms for a deployment from its own
# `vllm bench serve` run and pins them in the profile; a profile may also pin them by
# hand (step_time.host_s_per_step / host_s_per_seq / host_overlap).
UNMEASURED_HOST = HostOverhead(
    per_step_s=0.0, per_seq_s=0.0,
    source="none charged: no admitted published measurement to fit it to; calibrate with "
           "`servetune validate --calibrate` or pin it in the profile",
)

# vLLM V1 as released since async scheduling became its default (vLLM PR #27614, late
# 2025; 0.19.1 and 0.23.0 are the versions of the admitted points): the per-step work is
# overlapped with the GPU, and the per-sequence figure is fitted to one published point,
# the median inter-token latency of 8 concurrent ~20k-token requests on an H100 with vLLM
# 0.19.1 (benchmarks/published_vllm.yaml, h100-8b-8x20k; RESULTS.md "Published vLLM end
# to end" gives the fit and the points it is checked on). Older builds (V0, or V1
# without async scheduling) do not overlap: a profile for them sets
# step_time.host_overlap false and its own figures (`validate --calibrate` fits them).
VLLM_HOST = HostOverhead(
    per_step_s=0.0, per_seq_s=VLLM_HOST_S_PER_SEQ, overlap=True,
    source="vLLM V1 with async scheduling: per-step host work overlapped with the GPU; "
           f"{VLLM_HOST_S_PER_SEQ * 1e6:.0f} us per sampled sequence, fitted to the "
           "median ITL of 8 x 20k-token requests on an H100 (vLLM 0.19.1, blog.vllm.ai "
           "2026-04-22, Table 4)",
)


@dataclass(frozen=True)
class Engine:
    """One serving engine (module docstring)."""

    name: str
    title: str
    kernel_id: int
    exporter: str
    config_file: str
    default_batching: Callable[[GpuFacts], DefaultBatching] | None = None
    chunked_prefill: bool = True
    host: HostOverhead = UNMEASURED_HOST
    priority_preemption_threshold: int | None = None
    disagg_decode: bool = False

    def export_function(self) -> Callable[..., Any]:
        """The exporter, ``export(policy, facts, role=None) -> ExportResult``."""
        module, function = self.exporter.split(":")
        return getattr(importlib.import_module(module), function)


ENGINES: tuple[Engine, ...] = (
    Engine("vllm", "vLLM", 0, "servetune.export.vllm:export", "vllm.yaml",
           _vllm_default_batching, host=VLLM_HOST, disagg_decode=True),
    Engine("sglang", "SGLang", 1, "servetune.export.sglang:export", "sglang.yaml",
           _sglang_default_batching, priority_preemption_threshold=10),
    Engine("trtllm", "TensorRT-LLM", 2, "servetune.export.trtllm:export", "trtllm.yaml",
           chunked_prefill=False),
    Engine("tgi", "TGI", 3, "servetune.export.tgi:export", "tgi.sh"),
)

ENGINE_NAMES: tuple[str, ...] = tuple(e.name for e in ENGINES)
BY_NAME: dict[str, Engine] = {e.name: e for e in ENGINES}
CONFIG_FILES: dict[str, str] = {e.name: e.config_file for e in ENGINES}
# The engines a disaggregated cluster's decode replicas may run (``disagg_decode``).
DISAGG_DECODE_ENGINES: tuple[str, ...] = tuple(e.name for e in ENGINES if e.disagg_decode)
# The instances of a disaggregated prefill/decode pair an export may be for (here, not in
# servetune.export, so that `servetune export --help` lists them without the exporters).
DISAGG_ROLES: tuple[str, ...] = ("prefill", "decode")


def engine(name: str) -> Engine:
    """The row of engine ``name`` (KeyError when there is none; callers say what to do)."""
    return BY_NAME[name]


def host_overhead(name: str) -> HostOverhead:
    """The host-cost row of engine ``name`` (ValueError naming the known engines when
    there is none)."""
    row = BY_NAME.get(name)
    if row is None:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    return row.host


def kernel_id(name: str) -> int:
    """The simulator kernel's integer for engine ``name``."""
    return BY_NAME[name].kernel_id


__all__ = [
    "BY_NAME",
    "CONFIG_FILES",
    "DISAGG_ROLES",
    "ENGINES",
    "ENGINE_NAMES",
    "DefaultBatching",
    "Engine",
    "GpuFacts",
    "HostOverhead",
    "engine",
    "host_overhead",
    "kernel_id",
]
