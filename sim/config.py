"""Configuration of one simulated engine: a profile plus vLLM-style overrides.

``SimEngineConfig`` is the boundary model (CLI flags, the local runner, tests
build it); ``resolve()`` turns it into ``EngineLimits``, the effective numbers
the engine model runs with, after the length scale is applied. Keeping the two
apart means the engine never re-derives a default and every effective value
can be printed and exported (``vllm:cache_config_info``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from misat_sim.profiles import EngineProfile, get_profile
from misat_sim.step_time import StepTimeModel

DEFAULT_TIME_SCALE: float = 50.0
"""Modelled seconds per wall second in the HTTP server: a modelled 50 ms step takes 1 ms."""


class SimEngineConfig(BaseModel):
    """What a simulated engine is asked to be (the ``misat sim-engine`` flags)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    profile: str = Field(default="qwen30b-a3b-h100", description="Name in misat_sim.profiles.")
    served_model_name: str | None = Field(
        default=None, description="Model name the server answers to; default: the profile name."
    )
    seed: int = Field(default=0, description="Seed of generated token ids and EOS positions.")
    time_scale: float = Field(
        default=DEFAULT_TIME_SCALE, gt=0.0, description="Modelled seconds per wall second."
    )
    length_scale: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Factor on KV capacity and max_model_len; default: the profile's.",
    )
    num_gpu_blocks: int | None = Field(default=None, gt=1, description="KV blocks (overrides).")
    block_size: int | None = Field(default=None, gt=0, description="Tokens per KV block.")
    max_num_seqs: int | None = Field(default=None, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    max_model_len: int | None = Field(default=None, gt=1)
    enable_prefix_caching: bool = True
    engine_index: int = Field(default=0, ge=0, description="Value of the `engine` metric label.")

    def model_name(self) -> str:
        """The served model name."""
        return self.served_model_name or self.profile

    def resolve(self) -> EngineLimits:
        """Effective limits: profile values, scaled, then explicit overrides.

        The length scale multiplies KV capacity and ``max_model_len`` (workloads
        scale token lengths by the same factor) and divides the step model's
        KV-read cost (see ``StepTimeModel.scaled_for_lengths``). Explicit
        overrides are taken as given, unscaled, as vLLM flags would be.
        """
        profile: EngineProfile = get_profile(self.profile)
        scale = self.length_scale if self.length_scale is not None else profile.default_length_scale
        block_size = self.block_size or profile.block_size
        if self.num_gpu_blocks is not None:
            num_gpu_blocks = self.num_gpu_blocks
        else:
            num_gpu_blocks = max(2, int(profile.kv_capacity_tokens * scale) // block_size)
        max_model_len = self.max_model_len or max(2, int(profile.max_model_len * scale))
        step_time = profile.step_time if scale == 1.0 else profile.step_time.scaled_for_lengths(scale)
        limits = EngineLimits(
            profile=profile.name,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_num_seqs=self.max_num_seqs or profile.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or profile.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            vocab_size=profile.vocab_size,
            eos_token_id=profile.eos_token_id,
            length_scale=scale,
            seed=self.seed,
            step_time=step_time,
        )
        if (num_gpu_blocks - 1) * block_size < max_model_len:
            # vLLM refuses to start when one max-length request cannot fit. It counts the
            # reserved null block in; we do not, so a lone max-length request cannot
            # preempt itself forever.
            raise ValueError(
                f"KV cache of {num_gpu_blocks} blocks (one reserved) x {block_size} tokens is "
                f"smaller than max_model_len {max_model_len}; raise num_gpu_blocks or lower max_model_len"
            )
        return limits


class EngineLimits(BaseModel):
    """Effective, scaled numbers one engine model runs with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    profile: str
    block_size: int = Field(gt=0)
    num_gpu_blocks: int = Field(gt=1, description="Including vLLM's reserved null block.")
    max_num_seqs: int = Field(gt=0)
    max_num_batched_tokens: int = Field(gt=0)
    max_model_len: int = Field(gt=1)
    enable_prefix_caching: bool
    vocab_size: int = Field(gt=3)
    eos_token_id: int = Field(ge=0)
    length_scale: float = Field(gt=0.0, le=1.0)
    seed: int
    step_time: StepTimeModel

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the usable blocks hold (the null block excluded)."""
        return (self.num_gpu_blocks - 1) * self.block_size
