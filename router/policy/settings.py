"""Every constant the policies use, as named settings with documented defaults.

Units are in the field names or descriptions. Where the MISA-T paper gives no
value, the default is this project's choice and its description says so
("project default"); the benchmark (``misat bench``) is where such defaults
were chosen, and ``docs/policy.md`` records the measurements.

Models are frozen and strict about unknown fields: a typo in a setting is a
start-up error naming the path, never a silently ignored key.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PolicyName(StrEnum):
    """Policies behind the one interface. The first three are MISA-T and its ablations."""

    MISA_T = "misa-t"
    """Session admission + per-class KV budgets weighted by N * k * T."""
    MISA = "misa"
    """Session admission + per-class KV budgets weighted by N * k (no residency time)."""
    SESSION_ADMISSION = "session-admission"
    """Adaptive per-engine session caps only; no per-class budgets."""
    CACHE_AWARE = "cache-aware"
    """The vLLM Router's ``cache_aware`` policy, re-implemented exactly."""
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"

    @property
    def uses_admission(self) -> bool:
        return self in (PolicyName.MISA_T, PolicyName.MISA, PolicyName.SESSION_ADMISSION)

    @property
    def uses_class_budgets(self) -> bool:
        return self in (PolicyName.MISA_T, PolicyName.MISA)

    @property
    def uses_residency(self) -> bool:
        return self is PolicyName.MISA_T


Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
Percentile = Annotated[float, Field(gt=0.0, le=100.0)]


class PrefixIndexSettings(_Settings):
    """The router's own index of what each engine's prefix cache probably holds."""

    block_size: int = Field(
        16, ge=1, le=4096,
        description="Tokens per hashed block; match vLLM's KV block size (16 on GPU, 128 on CPU).",
    )
    max_blocks_per_engine: int = Field(
        1 << 20, ge=1,
        description="LRU bound on indexed blocks per engine (project default: far above any "
        "engine's KV so the engine's own eviction, not the index, is what trims reuse).",
    )
    capacity_multiple: float = Field(
        1.0, gt=0.0,
        description="Each engine's index keeps at most this many times the engine's KV blocks "
        "(project default: an engine cannot cache more than its KV, so older keys are stale).",
    )
    text_chunk_chars: int = Field(
        64, ge=1,
        description="Characters per hashed chunk of a text prompt (project default). Text prompts "
        "are indexed without tokenising, so they need no round trip to an engine.",
    )
    chars_per_token: float = Field(
        4.0, gt=0.0,
        description="Characters per token used to turn a text prefix match into tokens and to "
        "estimate a text prompt's length (project default; typical of BPE vocabularies).",
    )
    session_prompt_cache_symbols: int = Field(
        1 << 20, ge=0,
        description="Token ids (or characters) of multi-turn sessions' last prompts kept, least "
        "recently placed dropped first, so that a session's next turn reuses their block keys "
        "instead of hashing its whole context again. A cost bound only: decisions are the same at "
        "any value, 0 turns the reuse off (project default: 2^20 ids, 8 MiB of references plus up "
        "to 32 MiB of int objects in the live router, where every body's ids are new objects).",
    )


class PlacementSettings(_Settings):
    """Cost ``c(r, w) = d_w + (L_r - H_{r,w}) / mu_w`` (seconds)."""

    prefill_tokens_per_s: float = Field(
        20_000.0, gt=0.0,
        description="mu_w: prefill rate of one engine in tokens/s (project default; order of a "
        "30B-A3B MoE replica on H100s). Only ratios between engines' costs matter when all "
        "engines are alike.",
    )
    delay_per_waiting_s: float = Field(
        0.05, ge=0.0,
        description="Backlog delay d_w added per request the engine reports waiting (project default).",
    )
    delay_per_inflight_s: float = Field(
        0.002, ge=0.0,
        description="Backlog delay d_w added per request the router has in flight on the engine "
        "(project default; about one decode step's share of a full batch).",
    )


