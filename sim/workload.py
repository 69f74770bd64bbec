"""RL rollout workloads: seeded plans for RLVR / RLHF GRPO groups and agentic trajectories.

Why: the router's admission policy is only as good as the load it is tested
under. The paper's production trace (``docs/misa-t.md``) gives p50 / p95 token
lengths per class; this module fits a lognormal to each pair, draws sessions
from them at full scale, then multiplies every token count by one length scale
(``misat_sim.scale.DEFAULT_LENGTH_SCALE`` = 1/16 by default) so the same
workload runs on simulated engines and on the tiny real vLLM model.

Everything here is pure and deterministic: plan ``i`` of class ``c`` depends
only on ``(seed, c, i)`` and on the phase position it is drawn at, never on
draw order, wall clock or process-global state. Plans are light values: token
ids are derived on demand from a key (``SessionPlan.appended_tokens``), so a
full-scale agentic trajectory of 100K tokens costs a few integers until sent.

Lognormal fit from two quantiles: ``ln X ~ N(mu, sigma)`` with
``mu = ln p50`` and ``sigma = (ln p95 - ln p50) / z95``, ``z95 = 1.64485``.
The arithmetic per class is written out in ``docs/workloads.md``.
"""

from __future__ import annotations

import bisect
import math
import random
from enum import StrEnum
from statistics import NormalDist
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from misat_sim.scale import DEFAULT_LENGTH_SCALE
from misat_sim.token_ids import draw_token_ids

Z95: float = NormalDist().inv_cdf(0.95)
"""Standard-normal 95th percentile (1.64485): links a lognormal's p50 to its p95."""

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class RolloutClass(StrEnum):
    """Workload classes of the paper; the value is the ``X-Rollout-Class`` header."""

    RLVR = "rlvr"
    RLHF = "rlhf"
    AGENTIC = "agentic"


class LengthDist(BaseModel):
    """A lognormal length distribution fitted to a (p50, p95) pair, optionally capped.

    Why two quantiles: they are what the paper publishes; a lognormal is the
    usual shape for long-tailed generation lengths and is fully determined by
    them. ``cap`` clips samples (the RLVR 128K generation limit).
    """

    model_config = _FROZEN
    p50: float = Field(gt=0, description="median, tokens (full scale)")
    p95: float = Field(gt=0, description="95th percentile, tokens (full scale)")
    cap: int | None = Field(default=None, gt=0, description="samples are clipped here")
    source: str = ""

    @model_validator(mode="after")
    def _ordered(self) -> LengthDist:
        if self.p95 < self.p50:
            raise ValueError(f"p95 ({self.p95}) must be >= p50 ({self.p50})")
        return self

    @property
    def mu(self) -> float:
        """Log-space mean: ``ln p50``."""
        return math.log(self.p50)

    @property
    def sigma(self) -> float:
        """Log-space standard deviation: ``(ln p95 - ln p50) / z95``."""
        return (math.log(self.p95) - math.log(self.p50)) / Z95

    def quantile(self, q: float) -> float:
        """The fitted distribution's q-quantile (before any cap)."""
        return math.exp(self.mu + self.sigma * NormalDist().inv_cdf(q))

    def sample(self, rng: random.Random, multiplier: float = 1.0) -> float:
        """One draw times ``multiplier`` (length drift), then clipped at ``cap``."""
        value = rng.lognormvariate(self.mu, self.sigma) * multiplier
        return min(value, float(self.cap)) if self.cap is not None else value


RLVR_OUTPUT_CAP_TOKENS: int = 131_072
"""RLVR generation limit, 128K tokens: the paper's trace "hits the 128K cap"."""

MAX_CONTEXT_TOKENS: int = 131_072
"""Full-scale context limit (prompt + output), 128K: the paper's cap, and the
``max_model_len`` of the simulator's paper profiles, so no plan is refused by an
engine. An RLVR output is therefore clipped at ``min(128K, 128K - prompt)``."""

