"""Step timing: how long one engine step takes on a named GPU serving a named model.

A roofline: a step is bound by compute or by memory traffic, whichever is slower,
plus a fixed per-step overhead (scheduling, kernel launches, sampling):

    flops = 2 * params * tokens                                  (dense matmuls)
          + 4 * layers * hidden * sum_r q_r * (ctx_r + q_r / 2)  (causal attention)
    bytes = weight_bytes + kv_bytes_per_token * sum_r (ctx_r + q_r)  (weights + KV)
    step  = overhead + max(flops / (peak_flops * mfu), bytes / (bandwidth * mbu))

where request r computes ``q_r`` new tokens over ``ctx_r`` tokens already in its KV.
Prefill tokens drive the FLOPs, the decode batch and total context drive the bytes.

Where the numbers come from (``GPU_PROFILES``):

- Model shapes: Llama-3.1-8B (Meta's config.json): 8.03e9 parameters, 32 layers,
  hidden 4096, 8 KV heads x head_dim 128, BF16 -> 16.06 GB of weights and
  2 * 32 * 8 * 128 * 2 B = 128 KiB of KV per token.
- GPUs (NVIDIA datasheets, dense BF16 / HBM): H100 SXM 989 TFLOP/s, 3.35 TB/s;
  A100 SXM 80GB 312 TFLOP/s, 2.04 TB/s.
- Efficiencies are assumptions, not measurements: 55 % model-FLOPs utilisation in
  prefill and 80 % of HBM bandwidth in decode, typical of what published vLLM
  benchmarks reach on these GPUs. With them, Llama-3.1-8B on one H100 gives
  ~7.5 ms per decode step at batch 1 (~130 tokens/s per request) and ~62 ms for a
  2,048-token prefill (~33 k prefill tokens/s), in line with public vLLM numbers
  for this model and GPU (roughly 120-150 tok/s single-stream decode, tens of
  thousands of prefill tokens/s).

Loading offloaded KV back from the CPU tier costs its bytes over PCIe:
``kv_bytes_per_token * tokens / pcie_bandwidth``, added to the step that admits the
request (a synchronous load; vLLM's connector overlaps it with other requests' steps, so
this slightly overcharges). 25 GB/s is an assumption: roughly what pinned host-to-device
copies reach on a PCIe Gen4 x16 link (32 GB/s peak), below Gen5's peak. For Llama-3.1-8B
(128 KiB per token) that is ~5 us a token, about a sixth of prefilling it on an H100
(~30 us a token at the efficiencies above).

The simulator is only as faithful as this model: it captures that prefill cost grows
with uncached tokens (so cache hits cut TTFT) and that decode slows with batch and
context; it ignores CUDA-graph batch buckets, tensor-parallel communication and
sampling cost.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """A GPU + model pair: model shape, GPU peaks and achieved efficiencies."""

    name: str
    description: str
    num_params: float
    num_layers: int
    hidden_size: int
    weight_bytes: float
    kv_bytes_per_token: int
    peak_flops: float  # dense BF16 FLOP/s
    mem_bandwidth: float  # bytes/s
    flops_efficiency: float = 0.55
    bandwidth_efficiency: float = 0.80
    step_overhead_s: float = 0.0015
    gpu_memory_bytes: float = 80e9
    # vLLM's --gpu-memory-utilization default, and room kept for activations
    memory_utilization: float = 0.9
    activation_reserve_bytes: float = 2e9
    pcie_bandwidth: float = 25e9  # bytes/s, host -> GPU, for loads from the CPU tier

    def default_num_gpu_blocks(self, block_size: int) -> int:
        """KV blocks the GPU holds after weights and activations (vLLM's profiling)."""
        kv_bytes = (
            self.gpu_memory_bytes * self.memory_utilization
            - self.weight_bytes
            - self.activation_reserve_bytes
        )
        return max(int(kv_bytes // (self.kv_bytes_per_token * block_size)), 2)

    def kv_load_seconds(self, num_tokens: int) -> float:
        """Time to copy ``num_tokens`` tokens of KV from the CPU tier to the GPU."""
        return self.kv_bytes_per_token * num_tokens / self.pcie_bandwidth

    def step_seconds(self, attention_pairs: Iterable[tuple[int, int]]) -> float:
        """Duration of one step computing ``(context_before, new_tokens)`` per request."""
        num_tokens = 0
        attention_work = 0.0
        kv_tokens = 0
        for context, new in attention_pairs:
            num_tokens += new
            attention_work += new * (context + new / 2)
            kv_tokens += context + new
        if num_tokens == 0:
            return 0.0
        flops = 2.0 * self.num_params * num_tokens
        flops += 4.0 * self.num_layers * self.hidden_size * attention_work
        traffic = self.weight_bytes + self.kv_bytes_per_token * kv_tokens
        compute_s = flops / (self.peak_flops * self.flops_efficiency)
        memory_s = traffic / (self.mem_bandwidth * self.bandwidth_efficiency)
        return self.step_overhead_s + max(compute_s, memory_s)


_LLAMA_8B = {
    "num_params": 8.03e9,
    "num_layers": 32,
    "hidden_size": 4096,
    "weight_bytes": 16.06e9,
    "kv_bytes_per_token": 2 * 32 * 8 * 128 * 2,
}

GPU_PROFILES: dict[str, GpuProfile] = {
    profile.name: profile
    for profile in (
        GpuProfile(
            name="h100-llama3.1-8b",
            description="Llama-3.1-8B-Instruct BF16 on one H100 SXM 80GB",
            peak_flops=989e12,
            mem_bandwidth=3.35e12,
            **_LLAMA_8B,  # type: ignore[arg-type]
        ),
        GpuProfile(
            name="a100-llama3.1-8b",
            description="Llama-3.1-8B-Instruct BF16 on one A100 SXM 80GB",
            peak_flops=312e12,
            mem_bandwidth=2.039e12,
            **_LLAMA_8B,  # type: ignore[arg-type]
        ),
    )
}

DEFAULT_GPU_PROFILE = "h100-llama3.1-8b"


def get_gpu_profile(name: str) -> GpuProfile:
    try:
        return GPU_PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown GPU profile {name!r}; known: {', '.join(sorted(GPU_PROFILES))}"
        ) from None