class FootprintSettings(_Settings):
    """k_b: the KV tokens a session of class b holds, from recently completed sessions."""

    statistic: str = Field(
        "occupancy", pattern="^(peak|mean|occupancy)$",
        description="'occupancy' (default): the KV a session holds on average over its residency, "
        "weighted by residency (sum of KV token-seconds over sum of seconds, each request counted "
        "at its prompt plus half its output while it runs and each gap between requests at the "
        "whole context): what a live session holds at a random moment, by Little's law, so the "
        "caps track the KV sessions actually hold whatever the shape of their growth; chosen on "
        "the benchmark matrix (docs/policy.md). 'peak': a session's largest prompt+output, at "
        "'percentile' (the default until 2026-12-05, at p25); 'mean': half of the peak, the time "
        "average of a linearly growing context.",
    )
    percentile: Percentile = Field(
        25.0,
        description="Percentile of the recent footprints used as k_b with the 'peak' and 'mean' "
        "statistics ('occupancy' is one ratio over the window and ignores it). p25 was chosen by "
        "measurement when 'peak' was the default (docs/policy.md, misat_bench.choose_defaults): "
        "on the paper's mixture it matched the best static ceiling (0.99x) with engines 77% "
        "full; p35 0.96x, the median 0.90x (56% full), p90 0.69x (28% full): sessions grow, so "
        "they hold well under their peak on average.",
    )
    window: int = Field(256, ge=1, description="Completed sessions remembered per class.")
    min_samples: int = Field(
        4, ge=1, description="Completions needed before the estimate replaces the bootstrap value."
    )
    bootstrap_tokens: int = Field(
        65536, ge=1,
        description="Prior for k_b before a class has min_samples completions (project default, "
        "in real tokens: half of a 128K context, since an agentic or long RLVR session may grow "
        "that far; too small a prior over-admits long sessions at start-up, which then cannot be "
        "taken back). Until then k_b is the larger of this and the mean size seen so far of the "
        "class's live sessions. A class may override it; simulated pools with scaled lengths "
        "scale it too.",
    )


class ResidencySettings(_Settings):
    """T_b: how long a session of class b keeps KV resident, tool gaps included."""

    percentile: Percentile = Field(50.0, description="Percentile of recent residency times.")
    window: int = Field(256, ge=1, description="Completed sessions remembered per class.")
    min_samples: int = Field(
        4, ge=1,
        description="Observations needed before T_b is used (completed sessions, plus live ones when "
        "``censored``); until then a class gets the mean T of the classes that have one (or 1 when "
        "none has), i.e. no tilt.",
    )
    censored: bool = Field(
        False,
        description="Count live sessions as censored observations (each has stayed at least its age "
        "so far) and take a Kaplan-Meier percentile, refreshed at each metrics scrape. Without it T_b "
        "sees completed sessions only, so at start-up it is the residency of the short ones (RLVR's "
        "median climbed 1 s -> 64 s -> 116 s before settling near 95 s). When too few have finished "
        "for the percentile to be reached, T_b is the oldest observation (a lower bound).",
    )
    exponent: float = Field(
        1.0, ge=0.0, le=2.0,
        description="Shape of MISA-T's time factor: R_{w,b} = N_{w,b} * k_b * T_b ** exponent (1: the "
        "paper's, the default: best worst cell on benchmark v2's matrix; 0.5, damped: a little better "
        "on average but 0.78x of the oracle under length drift; 0: none, as MISA).",
    )


