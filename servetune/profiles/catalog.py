"""Built-in model architectures and GPU datasheets that profiles are built from.

Model shapes are the published Hugging Face ``config.json`` values; parameter counts are
the safetensors totals (embeddings and LM head included). GPU figures are NVIDIA
datasheet numbers: dense (no-sparsity) BF16 tensor-core FLOP/s, HBM/GDDR bandwidth, and
NVLink bandwidth per GPU *per direction* (the datasheets quote the bidirectional total,
e.g. 900 GB/s for H100/H200 SXM = 450 GB/s each way). ``memory_bytes`` is what the driver
reports as total memory (what vLLM multiplies by ``gpu_memory_utilization``), not the
marketing capacity.
"""

from __future__ import annotations

from servetune.profiles.schema import Hardware, ModelArch

MODELS: dict[str, ModelArch] = {
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": ModelArch(
        name="llama-3.1-8b", layers=32, hidden=4096, intermediate=14336, heads=32,
        kv_heads=8, head_dim=128, vocab=128256, params=8_030_261_248, dtype="bf16",
    ),
    # Qwen/Qwen2.5-32B config.json (q/k/v biases are in params)
    "qwen2.5-32b": ModelArch(
        name="qwen2.5-32b", layers=64, hidden=5120, intermediate=27648, heads=40,
        kv_heads=8, head_dim=128, vocab=152064, params=32_763_876_352, dtype="bf16",
    ),
    # meta-llama/Llama-3.1-70B config.json
    "llama-3.1-70b": ModelArch(
        name="llama-3.1-70b", layers=80, hidden=8192, intermediate=28672, heads=64,
        kv_heads=8, head_dim=128, vocab=128256, params=70_553_706_496, dtype="bf16",
    ),
}

DATASHEETS = {
    "h200": "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): "
    "141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity (989 dense), NVLink 900 GB/s",
    "h100-80gb": "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), "
    "SXM: 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity (989 dense), NVLink 900 GB/s",
    "a100-80gb": "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100), "
    "80GB SXM: HBM2e 2,039 GB/s, BF16 312 TFLOPS dense, NVLink 600 GB/s",
    "a100-40gb": "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100), "
    "40GB SXM: HBM2 1,555 GB/s, BF16 312 TFLOPS dense, NVLink 600 GB/s",
    "l40s": "NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s): 48 GB GDDR6, "
    "864 GB/s, BF16 362.05 TFLOPS dense (733 with sparsity), PCIe Gen4 x16 64 GB/s, no NVLink",
}

GPUS: dict[str, Hardware] = {
    # memory_bytes: torch.cuda.mem_get_info() total on the measured H200 (env.txt)
    "h200": Hardware(
        name="NVIDIA H200 SXM 141GB", memory_bytes=150_109_880_320,
        hbm_bandwidth_Bps=4.8e12, peak_flops=989e12, interconnect_bandwidth_Bps=450e9,
    ),
    # 79.19 GiB: the total vLLM logs for an H100 80GB HBM3
    "h100-80gb": Hardware(
        name="NVIDIA H100 SXM 80GB", memory_bytes=85_030_000_000,
        hbm_bandwidth_Bps=3.35e12, peak_flops=989e12, interconnect_bandwidth_Bps=450e9,
    ),
    # 79.15 GiB: the total vLLM logs for an A100-SXM4-80GB
    "a100-80gb": Hardware(
        name="NVIDIA A100 SXM4 80GB", memory_bytes=84_987_740_160,
        hbm_bandwidth_Bps=2.039e12, peak_flops=312e12, interconnect_bandwidth_Bps=300e9,
    ),
    # 39.39 GiB: the total capacity PyTorch reports for an A100-SXM4-40GB
    "a100-40gb": Hardware(
        name="NVIDIA A100 SXM4 40GB", memory_bytes=round(39.39 * 2**30),
        hbm_bandwidth_Bps=1.555e12, peak_flops=312e12, interconnect_bandwidth_Bps=300e9,
    ),
    # 46,068 MiB: nvidia-smi total for an L40S
    "l40s": Hardware(
        name="NVIDIA L40S 48GB", memory_bytes=48_305_799_168,
        hbm_bandwidth_Bps=0.864e12, peak_flops=362.05e12, interconnect_bandwidth_Bps=32e9,
    ),
}

# Per-GPU slices measured in gpu_measurements/ that stand for a model at a TP degree.
SHARD_ROWS: dict[tuple[str, int], str] = {("llama-3.1-70b", 4): "llama-3.1-70b-tp4-shard"}


def gpu_key(device_name: str) -> str | None:
    """Catalog key for a device name as torch/nvidia-smi prints it (None if unknown)."""
    low = device_name.lower()
    if "a100" in low and "40gb" in low.replace(" ", ""):
        return "a100-40gb"
    for key, needle in (("h200", "h200"), ("h100-80gb", "h100"), ("a100-80gb", "a100"),
                        ("l40s", "l40s")):
        if needle in low:
            return key
    return None