RLVR_INPUT = LengthDist(p50=156, p95=1129, source="misa-t.md trace table: rlvr input")
"""mu = ln 156 = 5.0499; sigma = ln(1129/156) / 1.64485 = 1.97923 / 1.64485 = 1.2033."""
RLVR_OUTPUT = LengthDist(
    p50=47583, p95=130815, cap=RLVR_OUTPUT_CAP_TOKENS, source="misa-t.md trace table: rlvr output"
)
"""mu = ln 47583 = 10.7702; sigma = ln(130815/47583) / 1.64485 = 1.01131 / 1.64485 = 0.6148."""
RLHF_INPUT = LengthDist(p50=60, p95=2564, source="misa-t.md trace table: rlhf input")
"""mu = ln 60 = 4.0943; sigma = ln(2564/60) / 1.64485 = 3.75498 / 1.64485 = 2.2829."""
RLHF_OUTPUT = LengthDist(p50=7344, p95=24447, source="misa-t.md trace table: rlhf output")
"""mu = ln 7344 = 8.9016; sigma = ln(24447/7344) / 1.64485 = 1.20262 / 1.64485 = 0.7311."""
AGENTIC_INPUT = LengthDist(
    p50=37757, p95=103209, source="misa-t.md trace table: agentic input per turn"
)
"""Pooled over turns. mu = ln 37757 = 10.5389; sigma = ln(103209/37757) / 1.64485 = 0.6114."""
AGENTIC_OUTPUT = LengthDist(
    p50=148, p95=1612, source="misa-t.md trace table: agentic output per turn"
)
"""mu = ln 148 = 4.9972; sigma = ln(1612/148) / 1.64485 = 2.38802 / 1.64485 = 1.4518."""
AGENTIC_TURNS = LengthDist(
    p50=70, p95=100, cap=100, source="~70 turns (misa-t.md table); p95 = DeepSWE's 100 steps"
)
"""Turns per trajectory at full scale. sigma = ln(100/70) / 1.64485 = 0.2168; capped at 100."""

DEFAULT_MIXTURE_PERCENT: dict[RolloutClass, float] = {
    RolloutClass.AGENTIC: 48.6,
    RolloutClass.RLVR: 33.1,
    RolloutClass.RLHF: 18.2,
}
"""The paper's end-to-end target mixture agent/RLVR/RLHF (sums to 99.9; normalised)."""

DEFAULT_GROUP_SIZE: dict[RolloutClass, int] = {RolloutClass.RLVR: 16, RolloutClass.RLHF: 8}
"""GRPO samples per prompt: 16 for RLVR (DAPO recipe: 512 prompts x 16), 8 for RLHF
(the low end of the paper's "8-16 samples of one prompt")."""

DEFAULT_VOCAB_SIZE: int = 2048
"""Matches the tiny real-vLLM model (``bench/tiny_model.py``), so plans run there too."""

DEFAULT_MIN_TOKEN_ID: int = 3
"""Ids below this are the tiny model's special tokens (<unk>, <s>, </s>); never emitted."""


class AgenticShape(BaseModel):
    """How an agentic trajectory is built, beyond the per-turn length tables.

    Context growth: a trajectory draws one target context length per turn from
    the fitted per-turn input lognormal and sorts them, so the context grows
    monotonically while the pooled per-turn inputs keep the table's p50 / p95.
    The log-variance is split between a per-session factor (some tasks are
    big) and within-session spread (growth); a product of independent
    lognormals is lognormal, so the split does not change the pooled fit.
    Turn ``t``'s tool chunk is what is left of the growth after turn ``t-1``'s
    own output (at least ``min_tool_tokens``).
    """

    model_config = _FROZEN
    turns: LengthDist = AGENTIC_TURNS
    turn_scale: float = Field(default=0.25, gt=0, le=1)
    """Turn counts are multiplied by this (ours): a median of about 17 turns instead of 70 keeps
    multi-turn prefix reuse dominant while cutting a trajectory's wall time 4x."""
    min_turns: int = Field(default=2, ge=1)
    """At least two turns, so every trajectory exercises a continuation (ours)."""
    session_variance_share: float = Field(default=0.5, ge=0, le=1)
    """Share of the per-turn input log-variance that is per session (ours): 0.5 gives
    sigma_session = sigma_within = 0.6114 / sqrt(2) = 0.4323, i.e. a trajectory grows
    about 4x from its first turn to its last at ~18 turns."""
    min_tool_tokens: int = Field(default=16, ge=0)
    """Smallest tool-output chunk at full scale (ours: a tool always answers something)."""
    tool_fraction_low: float = Field(default=0.07, ge=0, lt=1)
    tool_fraction_high: float = Field(default=0.23, ge=0, lt=1)
    """Per session, the share of its time spent in tool gaps is uniform in this range
    (the paper: tool gaps are 7-23% of session time)."""
    nominal_decode_tok_s: float = Field(default=20.0, gt=0)
    """Per-sequence decode speed (tokens/s, ours) used to price a turn when turning the
    tool-time share into seconds: gap = f / (1 - f) * turn seconds * jitter."""
    tool_jitter_sigma: float = Field(default=1.0, ge=0)
    """Log-sd of a mean-1 lognormal jitter per gap (ours): tool calls take "seconds to
    minutes" (misa-t.md); sigma 1 puts a gap's p95 at 5.2x its median."""

    @model_validator(mode="after")
    def _range(self) -> AgenticShape:
        if self.tool_fraction_high < self.tool_fraction_low:
            raise ValueError("tool_fraction_high must be >= tool_fraction_low")
        return self


