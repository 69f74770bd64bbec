"""One place that turns a policy name and its settings into a policy object.

An unknown name cannot reach here (``PolicyName`` is an enum validated at the
config boundary), so there is no silent default.
"""

from __future__ import annotations

from .base import Policy
from .settings import PolicyName, PolicySettings, WorkloadMix


def build_policy(settings: PolicySettings, mix: WorkloadMix) -> Policy:
    """Build the configured policy, wrapped in the static concurrency limit when one is set."""
    policy: Policy
    match settings.name:
        case PolicyName.MISA_T | PolicyName.MISA | PolicyName.SESSION_ADMISSION:
            from .misa import MisaPolicy

            policy = MisaPolicy(settings, mix)
        case PolicyName.CACHE_AWARE:
            from .cache_aware import CacheAwarePolicy

            policy = CacheAwarePolicy(settings, mix)
        case PolicyName.LEAST_LOADED:
            from .simple import LeastLoadedPolicy

            policy = LeastLoadedPolicy(settings, mix)
        case PolicyName.ROUND_ROBIN:
            from .simple import RoundRobinPolicy

            policy = RoundRobinPolicy(settings, mix)
    if settings.concurrency_limit is not None:
        from .concurrency_limit import ConcurrencyLimited

        policy = ConcurrencyLimited(policy, settings.concurrency_limit)
    return policy
