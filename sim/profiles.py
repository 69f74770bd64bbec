"""Engine profiles: one vLLM replica on real hardware, as the simulator sees it.

A profile carries what admission depends on: the paged-KV geometry (block size,
KV capacity in tokens), the scheduler limits vLLM runs with, the context limit,
the vocabulary (for generated token ids and EOS), and the step-time constants.
Every constant below is named and carries its source: a vLLM default (cited
from ``vllm/engine/arg_utils.py``), a model config, or roofline arithmetic
written out. The numbers are for the *real* hardware; simulated engines scale
KV capacity and ``max_model_len`` by a length scale (``misat_sim.scale``).

Roofline conventions used below:
- ``GiB = 2**30`` bytes; vLLM's default ``gpu_memory_utilization = 0.9``.
- Usable KV memory per GPU = 0.9 x HBM - weights per GPU - activation and
  CUDA-graph reserve.
- Achieved fractions of peak (HBM bandwidth 65%, tensor-core MFU 25% for MoE
  prefill) are typical of published vLLM MoE serving measurements; they are
  the least certain numbers here and are named so a calibration can replace them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from misat_sim.scale import DEFAULT_LENGTH_SCALE
from misat_sim.step_time import StepTimeModel

GIB: int = 2**30
"""Bytes in a GiB."""

GPU_MEMORY_UTILIZATION: float = 0.9
"""vLLM's default ``--gpu-memory-utilization``."""

HBM_EFFICIENCY: float = 0.65
"""Achieved fraction of peak HBM bandwidth for attention KV reads (paged decode)."""

PREFILL_MFU: float = 0.25
"""Achieved fraction of dense tensor-core peak for MoE prefill (routing, all-to-all, small experts).
Measured bounds on an H200 for the 30B-A3B shapes (bench/gpu_moe_calibration.py, docs/simulator.md):
the GEMMs alone reach 0.36 (3.85 us/token), a pass composed of PyTorch primitives 0.10 (14.4 us)."""

GPU_DEFAULT_MAX_NUM_SEQS: int = 1024
"""vLLM default ``max_num_seqs`` for the OpenAI server on GPUs with >= 70 GiB that
are not A100 (H100, H200): ``EngineArgs.get_batch_defaults`` in vllm/engine/arg_utils.py."""

GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS: int = 8192
"""vLLM default ``max_num_batched_tokens`` for the OpenAI server on H100/H200 (same source)."""

CPU_DEFAULT_MAX_NUM_SEQS: int = 128
"""vLLM default ``max_num_seqs`` for the OpenAI server on CPU, world size 1 (same source)."""

CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS: int = 2048
"""vLLM default ``max_num_batched_tokens`` for the OpenAI server on CPU, world size 1."""

GPU_BLOCK_SIZE: int = 16
"""vLLM's default KV block size on CUDA."""

CPU_BLOCK_SIZE: int = 128
"""KV block size of the vLLM CPU backend (seen on the real server, docs/real-vllm.md)."""

PAPER_MAX_MODEL_LEN: int = 131072
"""Context limit: the paper's RLVR outputs hit a 128K cap (docs/misa-t.md)."""


class EngineProfile(BaseModel):
    """One real vLLM replica: KV geometry, scheduler limits, step-time constants."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    block_size: int = Field(gt=0, description="Tokens per KV block.")
    kv_capacity_tokens: int = Field(gt=0, description="KV cache capacity of the replica, tokens.")
    max_num_seqs: int = Field(gt=0, description="vLLM --max-num-seqs.")
    max_num_batched_tokens: int = Field(gt=0, description="vLLM --max-num-batched-tokens.")
    max_model_len: int = Field(gt=0, description="vLLM --max-model-len, tokens.")
    vocab_size: int = Field(gt=3, description="Vocabulary size: range of generated token ids.")
    eos_token_id: int = Field(ge=0, description="Token id of end-of-sequence.")
    default_length_scale: float = Field(
        gt=0.0, le=1.0, description="Length scale simulated engines of this profile use by default."
    )
    step_time: StepTimeModel


# --- qwen30b-a3b-h100 -----------------------------------------------------------
# Qwen3-30B-A3B (config.json on Hugging Face): 48 layers, 32 query heads,
# 4 KV heads, head_dim 128, 30.5B parameters (3.3B active), bf16.
QWEN30B_LAYERS: int = 48
QWEN30B_KV_HEADS: int = 4
QWEN30B_HEAD_DIM: int = 128
QWEN30B_TOTAL_PARAMS: float = 30.5e9
QWEN30B_ACTIVE_PARAMS: float = 3.3e9
QWEN30B_TP: int = 4
H100_HBM_BYTES: int = 80 * GIB
"""H100 SXM: 80 GiB HBM3."""
H100_HBM_BW: float = 3.35e12
"""H100 SXM: 3.35 TB/s."""
H100_BF16_FLOPS: float = 989e12
"""H100 SXM dense bf16 tensor-core peak, FLOP/s."""
QWEN30B_ACTIVATION_RESERVE: int = 4 * GIB
"""Per-GPU activation / CUDA-graph / NCCL reserve vLLM's profiling run leaves out of KV."""