class TraceShapes(BaseModel):
    """Per-class length distributions at full scale; defaults are the paper's trace."""

    model_config = _FROZEN
    rlvr_input: LengthDist = RLVR_INPUT
    rlvr_output: LengthDist = RLVR_OUTPUT
    rlhf_input: LengthDist = RLHF_INPUT
    rlhf_output: LengthDist = RLHF_OUTPUT
    agentic_input: LengthDist = AGENTIC_INPUT
    agentic_output: LengthDist = AGENTIC_OUTPUT

    def input(self, klass: RolloutClass) -> LengthDist:
        """Prompt (per-turn context for agentic) length distribution of a class."""
        return getattr(self, f"{klass.value}_input")

    def output(self, klass: RolloutClass) -> LengthDist:
        """Output (per-turn for agentic) length distribution of a class."""
        return getattr(self, f"{klass.value}_output")


class DriftPoint(BaseModel):
    """One knot of a piecewise-linear output-length multiplier."""

    model_config = _FROZEN
    at: float = Field(ge=0, description="phase position (units released, or seconds)")
    multiplier: float = Field(gt=0)


class MixtureChange(BaseModel):
    """From phase position ``at`` on, the target mixture is ``mixture`` (percent)."""

    model_config = _FROZEN
    at: float = Field(ge=0)
    mixture: dict[RolloutClass, float]


def normalise_mixture(mixture: dict[RolloutClass, float]) -> dict[RolloutClass, float]:
    """Percent or weights -> fractions summing to 1, every class present."""
    if any(v < 0 for v in mixture.values()):
        raise ValueError(f"mixture shares must be >= 0: {mixture}")
    total = sum(mixture.values())
    if total <= 0:
        raise ValueError(f"mixture must have a positive share: {mixture}")
    return {k: mixture.get(k, 0.0) / total for k in RolloutClass}