class SessionAdmissionSettings(_Settings):
    """Adaptive per-engine session caps and the hit-rate guard on new sessions."""

    epoch_s: float = Field(
        0.5, gt=0.0,
        description="Seconds between re-evaluations of held work and of the hit-rate guard "
        "(project default; about two scrapes).",
    )
    max_kv_usage_for_new_sessions: Fraction = Field(
        0.95,
        description="No new session opens on an engine whose last scrape shows more of its KV in "
        "use by running requests than this (project default): past it vLLM starts preempting, "
        "whatever the footprint estimates say. Continuations are never gated.",
    )
    sessions_before_capacity_known: int = Field(
        4, ge=0,
        description="K_w of an engine whose KV capacity no scrape has reported yet (project "
        "default): enough to start work while the first scrape arrives, few enough that a burst "
        "at start-up cannot flood an engine of unknown size.",
    )
    min_sessions_per_engine: int = Field(
        1, ge=1,
        description="K_w never falls below this, so every engine keeps making progress. K_w = "
        "floor(C_w * budget / k_ref), k_ref = the class footprints k_b averaged over the "
        "unfinished (live + held) sessions: how many sessions of today's size fit.",
    )
    max_sessions_per_engine: int = Field(
        4096, ge=1, description="Upper bound on K_w (guards against a tiny reference footprint)."
    )
    healthy_hit_decay: Fraction = Field(
        0.9999,
        description="Per-sample decay of the healthy hit-rate reference h*: h* = max(h, h* * "
        "decay), so it tracks a recent healthy level rather than a fixed threshold. 0.9999 (the "
        "default; about 1.2% a minute at two samples a second) remembers the level the engine had "
        "before sessions piled up, so a hit rate that sinks slowly still reads as a gap; 0.98 (2% a "
        "sample, the default until 2026-12-04) forgets it within a minute and let hits fall 12 "
        "points below the workload's ideal on benchmark v2's matrix (docs/policy.md).",
    )
    hit_ewma_alpha: Fraction = Field(
        0.5, description="Smoothing of the per-epoch hit rate h_w (weight of the newest epoch)."
    )
    degradation_tolerance: Fraction = Field(
        0.05,
        description="G_w = h* - h_w must exceed this (absolute hit-rate points / 100) to count "
        "as degraded (project default).",
    )
    degradation_cost_tolerance: float = Field(
        0.05, ge=0.0,
        description="A hit-rate gap also counts as degraded only when the prompt tokens it loses "
        "per second (G_w times the engine's looked-up prompt tokens per second) exceed this share "
        "of placement.prefill_tokens_per_s, so that setting's absolute value matters here. An engine "
        "that sees few prompt tokens (long decodes) loses little to a hit gap, and a cut there turns "
        "away the sessions its decode batch lives on. 0.05 (the default) with healthy_hit_decay "
        "0.9999 had the best worst cell on benchmark v2's matrix against each cell's oracle (0.979x "
        "against 0.972x for 0 with decay 0.98) and the smallest hit gap (7.0 points against 12.0); "
        "0 counts every gap over degradation_tolerance, as in the paper (docs/policy.md).",
    )
    confirm_epochs: int = Field(
        3, ge=1,
        description="Consecutive degraded epochs before the new-session cap is cut (project default).",
    )
    cut_gain: float = Field(
        2.0, ge=0.0,
        description="On confirmed degradation the new-session factor becomes at most "
        "1 - cut_gain * G_w / h* (project default).",
    )
    min_new_session_factor: Fraction = Field(
        0.25, description="Floor of the new-session factor (project default)."
    )
    recovery_per_epoch: Fraction = Field(
        0.05,
        description="Additive recovery of the new-session factor per healthy epoch (project default).",
    )
    min_queries_per_epoch: float = Field(
        256.0, ge=0.0,
        description="Prompt tokens an engine must have looked up in an epoch for its hit rate to "
        "count as a sample; quieter epochs neither confirm nor clear degradation.",
    )
    session_idle_timeout_s: float = Field(
        600.0, gt=0.0,
        description="A multi-turn session with no request for this long is ended (frees its budget).",
    )
    release_order: Literal["arrival", "longest-first"] = Field(
        "arrival",
        description="Which held new sessions go first when room appears. arrival: oldest first "
        "(each class in its own order). longest-first: classes with the longest recent residency "
        "(T_b) first, then by arrival, and a new session waits while a longer class has sessions "
        "held: an iteration's long rollouts start before its short ones, so fewer of them are "
        "still running when the rest of the batch is done.",
    )


class CacheAwareSettings(_Settings):
    """The vLLM Router ``cache_aware`` knobs, with its defaults (vllm-router 0.1.17)."""

    cache_threshold: Fraction = 0.3
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1.0)
    eviction_interval_s: float = Field(120.0, gt=0.0)
    max_tree_size: int = Field(1 << 25, ge=1)


