"""Profile: one GPU type x one model x one parallelism, its KV capacity and step time.

A profile answers the two questions the simulator and the optimizer ask of hardware:
how many KV blocks the engine has (:meth:`Profile.kv_blocks`, vLLM's arithmetic in
:mod:`servetune.profiles.memory`) and how long one engine step takes (``step_time``, the
:class:`~servetune.profiles.steptime.StepTimeModel`).

``kv_blocks_override`` fixes the pool the way vLLM's ``num_gpu_blocks_override`` does: the
engine allocates exactly that many blocks and keeps one back as its null block, so
``kv_blocks() == kv_blocks_override - 1``. With an override, ``hardware`` and ``model``
may be omitted (what-if and replay profiles: ``step_time: {constant_s: ...}``).

``calibration`` says where the step-time coefficients come from: ``measured`` (fitted
from timing files, listed with their SHA-256), ``derived`` (scaled from another GPU's
measured efficiencies and datasheet figures; the assumptions are listed) or
``synthetic`` (hand-made, for tests and what-if studies).
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from servetune.errors import ServetuneError
from servetune.profiles import memory
from servetune.profiles.steptime import StepTimeModel
from servetune.schemas.base import Document, Strict, from_file

DTypeName = Literal["bf16", "fp16", "fp8", "fp32"]
# Bounds that catch a typo (or a fuzzer) before arithmetic overflows: a petabyte per GPU,
# a million of any model dimension, 1e14 parameters, a billion KV blocks.
MAX_BYTES = 2**50
MAX_DIM = 10**6
MAX_PARAMS = 10**14
MAX_KV_BLOCKS = 10**9
# No engine step takes less than this: a profile file whose one-token step is faster has
# no step-time model (left out, or every coefficient 0) or a unit mistake.
MIN_STEP_S = 1e-6


class Hardware(Strict):
    name: str = Field(..., min_length=1, description="GPU name, e.g. 'NVIDIA H200 (141 GB)'")
    model_config = ConfigDict(allow_inf_nan=False)
    memory_bytes: int = Field(..., gt=0, le=MAX_BYTES,
                              description="total memory per GPU as the driver reports")
    hbm_bandwidth_Bps: float = Field(..., gt=0, description="datasheet memory bandwidth, B/s")
    peak_flops: float = Field(..., gt=0, description="datasheet dense bf16 FLOP/s")
    interconnect_bandwidth_Bps: float = Field(
        0.0, ge=0, description="per-GPU NVLink (or PCIe) bandwidth, one direction, B/s"
    )


class ModelArch(Strict):
    name: str = Field(..., min_length=1)
    layers: int = Field(..., ge=1, le=MAX_DIM)
    hidden: int = Field(..., ge=1, le=MAX_DIM)
    intermediate: int = Field(..., ge=1, le=MAX_DIM)
    heads: int = Field(..., ge=1, le=MAX_DIM)
    kv_heads: int = Field(..., ge=1, le=MAX_DIM)
    head_dim: int = Field(..., ge=1, le=MAX_DIM)
    vocab: int = Field(..., ge=1, le=MAX_DIM)
    params: int = Field(..., ge=1, le=MAX_PARAMS,
                        description="total parameters (embeddings included)")
    dtype: DTypeName = Field("bf16", description="weight dtype")

    @model_validator(mode="after")
    def _gqa(self) -> ModelArch:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        return self


class Parallelism(Strict):
    tensor_parallel: int = Field(1, ge=1, le=1024,
                                 description="tensor-parallel degree (GPUs per replica)")


class MemoryBudget(Strict):
    gpu_memory_utilization: float = Field(
        0.92, gt=0.0, le=1.0, description="vLLM's fraction of GPU memory (engines.md 1.3)"
    )
    activation_reserve_bytes: int = Field(
        0, ge=0, le=MAX_BYTES,
        description="peak activations + CUDA graphs + non-torch memory per GPU"
    )
    kv_cache_dtype: Literal["auto", "bf16", "fp16", "fp8"] = Field(
        "auto", description="'auto' = the model's dtype; fp8 halves KV bytes"
    )
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block (16 on CUDA)")
    kv_blocks_override: int | None = Field(
        None, le=MAX_KV_BLOCKS,
        description="as vLLM's num_gpu_blocks_override; usable = override - 1"
    )

    @field_validator("kv_blocks_override")
    @classmethod
    def _leaves_a_block(cls, blocks: int | None) -> int | None:
        if blocks is not None and blocks < 2:
            raise ValueError(
                f"must be >= 2: vLLM keeps one block back as its null block, so {blocks} "
                "leaves no usable KV block"
            )
        return blocks


class CalibrationFile(Strict):
    path: str = Field(..., min_length=1)
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    rows: int | None = Field(None, ge=0)


class Calibration(Strict):
    kind: Literal["measured", "derived", "synthetic"] = "synthetic"
    source: str = Field("", description="where the numbers come from (people, papers, files)")
    files: list[CalibrationFile] = Field(default_factory=list)
    assumptions: list[str] = Field(default_factory=list)
    fit: dict[str, float] = Field(
        default_factory=dict, description="fit quality and the constants it learned"
    )


class Profile(Document):
    KIND: ClassVar[str] = "Profile"
    kind: Literal["Profile"] = "Profile"
    name: str = Field(..., min_length=1)
    hardware: Hardware | None = None
    model: ModelArch | None = None
    parallelism: Parallelism = Field(default_factory=Parallelism)
    memory: MemoryBudget = Field(default_factory=MemoryBudget)
    step_time: StepTimeModel = Field(default_factory=StepTimeModel)
    calibration: Calibration = Field(default_factory=Calibration)

    @model_validator(mode="after")
    def _sizable(self) -> Profile:
        if self.memory.kv_blocks_override is None and (self.hardware is None or self.model is None):
            raise ValueError(
                "hardware and model are required unless memory.kv_blocks_override is set"
            )
        return self

    @model_validator(mode="after")
    def _steps_take_time(self, info: ValidationInfo) -> Profile:
        if not from_file(info):  # a profile built in code may leave the step time out
            return self
        # GPU time alone: the engine's host cost is added to any step, even one of a
        # profile whose step-time model is missing
        small = self.step_time.gpu_only().seconds(1, 1, 1, 1, 0)
        if not small >= MIN_STEP_S:
            raise ValueError(
                f"step_time: a one-token step would take {small:.3g} s (under "
                f"{MIN_STEP_S:g} s); give the step-time model (fit one with `servetune "
                "profile fit`, or set step_time.constant_s)"
            )
        large = self.step_time.seconds(1e6, 1e4, 1e4, 1e9, 1e12)
        if not math.isfinite(large):
            raise ValueError("step_time: a large step's time is not finite; check the "
                             "coefficients")
        return self

    # -- the contract the simulator and optimizer use -------------------------------------
    @property
    def block_size(self) -> int:
        return self.memory.block_size

    @property
    def gpu_memory_utilization(self) -> float:
        return self.memory.gpu_memory_utilization

    @property
    def tensor_parallel(self) -> int:
        return self.parallelism.tensor_parallel

    def kv_blocks(self, gpu_memory_utilization: float | None = None) -> int:
        """Usable KV blocks per replica (vLLM's count minus its null block).

        ``gpu_memory_utilization`` overrides the profile's fraction (what-if runs); it is
        ignored when ``kv_blocks_override`` is set.
        """
        override = self.memory.kv_blocks_override
        if override is not None:
            return memory.usable_blocks(override)
        return memory.usable_blocks(self.allocated_kv_blocks(gpu_memory_utilization))

    def allocated_kv_blocks(self, gpu_memory_utilization: float | None = None) -> int:
        """Blocks vLLM allocates (null block included)."""
        if self.memory.kv_blocks_override is not None:
            return self.memory.kv_blocks_override
        return memory.kv_pool_blocks(
            self.kv_pool_bytes(gpu_memory_utilization),
            self.kv_bytes_per_token(),
            self.block_size,
        )

    def kv_tokens(self, gpu_memory_utilization: float | None = None) -> int:
        """Usable KV capacity in tokens."""
        return self.kv_blocks(gpu_memory_utilization) * self.block_size

    # -- memory arithmetic -----------------------------------------------------------------
    def _need_arch(self) -> tuple[Hardware, ModelArch]:
        if self.hardware is None or self.model is None:
            raise ServetuneError(
                f"profile {self.name!r}: hardware and model are needed for memory "
                "arithmetic; add them or use memory.kv_blocks_override"
            )
        return self.hardware, self.model

    def kv_element_bytes(self) -> float:
        _, arch = self._need_arch()
        dtype = arch.dtype if self.memory.kv_cache_dtype == "auto" else self.memory.kv_cache_dtype
        return memory.dtype_bytes(dtype)

    def kv_bytes_per_token(self) -> float:
        """KV bytes per token on one GPU."""
        _, arch = self._need_arch()
        return memory.kv_bytes_per_token(
            arch.layers, arch.kv_heads, arch.head_dim, self.kv_element_bytes(),
            self.tensor_parallel,
        )

    def weight_bytes(self) -> float:
        """Weight bytes on one GPU."""
        _, arch = self._need_arch()
        return memory.weight_bytes(arch.params, memory.dtype_bytes(arch.dtype),
                                   self.tensor_parallel)

    def kv_pool_bytes(self, gpu_memory_utilization: float | None = None) -> float:
        hw, _ = self._need_arch()
        util = (self.gpu_memory_utilization if gpu_memory_utilization is None
                else gpu_memory_utilization)
        return memory.kv_pool_bytes(
            hw.memory_bytes, util, self.weight_bytes(), self.memory.activation_reserve_bytes
        )

    def memory_summary(self) -> dict[str, float | int]:
        """The numbers ``profile show`` prints and each shipped profile states."""
        out: dict[str, float | int] = {
            "block_size": self.block_size,
            "kv_blocks": self.kv_blocks(),
        }
        if self.memory.kv_blocks_override is not None:
            out["kv_blocks_override"] = self.memory.kv_blocks_override
        if self.hardware is not None and self.model is not None:
            out.update(
                gpu_memory_bytes=self.hardware.memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                weight_bytes_per_gpu=self.weight_bytes(),
                activation_reserve_bytes=self.memory.activation_reserve_bytes,
                kv_bytes_per_token=self.kv_bytes_per_token(),
                kv_pool_bytes=self.kv_pool_bytes(),
            )
        out["kv_tokens"] = self.kv_tokens()
        return out