class WorkloadSpec(BaseModel):
    """Everything that defines a workload; same spec, same plans.

    Phases: ``phase_axis`` says what ``at`` means in ``mixture_changes`` and
    ``output_drift``: ``"units"`` (units released so far; the workload's
    content is then independent of how fast the router serves it, which keeps
    router comparisons fair) or ``"seconds"`` (trainer run time).
    """

    model_config = _FROZEN
    seed: int = 0
    mixture: dict[RolloutClass, float] = Field(
        default_factory=lambda: dict(DEFAULT_MIXTURE_PERCENT)
    )
    mixture_changes: tuple[MixtureChange, ...] = ()
    output_drift: dict[RolloutClass, tuple[DriftPoint, ...]] = Field(default_factory=dict)
    phase_axis: Literal["units", "seconds"] = "units"
    length_scale: float = Field(default=DEFAULT_LENGTH_SCALE, gt=0, le=1)
    vocab_size: int = Field(default=DEFAULT_VOCAB_SIZE, gt=DEFAULT_MIN_TOKEN_ID)
    min_token_id: int = Field(default=DEFAULT_MIN_TOKEN_ID, ge=0)
    max_context_tokens: int = Field(default=MAX_CONTEXT_TOKENS, gt=1)
    """Full scale; scaled with everything else (131,072 / 16 = 8,192)."""
    group_size: dict[RolloutClass, int] = Field(default_factory=lambda: dict(DEFAULT_GROUP_SIZE))
    prompt_scale: float | None = Field(default=None, gt=0, le=1)
    """Scale of RLVR/RLHF prompt lengths; None: ``length_scale``. At 1/16 a GRPO prompt
    is ~10 tokens, under one KV block, so group prefix sharing vanishes (a weak spot of
    the reference model in misa-t.md); 1.0 keeps it visible at a small KV cost."""
    shapes: TraceShapes = TraceShapes()
    agentic: AgenticShape = AgenticShape()
    session_prefix: str | None = None
    """Session ids start with this (default ``w<seed>``); vary it to keep ids unique
    across runs against one long-lived router."""

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        normalise_mixture(self.mixture)
        for change in self.mixture_changes:
            normalise_mixture(change.mixture)
        if self.min_token_id >= self.vocab_size:
            raise ValueError("min_token_id must be < vocab_size")
        for klass, size in self.group_size.items():
            if size < 1:
                raise ValueError(f"group_size[{klass}] must be >= 1")
        return self

    @property
    def prefix(self) -> str:
        """Session-id prefix."""
        return self.session_prefix if self.session_prefix is not None else f"w{self.seed}"

    @property
    def scaled_max_context(self) -> int:
        """The context limit after scaling."""
        return max(2, round(self.max_context_tokens * self.length_scale))

    def mixture_at(self, at: float) -> dict[RolloutClass, float]:
        """Target mixture (fractions) in force at phase position ``at``."""
        current = self.mixture
        for change in sorted(self.mixture_changes, key=lambda c: c.at):
            if at >= change.at:
                current = change.mixture
        return normalise_mixture(current)

    def output_multiplier(self, klass: RolloutClass, at: float) -> float:
        """Output-length multiplier of ``klass`` at ``at``: linear between knots, flat outside."""
        points = sorted(self.output_drift.get(klass, ()), key=lambda p: p.at)
        if not points:
            return 1.0
        xs = [p.at for p in points]
        i = bisect.bisect_right(xs, at)
        if i == 0:
            return points[0].multiplier
        if i == len(points):
            return points[-1].multiplier
        lo, hi = points[i - 1], points[i]
        frac = (at - lo.at) / (hi.at - lo.at) if hi.at > lo.at else 1.0
        return lo.multiplier + frac * (hi.multiplier - lo.multiplier)


def length_drift_spec(
    span: float,
    growth: float = 2.5,
    classes: tuple[RolloutClass, ...] = (RolloutClass.RLVR, RolloutClass.RLHF),
    **fields: Any,
) -> WorkloadSpec:
    """"length-drift": outputs of ``classes`` grow linearly 1x -> ``growth``x over ``span``.

    Why 2.5: RL runs lengthen RLVR/RLHF responses 2-3x as the policy learns to reason.
    """
    drift = (DriftPoint(at=0, multiplier=1.0), DriftPoint(at=span, multiplier=growth))
    return WorkloadSpec(output_drift=dict.fromkeys(classes, drift), **fields)


def mix_shift_spec(
    at: float, mixture: dict[RolloutClass, float], **fields: Any
) -> WorkloadSpec:
    """"mix-shift": the default mixture until ``at``, then ``mixture``."""
    return WorkloadSpec(mixture_changes=(MixtureChange(at=at, mixture=mixture),), **fields)


# --- plans ------------------------------------------------------------------------------


def tokens_for(key: str, n: int, vocab_size: int, min_token_id: int) -> list[int]:
    """``n`` token ids, a pure function of ``key`` (string seeding is hash-seed independent).

    Drawn in bulk, as shared ``int`` objects (``misat_sim.token_ids``).
    """
    return draw_token_ids(random.Random(key), n, min_token_id, vocab_size - min_token_id)


class Turn(BaseModel):
    """One request of a session.

    ``append_len`` tokens (ids from ``token_key``) are appended to the context
    before this turn generates: on turn 0 they are the prompt, later they are
    the tool's output. The prompt of turn ``t`` is therefore
    ``prompt(t-1) + output(t-1) + appended(t)``, with the *actual* output ids.
    """

    model_config = _FROZEN
    append_len: int = Field(ge=0)
    token_key: str
    max_tokens: int = Field(ge=1)
    tool_gap_s: float = Field(default=0.0, ge=0)
    """Simulated tool time after this turn, seconds (0 on the last turn)."""


