"""misat_client: rollout workers and trainers talking to the misa-t router.

- ``RolloutSession`` / ``AsyncRolloutSession`` (``session.py``): label requests with the
  workload class, session and turn, retry held requests after ``Retry-After``, end the
  session on exit;
- ``AdminClient`` / ``SyncAdminClient`` (``admin.py``): pause, resume, engine control and the
  weight-update sequence, with typed answers;
- ``RolloutLabels`` (``labels.py``): the header and body names alone, dependency-free;
- ``adapters/``: AReaL, verl and a plain OpenAI-SDK agent loop (``docs/integrations.md``).

It imports nothing of the router's server side: ``pip install misa-t`` brings what it uses
(pydantic; aiohttp for the async flavours, imported on first use).
"""

from .admin import AdminClient, EngineCall, PoolNotIdle, SyncAdminClient, WeightUpdateFailed
from .admin_models import (
    EngineFanOut,
    EngineOp,
    EngineResult,
    EngineStatus,
    PauseMode,
    PauseResult,
    ResumeResult,
    RouterStatusView,
    WeightUpdateResult,
)
from .errors import HeldTooLong, MisatClientError, RouterHTTPError, RouterUnreachable
from .labels import RolloutLabels
from .retry import NO_RETRY, HoldRetry
from .session import AsyncRolloutSession, RolloutSession, SessionEnded

__all__ = [
    "NO_RETRY",
    "AdminClient",
    "AsyncRolloutSession",
    "EngineCall",
    "EngineFanOut",
    "EngineOp",
    "EngineResult",
    "EngineStatus",
    "HeldTooLong",
    "HoldRetry",
    "MisatClientError",
    "PauseMode",
    "PauseResult",
    "PoolNotIdle",
    "ResumeResult",
    "RolloutLabels",
    "RolloutSession",
    "RouterHTTPError",
    "RouterStatusView",
    "RouterUnreachable",
    "SessionEnded",
    "SyncAdminClient",
    "WeightUpdateFailed",
    "WeightUpdateResult",
]