class PolicySettings(_Settings):
    """The policy and all of its knobs; the router config and RolloutPool carry this."""

    name: PolicyName = Field(
        PolicyName.SESSION_ADMISSION,
        description="misa-t, misa, session-admission (MISA-T and its ablations), cache-aware (the "
        "vLLM Router's policy), least-loaded or round-robin. Default session-admission (MISA-T's "
        "adaptive session caps without its per-class KV budgets), chosen on benchmark v2 by the rule "
        "in docs/policy.md (the highest worst-cell ratio to each cell's own oracle over the whole "
        "matrix, mixture-constrained, mean over seeds; the figures are there).",
    )
    budget_basis: Literal["demand", "target"] = Field(
        "demand",
        description="What splits an engine's KV budget among classes. demand (the paper's): "
        "R_{w,b} = N_{w,b} * k_b (* T_b), N the class's unfinished sessions (live on the engine plus "
        "an even share of the held). target (misa-t only): R_b = share_b * k_b * T_b ** "
        "residency.exponent, share_b the class's target share of completed units: by Little's law a "
        "class completes units at its share when share * T of its sessions are in flight. Each class "
        "is capped at what its unfinished sessions could use (live on the engine plus all its held, "
        "times k_b), and what that frees is shared among the others again.",
    )
    kv_budget_fraction: Fraction = Field(
        0.9,
        description="Share of each engine's KV the router may allocate to sessions (the rest "
        "absorbs growth between scrapes). With the default footprint (occupancy) 0.9 measured "
        "best of 0.7, 0.8, 0.9, 0.95 and 1.0 on the benchmark matrix: below it the rate falls, above "
        "it the rate is flat and prefix hits fall (docs/policy.md). Where prefix hits matter more "
        "than the last percent of rate, 0.8 kept every cell's hit within 2.8 points of the ideal "
        "(0.9: 5.6) at 1.2% less rate on average.",
    )
    concurrency_limit: int | None = Field(
        None, ge=1,
        description="Static global limit on in-flight requests with a FIFO queue, as the vLLM "
        "Router's --max-concurrent-requests. None: no limit. Usable with any policy.",
    )
    prefix: PrefixIndexSettings = PrefixIndexSettings()
    placement: PlacementSettings = PlacementSettings()
    admission: SessionAdmissionSettings = SessionAdmissionSettings()
    footprint: FootprintSettings = FootprintSettings()
    residency: ResidencySettings = ResidencySettings()
    cache_aware: CacheAwareSettings = CacheAwareSettings()

    @field_validator("budget_basis")
    @classmethod
    def _target_basis_needs_residency(cls, value: str, info: ValidationInfo) -> str:
        # A field validator, so the error is located at the field (the operator names it in
        # the manifest's camelCase); ``name`` is declared first, so it is validated by now.
        name = info.data.get("name")
        if value == "target" and isinstance(name, PolicyName) and not name.uses_residency:
            raise ValueError(
                f"target weighs classes by their residency time, which only misa-t estimates; "
                f"the policy is {name.value}"
            )
        return value


class ClassSpec(_Settings):
    """One workload class: its target share and budget bounds."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9_]*[a-z0-9])?$", max_length=63)
    share: float = Field(ge=0.0, le=100.0, description="Target share of completed units, percent.")
    multi_turn: bool = Field(
        False,
        description="Sessions span several requests (agentic). Single-request classes end a "
        "session when its request completes.",
    )
    min_share: Fraction | None = Field(
        None, description="Least share of each engine's KV budget this class may always use."
    )
    max_share: Fraction | None = Field(
        None, description="Largest share of each engine's KV budget this class may use."
    )
    bootstrap_footprint_tokens: int | None = Field(
        None, ge=1, description="Overrides footprint.bootstrap_tokens for this class."
    )

    @model_validator(mode="after")
    def _bounds(self) -> ClassSpec:
        if self.min_share is not None and self.max_share is not None and self.min_share > self.max_share:
            raise ValueError(f"min_share {self.min_share} is above max_share {self.max_share}")
        return self


class WorkloadMix(_Settings):
    """The trainer's workload classes; shares sum to 100."""

    classes: tuple[ClassSpec, ...] = Field(min_length=1)
    default_class: str | None = Field(
        None, description="Class for unlabelled requests; None means labels are required."
    )

    @model_validator(mode="after")
    def _consistent(self) -> WorkloadMix:
        names = [c.name for c in self.classes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"class names must be unique, repeated: {', '.join(dupes)}")
        total = sum(c.share for c in self.classes)
        if abs(total - 100.0) > 1e-6:
            raise ValueError(f"class shares must sum to 100, they sum to {total:g}")
        mins = sum(c.min_share or 0.0 for c in self.classes)
        if mins > 1.0 + 1e-9:
            raise ValueError(f"min_share values sum to {mins:g}, above 1")
        if self.default_class is not None and self.default_class not in names:
            raise ValueError(f"default_class {self.default_class!r} is not one of {names}")
        return self

    def get(self, name: str) -> ClassSpec | None:
        for c in self.classes:
            if c.name == name:
                return c
        return None

    @property
    def target(self) -> dict[str, float]:
        """Target mixture as fractions summing to 1."""
        return {c.name: c.share / 100.0 for c in self.classes}