class SessionPlan(BaseModel):
    """One rollout unit: a GRPO sample (one turn) or an agentic trajectory (many)."""

    model_config = _FROZEN
    klass: RolloutClass
    session_id: str
    group_id: str | None = None
    index: int = Field(ge=0, description="release index of the group / trajectory")
    turns: tuple[Turn, ...] = Field(min_length=1)
    vocab_size: int = DEFAULT_VOCAB_SIZE
    min_token_id: int = DEFAULT_MIN_TOKEN_ID

    def appended_tokens(self, turn: int) -> list[int]:
        """Token ids appended before ``turn`` (the prompt on turn 0)."""
        t = self.turns[turn]
        return tokens_for(t.token_key, t.append_len, self.vocab_size, self.min_token_id)

    def initial_prompt(self) -> list[int]:
        """Turn 0's prompt; identical across the samples of a GRPO group."""
        return self.appended_tokens(0)

    def next_prompt(self, prompt: list[int], output_ids: list[int], turn: int) -> list[int]:
        """Prompt of ``turn`` from the previous prompt and the ids it really produced."""
        return [*prompt, *output_ids, *self.appended_tokens(turn)]

    def synthetic_output(self, turn: int, n: int) -> list[int]:
        """Stand-in output ids when an engine returned none (see docs/workloads.md:
        prefix reuse is then lost from that output onward)."""
        key = f"{self.session_id}:out:{turn}"
        return tokens_for(key, n, self.vocab_size, self.min_token_id)

    def planned_prompt_lens(self) -> list[int]:
        """Prompt length of every turn, assuming each generates exactly ``max_tokens``."""
        lens, context = [], 0
        for t in self.turns:
            context += t.append_len
            lens.append(context)
            context += t.max_tokens
        return lens

    @property
    def last_turn(self) -> int:
        """Index of the final turn (it carries ``X-Session-End``)."""
        return len(self.turns) - 1


def _scaled(tokens: float, scale: float) -> int:
    """Full-scale token count -> scaled, never below one token."""
    return max(1, round(tokens * scale))


def plan_group(
    spec: WorkloadSpec, klass: RolloutClass, index: int, at: float = 0.0
) -> list[SessionPlan]:
    """GRPO group ``index`` of a single-request class: n samples sharing one prompt."""
    if klass is RolloutClass.AGENTIC:
        raise ValueError("agentic sessions are trajectories: use plan_agentic")
    rng = random.Random(f"{spec.seed}:{klass.value}:{index}")
    max_ctx = spec.scaled_max_context
    prompt_scale = spec.length_scale if spec.prompt_scale is None else spec.prompt_scale
    prompt_len = min(_scaled(spec.shapes.input(klass).sample(rng), prompt_scale), max_ctx - 1)
    mult = spec.output_multiplier(klass, at)
    group_id = f"{spec.prefix}-{klass.value}-g{index}"
    key = f"{spec.seed}:{klass.value}:{index}:prompt"
    plans = []
    for j in range(spec.group_size.get(klass, 1)):
        out = _scaled(spec.shapes.output(klass).sample(rng, mult), spec.length_scale)
        turn = Turn(append_len=prompt_len, token_key=key, max_tokens=min(out, max_ctx - prompt_len))
        plans.append(
            SessionPlan(
                klass=klass,
                session_id=f"{group_id}-s{j}",
                group_id=group_id,
                index=index,
                turns=(turn,),
                vocab_size=spec.vocab_size,
                min_token_id=spec.min_token_id,
            )
        )
    return plans


