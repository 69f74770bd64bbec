"""A multi-turn agent loop on the official ``openai`` client, through the router.

Each trajectory is one session: every chat call carries the class, the session id and the
turn, and each after the first the engine that answered the one before (a restarted router
puts the turn back where its KV is); between calls the agent's tools run (the "tool gap", while the router keeps the
session's KV where it is); the session ends when the loop does, also when a tool raised.

    loop = OpenAIAgentLoop(AsyncOpenAI(base_url=router + "/v1", api_key="-"), model="policy")
    trajectory = await loop.run(messages, tool_step)

``tool_step(messages, reply)`` gets the conversation so far (the reply already appended) and
the ``ChatCompletion``; it returns the messages to add before the next turn (tool results, a
user follow-up), or None when the trajectory is done.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..retry import HoldRetry
from ..session import AsyncRolloutSession

if TYPE_CHECKING:
    import aiohttp

DEFAULT_ROLLOUT_CLASS = "agentic"
DEFAULT_MAX_TURNS = 8
"""Turns of one trajectory at most; the last is sent with ``X-Session-End``."""

Messages = list[dict[str, Any]]
ToolStep = Callable[[Messages, Any], Awaitable[Messages | None]]


@dataclass
class Trajectory:
    """What one run produced."""

    session_id: str
    messages: Messages
    replies: list[Any] = field(default_factory=list)
    """The ``ChatCompletion`` of every turn."""
    finish_reasons: list[str | None] = field(default_factory=list)
    completion_tokens: int = 0

    @property
    def turns(self) -> int:
        return len(self.replies)


def assistant_message(reply: Any) -> dict[str, Any]:
    """The reply's first choice as the message to append to the conversation."""
    message = reply.choices[0].message
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if getattr(message, "tool_calls", None):
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in message.tool_calls]
    return out


def router_url_of(client: Any) -> str:
    """The router's base URL from an ``openai`` client's ``base_url`` (``.../v1``)."""
    base = str(client.base_url).rstrip("/")
    return base.removesuffix("/v1")


class OpenAIAgentLoop:
    """Agentic trajectories with an ``AsyncOpenAI`` client whose ``base_url`` is the router's
    ``/v1``. ``sampling`` is passed to every ``chat.completions.create`` (``max_tokens``,
    ``temperature``, ``logprobs``, ...)."""

    def __init__(
        self,
        client: Any,
        *,
        model: str,
        rollout_class: str = DEFAULT_ROLLOUT_CLASS,
        max_turns: int = DEFAULT_MAX_TURNS,
        sampling: Mapping[str, Any] | None = None,
        retry: HoldRetry | None = None,
        router_url: str | None = None,
        http: aiohttp.ClientSession | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.client = client
        self.model = model
        self.rollout_class = rollout_class
        self.max_turns = max_turns
        self.sampling = dict(sampling or {})
        self.retry = retry
        self.router_url = router_url or router_url_of(client)
        self.http = http
        """Used for the session ends (None: one per trajectory)."""

    def session(self, session_id: str | None = None) -> AsyncRolloutSession:
        """The session a trajectory runs in (one per ``run``)."""
        return AsyncRolloutSession(self.router_url, self.rollout_class, session_id, retry=self.retry, http=self.http)

    async def run(self, messages: Messages, tool_step: ToolStep, *, session_id: str | None = None) -> Trajectory:
        """One trajectory: chat, run the tools, chat again, until ``tool_step`` returns None or
        ``max_turns`` is reached."""
        conversation = list(messages)
        async with self.session(session_id) as s:
            client = s.openai(self.client)
            trajectory = Trajectory(session_id=s.id, messages=conversation)
            for turn in range(self.max_turns):
                last = turn == self.max_turns - 1
                # The raw answer's headers name the engine, which the session sends with the next
                # turn (a restarted router puts the turn back where its KV is).
                raw = await s.create(client.with_raw_response.chat.completions.create, model=self.model,
                                     messages=conversation, end=last, **self.sampling)
                reply = raw.parse()
                trajectory.replies.append(reply)
                trajectory.finish_reasons.append(reply.choices[0].finish_reason)
                if reply.usage is not None:
                    trajectory.completion_tokens += reply.usage.completion_tokens
                conversation.append(assistant_message(reply))
                if last:
                    break
                more = await tool_step(conversation, reply)
                if more is None:
                    break
                conversation.extend(more)
        return trajectory
