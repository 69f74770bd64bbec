"""A framework's control request as what the router's admin API does for it (pure data).

Each adapter maps its framework's control calls (AReaL's ``/areal_pause_generation``, SkyRL's
``/pause`` or ``/collective_rpc``, ...) to these, and runs them with ``SyncAdminClient`` or
``AdminClient``: a pause, a resume, an engine fan-out (``/admin/engines/{op}``) or a
pass-through (``/admin/engines/call``). A call the router cannot carry raises ``NotRoutable``.
The defaults are AReaL's (its pause aborts and clears the prefix cache); SkyRL's adapter sets
every field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..admin import EngineCall
from ..admin_models import EngineOp, PauseMode


@dataclass(frozen=True, slots=True)
class PauseAction:
    mode: PauseMode = PauseMode.ABORT
    reset_prefix_cache: bool = True


@dataclass(frozen=True, slots=True)
class ResumeAction:
    reset_prefix_cache: bool = True


@dataclass(frozen=True, slots=True)
class FanOutAction:
    op: EngineOp
    query: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PassThroughAction:
    call: EngineCall


AdminAction = PauseAction | ResumeAction | FanOutAction | PassThroughAction


class NotRoutable(ValueError):
    """A framework's request the router cannot carry (the reason says why)."""
