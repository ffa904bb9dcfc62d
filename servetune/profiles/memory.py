"""GPU memory model: KV bytes per token, weight bytes, and the KV pool in blocks.

The pool follows vLLM's own arithmetic (docs/engines.md 1.3; vLLM V1 ``gpu_worker`` /
``kv_cache_utils``):

    budget     = total_memory * gpu_memory_utilization            (per GPU)
    kv_bytes   = budget - weight_bytes - activation_reserve_bytes
    num_blocks = floor(kv_bytes / (block_size * kv_bytes_per_token))
    usable     = num_blocks - 1

``activation_reserve_bytes`` stands for everything vLLM's profiling run finds besides the
weights: the peak activation of a ``max_num_batched_tokens`` forward pass, the CUDA-graph
pool and non-torch allocations (NCCL, cuBLAS workspaces). vLLM V1's ``BlockPool`` takes
one block out of the pool as its *null block* (a placeholder for skipped attention
blocks), so a scheduler can hand out ``num_blocks - 1``; with ``num_gpu_blocks_override``
the engine allocates exactly the override and again keeps one back.

KV bytes per token per GPU = layers x KV heads on this GPU x head_dim x 2 (K and V) x
bytes per element. Under tensor parallelism the KV heads are split across GPUs, and
replicated when there are fewer KV heads than GPUs (vLLM: ``max(1, kv_heads // tp)``).
"""

from __future__ import annotations

import math

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "float32": 4.0,
    "bf16": 2.0,
    "bfloat16": 2.0,
    "fp16": 2.0,
    "float16": 2.0,
    "half": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}

NULL_BLOCKS = 1  # vLLM V1 BlockPool reserves one null block


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name (bf16, fp16, fp8, ...)."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        allowed = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unknown dtype {dtype!r} (allowed: {allowed})") from None


def kv_heads_per_gpu(kv_heads: int, tensor_parallel: int) -> int:
    """KV heads one GPU holds: split across TP ranks, replicated below one per rank."""
    return max(1, kv_heads // tensor_parallel)


def kv_bytes_per_token(
    layers: int, kv_heads: int, head_dim: int, element_bytes: float, tensor_parallel: int = 1
) -> float:
    """KV-cache bytes one token occupies on one GPU (K and V, every layer)."""
    return layers * kv_heads_per_gpu(kv_heads, tensor_parallel) * head_dim * 2 * element_bytes


def weight_bytes(params: int, element_bytes: float, tensor_parallel: int = 1) -> float:
    """Weight bytes per GPU: parameters x bytes per parameter / TP degree."""
    return params * element_bytes / tensor_parallel


def kv_pool_bytes(
    total_memory_bytes: float,
    gpu_memory_utilization: float,
    weight_bytes_per_gpu: float,
    activation_reserve_bytes: float,
) -> float:
    """Bytes left for the KV cache on one GPU (may be negative: the model does not fit)."""
    return (
        total_memory_bytes * gpu_memory_utilization
        - weight_bytes_per_gpu
        - activation_reserve_bytes
    )


def kv_pool_blocks(kv_bytes: float, kv_bytes_token: float, block_size: int) -> int:
    """Blocks vLLM allocates for ``kv_bytes`` (before the null block); 0 if none fit."""
    if kv_bytes <= 0:
        return 0
    return int(math.floor(kv_bytes / (kv_bytes_token * block_size)))


def usable_blocks(allocated_blocks: int) -> int:
    """Blocks a scheduler can hand out: the allocation minus vLLM's null block."""
    return max(0, allocated_blocks - NULL_BLOCKS)


def estimate_activation_reserve(
    hidden: int,
    intermediate: int,
    vocab: int,
    tensor_parallel: int = 1,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 1024,
) -> int:
    """A default for ``activation_reserve_bytes`` when nobody measured it.

    vLLM's profiling run does one forward pass of ``max_num_batched_tokens`` tokens and a
    sampler pass over ``max_num_seqs`` rows; its peak is dominated by the MLP's
    gate/up output (2 x intermediate / TP values per token, bf16), a few hidden-sized
    buffers (residual, normed input, attention output: ~4 x hidden), and the fp32 logits of
    the sampled rows. On top of that come the CUDA-graph pool and non-torch memory
    (cuBLAS/NCCL workspaces), taken here as 1.5 GiB together; vLLM's logs for 8B-70B
    models show 0.5-2 GiB for these. Rounded up to whole MiB.
    """
    mib = 1 << 20
    per_token = (2 * intermediate / tensor_parallel + 4 * hidden) * 2
    activations = max_num_batched_tokens * per_token
    logits = max_num_seqs * (vocab / tensor_parallel) * 4
    fixed = 1.5 * (1 << 30)
    total = activations + logits + fixed
    return int(math.ceil(total / mib) * mib)
