"""The vLLM Router's ``cache_aware`` policy (vllm-router 0.1.x), re-implemented as the baseline.

Algorithm, per request:

1. Load is the router's own in-flight request count per engine (``self.load``);
   it reads no engine metrics. ``min``/``max`` are taken over every engine in
   the snapshot, healthy or not (the Rust source folds over all workers of the
   model); engines outside the snapshot do not count.
2. Imbalanced if ``max - min > balance_abs_threshold`` and
   ``max > balance_rel_threshold * min``: place on the least-loaded healthy
   engine (``Reason.IMBALANCE``), without looking at prefixes.
3. Otherwise match the prompt in the prefix tree. Match rate of an engine =
   matched length / prompt length (0 for an empty or absent prompt). If the
   best rate over healthy engines is strictly above ``cache_threshold``, place
   on the best-matching engine (``Reason.CACHE_HIT``); when several match
   equally, on the one that has held that prefix node longest, as the Rust
   tree's cached ``last_tenant`` does (load plays no part there).
4. Else the least-loaded healthy engine (``Reason.CACHE_MISS``).

Ties in load break by sorted engine id. Whatever the branch, ``on_placed``
inserts the prompt for the chosen engine (the Rust policy inserts inside its
selection; here ``decide`` stays pure). Token-id prompts use one tree (sizes in
tokens); text prompts (``prompt_text`` without ids, or with empty ids) use a
second tree over the text's characters (sizes in characters), as the Rust
router's tree is. A request with neither (or only empty ones) matches nothing
and inserts nothing.
``on_epoch`` runs the LRU sweep once ``eviction_interval_s`` has passed since
the last sweep (the first ``on_epoch`` starts the clock, as the Rust eviction
thread sleeps one interval before its first sweep). ``Decision.scores`` holds
the match rate of every healthy engine on the cache branches.

Knobs (``PolicySettings.cache_aware``, defaults of vllm-router 0.1.17):

- ``cache_threshold`` (0..1, 0.3): a match rate must exceed it to count as a hit;
  exactly equal is a miss.
- ``balance_abs_threshold`` (>= 0 requests, 64) and ``balance_rel_threshold``
  (>= 1, 1.5): both must be exceeded for the load to count as imbalanced.
- ``eviction_interval_s`` (> 0 s, 120): time between LRU sweeps.
- ``max_tree_size`` (>= 1, 2^25): per-engine bound on the tree, in tokens
  (token-id tree) or characters (text tree), enforced at each sweep.

Where this differs from ``docs/misa-t.md`` (the Rust source wins): a hit goes
to the earliest holder among the best matches, not the least-loaded one;
min/max load include unhealthy engines in the snapshot. Where it differs from
the Rust source: only healthy engines are matched (the Rust policy matches all,
and when the winner is unhealthy drops it from the tree and falls back to the
first healthy worker without inserting, a mutation ``decide`` may not make);
the Rust tree is keyed on the characters of the request's routing text ("raw
text characters instead of token IDs"), where this one keys token-id prompts
on their ids, as misa-t.md specifies.
"""

from __future__ import annotations

from .base import Engines, Policy, healthy_ids
from .radix_tree import RadixTree, text_tree, token_tree
from .settings import PolicyName, PolicySettings, WorkloadMix
from .types import Decision, Reason, RequestMeta


class CacheAwarePolicy(Policy):
    """Prefix affinity unless the router's own load count is imbalanced."""

    name = PolicyName.CACHE_AWARE

    def __init__(self, settings: PolicySettings, mix: WorkloadMix) -> None:
        super().__init__(settings, mix)
        self.knobs = settings.cache_aware
        self.tokens: RadixTree[tuple[int, ...]] = token_tree()
        self.text: RadixTree[str] = text_tree()
        self._last_sweep: float | None = None

    # ---- deciding -------------------------------------------------------

    def decide(self, req: RequestMeta, engines: Engines, now: float) -> Decision:
        healthy = healthy_ids(engines)
        if not healthy:
            return Decision.hold(Reason.HOLD_NO_ENGINE)
        if self._imbalanced(engines):
            return Decision.place(self._least_loaded(healthy), Reason.IMBALANCE)
        rates = self._match_rates(req, healthy)
        best = max(rates.values(), default=0.0)
        if best > self.knobs.cache_threshold:
            winner = next(e for e, r in rates.items() if r == best)
            return Decision.place(winner, Reason.CACHE_HIT, self._scores(rates, healthy))
        return Decision.place(
            self._least_loaded(healthy), Reason.CACHE_MISS, self._scores(rates, healthy)
        )

    def _imbalanced(self, engines: Engines) -> bool:
        loads = [self.load.get(e) for e in engines]
        lo, hi = min(loads), max(loads)
        return (
            hi - lo > self.knobs.balance_abs_threshold
            and hi > self.knobs.balance_rel_threshold * lo
        )

    def _least_loaded(self, healthy: list[str]) -> str:
        return min(healthy, key=lambda e: (self.load.get(e), e))

    def _match_rates(self, req: RequestMeta, healthy: list[str]) -> dict[str, float]:
        """Match rate per healthy engine with a match, in the tree's hit order."""
        ok = set(healthy)
        if req.prompt_token_ids:
            length = len(req.prompt_token_ids)
            matched = self.tokens.match(req.prompt_token_ids)
        elif req.prompt_text:
            length = len(req.prompt_text)
            matched = self.text.match(req.prompt_text)
        else:
            return {}
        return {e: n / length for e, n in matched.items() if e in ok}

    @staticmethod
    def _scores(rates: dict[str, float], healthy: list[str]) -> dict[str, float]:
        return {e: rates.get(e, 0.0) for e in healthy}

    # ---- learning -------------------------------------------------------

    def on_placed(self, req: RequestMeta, engine_id: str, now: float) -> None:
        super().on_placed(req, engine_id, now)
        if req.prompt_token_ids:
            self.tokens.insert(req.prompt_token_ids, engine_id, now)
        elif req.prompt_text:
            self.text.insert(req.prompt_text, engine_id, now)

    def on_epoch(self, now: float) -> None:
        if self._last_sweep is None:
            self._last_sweep = now
            return
        if now - self._last_sweep < self.knobs.eviction_interval_s:
            return
        self._last_sweep = now
        self.tokens.evict(self.knobs.max_tree_size)
        self.text.evict(self.knobs.max_tree_size)

    def on_engine_removed(self, engine_id: str, now: float) -> None:
        super().on_engine_removed(engine_id, now)
        self.tokens.remove_engine(engine_id)
        self.text.remove_engine(engine_id)

    def describe(self) -> dict[str, object]:
        out = super().describe()
        out["tree_tokens"] = self.tokens.sizes()
        out["tree_chars"] = self.text.sizes()
        return out
