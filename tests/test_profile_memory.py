"""Memory model: KV bytes per token, weights, and the KV pool worked by hand."""

from __future__ import annotations

import pytest

from servetune.errors import ServetuneError
from servetune.profiles import memory
from servetune.profiles.schema import Hardware, MemoryBudget, ModelArch, Profile
from servetune.profiles.shipped import SHIPPED_DIR, load_profile, shipped_profiles
from servetune.schemas.base import document_from_data

LLAMA_8B = ModelArch(name="llama-3.1-8b", layers=32, hidden=4096, intermediate=14336,
                     heads=32, kv_heads=8, head_dim=128, vocab=128256,
                     params=8_030_261_248)
LLAMA_70B = ModelArch(name="llama-3.1-70b", layers=80, hidden=8192, intermediate=28672,
                      heads=64, kv_heads=8, head_dim=128, vocab=128256,
                      params=70_553_706_496)
H200 = Hardware(name="H200", memory_bytes=150_109_880_320, hbm_bandwidth_Bps=4.8e12,
                peak_flops=989e12, interconnect_bandwidth_Bps=450e9)
H100 = Hardware(name="H100", memory_bytes=85_030_000_000, hbm_bandwidth_Bps=3.35e12,
                peak_flops=989e12, interconnect_bandwidth_Bps=450e9)


def test_llama_8b_kv_bytes_by_hand():
    # 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes
    assert memory.kv_bytes_per_token(32, 8, 128, 2.0) == 131_072
    p = Profile(name="x", hardware=H200, model=LLAMA_8B)
    assert p.kv_bytes_per_token() == 131_072
    fp8 = p.model_copy(update={"memory": MemoryBudget(kv_cache_dtype="fp8")})
    assert fp8.kv_bytes_per_token() == 65_536


def test_llama_8b_pool_on_h200_by_hand():
    p = Profile(name="x", hardware=H200, model=LLAMA_8B,
                memory=MemoryBudget(activation_reserve_bytes=2_000_000_000))
    weights = 8_030_261_248 * 2  # 16,060,522,496 B
    assert p.weight_bytes() == weights
    # 150,109,880,320 x 0.92 = 138,101,089,894.4; minus weights and reserve
    kv = 138_101_089_894.4 - 16_060_522_496 - 2_000_000_000
    assert p.kv_pool_bytes() == pytest.approx(kv)
    # 120,040,567,398.4 / (16 x 131,072 = 2,097,152) = 57,239.8 -> 57,239 allocated
    assert p.allocated_kv_blocks() == 57_239
    assert p.kv_blocks() == 57_238  # minus vLLM's null block
    assert p.kv_tokens() == 57_238 * 16
    # FP8 KV doubles the blocks that fit (floor of twice the ratio)
    fp8 = p.model_copy(update={"memory": p.memory.model_copy(update={"kv_cache_dtype": "fp8"})})
    assert fp8.allocated_kv_blocks() == 114_479


def test_llama_70b_tp4_pool_on_h100_by_hand():
    p = Profile(name="x", hardware=H100, model=LLAMA_70B,
                parallelism={"tensor_parallel": 4},
                memory=MemoryBudget(gpu_memory_utilization=0.9,
                                    activation_reserve_bytes=3_000_000_000))
    # KV heads split 8 / 4 = 2 per GPU: 80 x 2 x 128 x 2 x 2 = 81,920 B/token
    assert p.kv_bytes_per_token() == 81_920
    # weights 70,553,706,496 x 2 / 4 = 35,276,853,248 B per GPU
    assert p.weight_bytes() == 35_276_853_248
    # 85,030,000,000 x 0.9 = 76,527,000,000; - weights - 3e9 = 38,250,146,752
    # / (16 x 81,920 = 1,310,720) = 29,182.6 -> 29,182 allocated, 29,181 usable
    assert p.allocated_kv_blocks() == 29_182
    assert p.kv_blocks() == 29_181


def test_kv_heads_replicate_beyond_their_count():
    # TP 16 on 8 KV heads: each GPU still holds one head
    assert memory.kv_heads_per_gpu(8, 16) == 1
    assert memory.kv_bytes_per_token(80, 8, 128, 2.0, 16) == 80 * 1 * 128 * 2 * 2


def test_override_keeps_one_null_block_and_needs_no_hardware():
    p = Profile(name="replay", memory={"kv_blocks_override": 201},
                step_time={"constant_s": 0.01})
    assert p.kv_blocks() == 200
    assert p.allocated_kv_blocks() == 201
    assert p.block_size == 16
    assert p.step_time.seconds(100, 1, 1, 100, 0) == 0.01
    # the override wins over the computed pool
    q = Profile(name="x", hardware=H200, model=LLAMA_8B, memory={"kv_blocks_override": 10})
    assert q.kv_blocks() == 9
    with pytest.raises(ServetuneError, match="hardware and model"):
        p.kv_bytes_per_token()


def test_profile_without_hardware_or_override_is_rejected():
    data = {"apiVersion": "servetune/v1", "kind": "Profile", "name": "x"}
    with pytest.raises(ServetuneError, match="hardware and model are required"):
        document_from_data(data, Profile, "p.yaml")


def test_model_that_does_not_fit_has_zero_blocks():
    small = H100.model_copy(update={"memory_bytes": 16_000_000_000})
    p = Profile(name="x", hardware=small, model=LLAMA_8B)
    assert p.kv_pool_bytes() < 0
    assert p.kv_blocks() == 0


def test_utilization_what_if():
    p = Profile(name="x", hardware=H200, model=LLAMA_8B)
    assert p.kv_blocks(0.5) < p.kv_blocks() < p.kv_blocks(0.95)


def test_shipped_profiles_load_and_state_their_pool():
    names = shipped_profiles()
    for required in ("h200-llama-3.1-8b", "h200-qwen2.5-32b", "h100-80gb-llama-3.1-8b",
                     "a100-80gb-llama-3.1-8b", "a100-40gb-llama-3.1-8b", "l40s-llama-3.1-8b",
                     "h100-80gb-llama-3.1-70b-tp4", "h100-80gb-llama-3.1-70b-tp8",
                     "h200-llama-3.1-70b-tp4", "h200-llama-3.1-70b-tp8"):
        assert required in names
    for name in names:
        p = load_profile(name)
        assert p.kv_blocks() > 1000, name
        text = (SHIPPED_DIR / f"{name}.yaml").read_text(encoding="utf-8")
        assert f"{p.kv_blocks():,} usable blocks" in text, name
        assert "GPU memory:" in text and "Source:" in text, name
        if p.calibration.kind == "derived":
            assert p.calibration.assumptions, name
        else:
            assert p.calibration.kind == "measured" and p.calibration.files, name


@pytest.mark.parametrize("blocks", [0, 1])
def test_override_below_two_blocks_says_why(blocks):
    data = {"apiVersion": "servetune/v1", "kind": "Profile", "name": "x",
            "memory": {"kv_blocks_override": blocks}, "step_time": {"constant_s": 0.01}}
    with pytest.raises(ServetuneError, match="kv_blocks_override.*null block"):
        document_from_data(data, Profile, "p.yaml")