QWEN30B_KV_BYTES_PER_TOKEN_PER_GPU: int = (
    QWEN30B_LAYERS * (QWEN30B_KV_HEADS // QWEN30B_TP) * QWEN30B_HEAD_DIM * 2 * 2
)
"""48 layers x 1 KV head per GPU (4 heads / TP4) x 128 dims x 2 (K and V) x 2 bytes
= 24,576 bytes per token per GPU (98,304 bytes per token for the replica)."""

QWEN30B_KV_BYTES_PER_GPU: float = (
    GPU_MEMORY_UTILIZATION * H100_HBM_BYTES
    - QWEN30B_TOTAL_PARAMS * 2 / QWEN30B_TP
    - QWEN30B_ACTIVATION_RESERVE
)
"""0.9 x 80 GiB (77.3e9 B) - 30.5e9 x 2 B / 4 (15.25e9 B) - 4 GiB (4.3e9 B) = 57.8e9 B."""

QWEN30B_KV_TOKENS: int = int(QWEN30B_KV_BYTES_PER_GPU // QWEN30B_KV_BYTES_PER_TOKEN_PER_GPU)
"""57.8e9 B / 24,576 B = about 2.35M tokens per replica (KV heads are split across
the 4 GPUs, so the per-GPU capacity is the replica's capacity)."""

ATTN_PAIR_S_PER_LAYER_HD128: float = 6.4e-12
"""Measured: seconds per (new token, attended token) pair of prefill attention, one layer,
8 query heads of 128 dims and 1 KV head on one GPU (Qwen3-30B-A3B's per-GPU share at TP4), bf16,
PyTorch fused SDPA on an NVIDIA H200: 6.3-6.5 ps at 32K-98K context, i.e. 630-650 TFLOP/s
(bench/gpu_attention_calibration.py, docs/simulator.md). The H100 has the same dense bf16 peak,
so the figure is used for the H100 profile too."""
ATTN_PAIR_S_PER_LAYER_HD256: float = 11.3e-12
"""Measured likewise for 8 query heads of 256 dims (the Step3.7-like profile's TP8 share):
11.2-11.6 ps per pair per layer at 32K-98K context, 700-730 TFLOP/s."""

QWEN30B_STEP_TIME = StepTimeModel(
    # Decode at batch touches most of the 128 experts: 61 GB of bf16 weights / 4 GPUs
    # = 15.3 GB per GPU at 3.35 TB/s x 0.65 = 7.0 ms, plus ~1 ms of launches and
    # two all-reduces per layer: 8 ms.
    fixed_overhead_s=0.008,
    # 2 x 3.3e9 FLOP per token / (4 x 989e12 x 0.25) = 6.7 us per prefill token.
    prefill_s_per_token=2 * QWEN30B_ACTIVE_PARAMS / (QWEN30B_TP * H100_BF16_FLOPS * PREFILL_MFU),
    # Sampler, input preparation and scheduler bookkeeping per running sequence
    # (vLLM's CPU-side cost per request per step is tens of microseconds): 60 us.
    decode_s_per_seq=60e-6,
    # 24,576 B per token per GPU / (3.35e12 x 0.65) = 11.3 ns per KV token read.
    kv_read_s_per_token=QWEN30B_KV_BYTES_PER_TOKEN_PER_GPU / (H100_HBM_BW * HBM_EFFICIENCY),
    # 48 layers x 6.4 ps = 0.31 ns per pair: a 40K-token prompt from scratch (8e8 pairs)
    # spends 0.25 s in attention on top of 40K x 6.7 us = 0.27 s of GEMMs.
    prefill_attn_s_per_pair=QWEN30B_LAYERS * ATTN_PAIR_S_PER_LAYER_HD128,
)
"""Roofline step model: 128 decodes over 1M context tokens take
8 + 7.7 + 11.3 = 27 ms; an 8192-token prefill chunk takes about 63 ms."""

QWEN30B_A3B_H100 = EngineProfile(
    name="qwen30b-a3b-h100",
    description="Qwen3-30B-A3B-class MoE, one TP4 replica on 4 x H100 80GB, bf16",
    block_size=GPU_BLOCK_SIZE,
    kv_capacity_tokens=QWEN30B_KV_TOKENS,
    max_num_seqs=GPU_DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens=GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_model_len=PAPER_MAX_MODEL_LEN,
    vocab_size=151936,  # Qwen3 config.json
    eos_token_id=151645,  # Qwen3 "<|im_end|>"
    default_length_scale=DEFAULT_LENGTH_SCALE,
    step_time=QWEN30B_STEP_TIME,
)

# --- step3.7-h200 ---------------------------------------------------------------
# Assumed Step3-like architecture (StepFun Step-3, public config): 61 layers,
# multi-matrix factorisation attention with ONE shared KV head of dim 256,
# 321B parameters (38B active) served in FP8, KV in bf16, one TP8 replica on H200.
STEP3_LAYERS: int = 61
STEP3_KV_HEADS: int = 1
STEP3_HEAD_DIM: int = 256
STEP3_TOTAL_PARAMS: float = 321e9
STEP3_ACTIVE_PARAMS: float = 38e9
STEP3_WEIGHT_BYTES_PER_PARAM: float = 1.0
"""FP8 weights (the BF16 checkpoint would not leave room for KV on 8 x H200)."""
STEP3_TP: int = 8
H200_HBM_BYTES: float = 141e9
"""H200: 141 GB HBM3e."""
H200_HBM_BW: float = 4.8e12
"""H200: 4.8 TB/s."""
H200_FP8_FLOPS: float = 1979e12
"""H200 dense FP8 tensor-core peak, FLOP/s."""
STEP3_ACTIVATION_RESERVE: int = 6 * GIB
"""Per-GPU activation / CUDA-graph / NCCL reserve (larger hidden size than Qwen)."""

STEP3_KV_BYTES_PER_TOKEN_PER_GPU: int = STEP3_LAYERS * STEP3_KV_HEADS * STEP3_HEAD_DIM * 2 * 2
"""61 layers x 1 KV head x 256 dims x 2 (K and V) x 2 bytes = 62,464 bytes per token.
With one KV head, tensor parallelism replicates it: every GPU holds the full KV."""

STEP3_KV_BYTES_PER_GPU: float = (
    GPU_MEMORY_UTILIZATION * H200_HBM_BYTES
    - STEP3_TOTAL_PARAMS * STEP3_WEIGHT_BYTES_PER_PARAM / STEP3_TP
    - STEP3_ACTIVATION_RESERVE
)
"""0.9 x 141e9 (126.9e9 B) - 321e9 x 1 B / 8 (40.1e9 B) - 6 GiB (6.4e9 B) = 80.4e9 B."""

STEP3_KV_TOKENS: int = int(STEP3_KV_BYTES_PER_GPU // STEP3_KV_BYTES_PER_TOKEN_PER_GPU)
"""80.4e9 B / 62,464 B = about 1.29M tokens per replica (replicated KV head)."""

STEP3_STEP_TIME = StepTimeModel(
    # Decode at batch streams most experts: 321 GB FP8 / 8 GPUs = 40 GB per GPU at
    # 4.8 TB/s x 0.65 = 12.9 ms, plus launches and all-reduces: 15 ms.
    fixed_overhead_s=0.015,
    # 2 x 38e9 FLOP per token / (8 x 1979e12 x 0.25) = 19.2 us per prefill token.
    prefill_s_per_token=2 * STEP3_ACTIVE_PARAMS / (STEP3_TP * H200_FP8_FLOPS * PREFILL_MFU),
    # Per-sequence CPU and sampling cost, a bit above Qwen's for the larger vocab: 80 us.
    decode_s_per_seq=80e-6,
    # 62,464 B per token / (4.8e12 x 0.65) = 20.0 ns per KV token read.
    kv_read_s_per_token=STEP3_KV_BYTES_PER_TOKEN_PER_GPU / (H200_HBM_BW * HBM_EFFICIENCY),
    # 61 layers x 11.3 ps = 0.69 ns per (new token, attended token) pair.
    prefill_attn_s_per_pair=STEP3_LAYERS * ATTN_PAIR_S_PER_LAYER_HD256,
)
"""Roofline step model: 128 decodes over 1M context tokens take
15 + 10 + 20 = 45 ms; an 8192-token prefill chunk takes about 172 ms."""

STEP3_7_H200 = EngineProfile(
    name="step3.7-h200",
    description="Step3.7-like large MoE (321B/38B active, FP8), one TP8 replica on 8 x H200",
    block_size=GPU_BLOCK_SIZE,
    kv_capacity_tokens=STEP3_KV_TOKENS,
    max_num_seqs=GPU_DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens=GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_model_len=PAPER_MAX_MODEL_LEN,
    vocab_size=128815,  # Step-3 config.json
    eos_token_id=128805,  # assumed end-of-turn id near the top of the vocabulary
    default_length_scale=DEFAULT_LENGTH_SCALE,
    step_time=STEP3_STEP_TIME,
)

# --- tiny-cpu -------------------------------------------------------------------
# The real vLLM CPU server of docs/real-vllm.md: LlamaConfig(vocab 2048, 2 layers,
# 2 KV heads, head_dim 32), random bf16 weights, block size 128.
TINY_DEFAULT_NUM_BLOCKS: int = 64
"""The e2e launch's --num-gpu-blocks-override: 64 x 128 = 8192 tokens."""
TINY_MAX_MODEL_LEN: int = 2048
"""The e2e launch's --max-model-len."""

TINY_STEP_TIME = StepTimeModel(
    # Calibrated against the real vLLM 0.32 CPU server on one pinned core
    # (docs/fidelity.md, "Calibration": straight-line fits of vLLM's own
    # request_prefill_time / request_decode_time histograms, 4 runs): fixed cost
    # per step 2.21-2.32 ms, per prefill token 8.7-12.7 us, per decoding
    # sequence 0.12-0.19 ms. The ~2 ms extra of a step that starts a request is
    # not modelled (the step model has no such term).
    fixed_overhead_s=0.0022,
    prefill_s_per_token=10e-6,
    decode_s_per_seq=150e-6,
    # 2 layers x 2 KV heads x 32 dims x 2 x 2 bytes = 512 B per token; CPU memory
    # at ~20 GB/s effective: 25 ns per token.
    kv_read_s_per_token=25e-9,
)

TINY_CPU = EngineProfile(
    name="tiny-cpu",
    description="The real vLLM CPU server with the tiny random Llama (docs/real-vllm.md)",
    block_size=CPU_BLOCK_SIZE,
    kv_capacity_tokens=TINY_DEFAULT_NUM_BLOCKS * CPU_BLOCK_SIZE,
    max_num_seqs=CPU_DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens=CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_model_len=TINY_MAX_MODEL_LEN,
    vocab_size=2048,
    eos_token_id=2,  # LlamaConfig default
    default_length_scale=1.0,
    step_time=TINY_STEP_TIME,
)

PROFILES: dict[str, EngineProfile] = {p.name: p for p in (QWEN30B_A3B_H100, STEP3_7_H200, TINY_CPU)}
"""All profiles by name."""


def get_profile(name: str) -> EngineProfile:
    """The profile called ``name``; an unknown name is an error that lists the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown engine profile {name!r} (known: {known})") from None