def plan_agentic(spec: WorkloadSpec, index: int, at: float = 0.0) -> SessionPlan:
    """Agentic trajectory ``index``: growing context, tool chunks and tool gaps."""
    shape, scale = spec.agentic, spec.length_scale
    rng = random.Random(f"{spec.seed}:agentic:{index}")
    n_turns = max(shape.min_turns, round(shape.turns.sample(rng) * shape.turn_scale))
    dist_in = spec.shapes.agentic_input
    sigma_s = dist_in.sigma * math.sqrt(shape.session_variance_share)
    sigma_w = dist_in.sigma * math.sqrt(1.0 - shape.session_variance_share)
    session_z = rng.gauss(0.0, 1.0)
    targets = sorted(
        math.exp(dist_in.mu + sigma_s * session_z + sigma_w * rng.gauss(0.0, 1.0))
        for _ in range(n_turns)
    )
    mult = spec.output_multiplier(RolloutClass.AGENTIC, at)
    outs = [_scaled(spec.shapes.agentic_output.sample(rng, mult), scale) for _ in range(n_turns)]
    fraction = rng.uniform(shape.tool_fraction_low, shape.tool_fraction_high)
    turn_s = (sum(outs) / n_turns) / shape.nominal_decode_tok_s
    jitter_mu = -(shape.tool_jitter_sigma**2) / 2.0  # mean-1 jitter keeps the expected share
    mean_gap_s = fraction / (1.0 - fraction) * turn_s
    gaps = [
        mean_gap_s * rng.lognormvariate(jitter_mu, shape.tool_jitter_sigma) for _ in range(n_turns)
    ]
    min_tool = round(shape.min_tool_tokens * scale)
    max_ctx = spec.scaled_max_context
    session_id = f"{spec.prefix}-agentic-{index}"
    turns: list[Turn] = []
    context = 0  # tokens before this turn's append: previous prompt + previous output
    for t in range(n_turns):
        target = _scaled(targets[t], scale)
        append = min(target, max_ctx - 1) if t == 0 else max(min_tool, target - context)
        if t > 0 and context + append + outs[t] > max_ctx:
            break  # the context limit ends the trajectory, as agent frameworks do
        max_tokens = min(outs[t], max_ctx - context - append)
        turns.append(
            Turn(
                append_len=append,
                token_key=f"{session_id}:in:{t}",
                max_tokens=max_tokens,
                tool_gap_s=gaps[t],
            )
        )
        context += append + max_tokens
    last = turns[-1].model_copy(update={"tool_gap_s": 0.0})
    return SessionPlan(
        klass=RolloutClass.AGENTIC,
        session_id=session_id,
        index=index,
        turns=(*turns[:-1], last),
        vocab_size=spec.vocab_size,
        min_token_id=spec.min_token_id,
    )


def plan_release(
    spec: WorkloadSpec, klass: RolloutClass, index: int, at: float = 0.0
) -> list[SessionPlan]:
    """The units released together: a GRPO group, or one trajectory."""
    if klass is RolloutClass.AGENTIC:
        return [plan_agentic(spec, index, at)]
    return plan_group(spec, klass, index, at)


class MixtureDrawer:
    """Picks the next class so released units track a (changing) target mixture.

    Largest-deficit rule over units released since the target last changed:
    pick ``argmax_c (p_c * n - n_c)``, ties to the larger share. Deterministic,
    and the released mixture stays within one release (a GRPO group) of the
    target at all times, which a random draw would not guarantee.
    """

    def __init__(self) -> None:
        self._target: dict[RolloutClass, float] | None = None
        self._counts: dict[RolloutClass, int] = dict.fromkeys(RolloutClass, 0)

    def pick(self, target: dict[RolloutClass, float]) -> RolloutClass:
        """The class to release next under ``target`` (fractions)."""
        if target != self._target:
            self._target = dict(target)
            self._counts = dict.fromkeys(RolloutClass, 0)
        total = sum(self._counts.values())
        candidates = [c for c in RolloutClass if target[c] > 0]
        return max(candidates, key=lambda c: (target[c] * total - self._counts[c], target[c]))

    def record(self, klass: RolloutClass, units: int) -> None:
        """Count ``units`` released for ``klass``."""
        self._counts[klass] += units


class Workload:
    """Draws releases from a spec in order; the only state is counters.

    ``draw(at)`` returns the next release (a GRPO group or one trajectory) of
    the class the mixture drawer picks at phase position ``at``.
    """

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self._drawer = MixtureDrawer()
        self._next_index: dict[RolloutClass, int] = dict.fromkeys(RolloutClass, 0)
        self.units_released = 0

    def draw(self, at: float | None = None) -> list[SessionPlan]:
        """Next release. ``at`` defaults to units released so far (the ``units`` axis)."""
        position = float(self.units_released) if at is None else at
        klass = self._drawer.pick(self.spec.mixture_at(position))
        index = self._next_index[klass]
        self._next_index[klass] += 1
        plans = plan_release(self.spec, klass, index, position)
        self._drawer.record(klass, len(plans))
        self.units_released += len(plans)
        return plans

    def draw_batch(self, units: int, at: float | None = None) -> list[SessionPlan]:
        """Releases until at least ``units`` units (whole GRPO groups: may exceed by < 1 group)."""
        batch: list[SessionPlan] = []
        while len(batch) < units:
            batch.extend(self.draw(at))
        return batch
