"""How long one engine step takes: the simulator's only notion of compute.

A vLLM V1 step runs one forward pass over everything the scheduler picked:
prefill chunks (many tokens of one request) and decodes (one token per running
sequence). We model its duration as a linear function of what the step does::

    t = fixed_overhead_s
        + prefill_s_per_token * prefill_tokens     # GEMMs over new prompt tokens
        + decode_s_per_seq    * decoding_seqs      # per-sequence decode work
        + kv_read_s_per_token * kv_tokens_read     # attention reads the KV it attends to
        + prefill_attn_s_per_pair * attn_pairs     # prefill attention compute: new x attended tokens

- ``fixed_overhead_s``: what a step costs however small: weight streaming
  for a memory-bound decode (an MoE at batch size touches most experts),
  collective launches under tensor parallelism, the scheduler and sampler.
- ``prefill_s_per_token``: compute-bound cost of one prompt token
  (about 2 x active parameters FLOPs, over the replica's achieved FLOP/s).
- ``decode_s_per_seq``: per-sequence cost of a decode (its share of GEMMs,
  sampling, input preparation).
- ``prefill_attn_s_per_pair``: attention FLOPs of one (new token, attended
  token) pair, over achieved attention FLOP/s. A chunk of ``n`` new tokens
  after ``c`` computed ones has ``n * c + n (n + 1) / 2`` pairs, so recomputing
  a long agentic context costs more than its length times a per-token price:
  at 40K tokens this term about doubles a 30B-A3B prefill. Measured on an
  H200 by ``bench/gpu_attention_calibration.py`` (docs/simulator.md).
- ``kv_read_s_per_token``: bytes of KV per token on one GPU over achieved HBM
  bandwidth; ``kv_tokens_read`` is the sum, over scheduled requests, of the
  context each one attends over (computed tokens plus the new ones).

The linear form is what roofline reasoning gives for a batch that is either
memory-bound (decode: weights + KV reads) or compute-bound (prefill), and it is
what simulators such as vidur fit per operator; its constants live in
``sim/profiles.py`` with their sources.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StepTimeModel(BaseModel):
    """Constants of the linear step-time model (all in seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fixed_overhead_s: float = Field(ge=0.0, description="Cost of any step, seconds.")
    prefill_s_per_token: float = Field(ge=0.0, description="Seconds per prefill token.")
    decode_s_per_seq: float = Field(ge=0.0, description="Seconds per decoding sequence.")
    kv_read_s_per_token: float = Field(
        ge=0.0, description="Seconds per KV token read by attention in the step."
    )
    prefill_attn_s_per_pair: float = Field(
        0.0, ge=0.0, description="Seconds per (new prefill token, attended token) pair."
    )

    def step_duration(
        self, prefill_tokens: int, decoding_seqs: int, kv_tokens_read: int, attn_pairs: int = 0
    ) -> float:
        """Duration of one step that does the given work."""
        return (
            self.fixed_overhead_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decoding_seqs
            + self.kv_read_s_per_token * kv_tokens_read
            + self.prefill_attn_s_per_pair * attn_pairs
        )

    def decode_run_duration(self, num_steps: int, decoding_seqs: int, kv_tokens_read: int) -> float:
        """Total duration of ``num_steps`` consecutive pure-decode steps.

        Step ``i`` (from 0) reads ``kv_tokens_read + i * decoding_seqs`` KV tokens,
        because each sequence's context grows by one token per step, so the sum
        is an arithmetic series in closed form.
        """
        if num_steps <= 0:
            return 0.0
        base = self.step_duration(0, decoding_seqs, kv_tokens_read)
        growth = self.kv_read_s_per_token * decoding_seqs
        return num_steps * base + growth * num_steps * (num_steps - 1) / 2.0

    def decode_steps_starting_before(
        self, budget_s: float, decoding_seqs: int, kv_tokens_read: int, max_steps: int
    ) -> int:
        """How many consecutive pure-decode steps start strictly before ``budget_s``.

        Step ``i`` starts after the first ``i`` steps, at
        ``decode_run_duration(i, ...)``; step 0 starts at 0 and counts when
        ``budget_s > 0``. The answer is capped at ``max_steps``.
        """
        if budget_s <= 0.0 or max_steps <= 0:
            return 0
        lo, hi = 1, max_steps  # step 0 always starts before a positive budget
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_run_duration(mid - 1, decoding_seqs, kv_tokens_read) < budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def scaled_for_lengths(self, length_scale: float) -> StepTimeModel:
        """The model for an engine whose token lengths are multiplied by ``length_scale``.

        A scaled token stands for ``1 / length_scale`` real context tokens, so
        attention over a scaled context must cost what the real context costs:
        the KV-read coefficient is divided by ``length_scale``. Prefill and
        per-sequence costs are per token / per step and stay as they are, so
        the scaled engine runs the same work ``1 / length_scale`` times faster
        in modelled time, uniformly (see docs/simulator.md).
        """
        # A scaled pair stands for 1 / length_scale^2 real pairs, and the scaled engine runs
        # all work 1 / length_scale times faster: net, divide by length_scale like KV reads.
        return self.model_copy(update={
            "kv_read_s_per_token": self.kv_read_s_per_token / length_scale,
            "prefill_attn_s_per_pair": self.prefill_attn_s_per_pair / length_scale,
        })
