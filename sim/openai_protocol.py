"""Request bodies and error bodies of vLLM's OpenAI-compatible API (the subset we serve).

Pydantic models validate bodies at the HTTP edge; unknown fields are accepted
and ignored, as vLLM does. Errors use vLLM's body::

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}

(``ErrorResponse`` / ``ErrorInfo`` in vLLM's protocol; ``code`` is the HTTP
status). An unknown model name is 404 ``NotFoundError`` with ``param: "model"``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    """``stream_options`` of a streaming request."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    temperature: float | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1, description="Only n = 1 is simulated.")


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    """vLLM's default for completions is 16."""


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


class TokenizeRequest(BaseModel):
    """Body of ``POST /tokenize`` (completion form, or chat form with ``messages``)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class ApiError(Exception):
    """An error to answer with vLLM's error body."""

    def __init__(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        """vLLM's ``ErrorResponse`` JSON."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


def model_not_found(name: str) -> ApiError:
    """vLLM's answer to an unknown model name."""
    return ApiError(
        f"The model `{name}` does not exist.", status=404, err_type="NotFoundError", param="model"
    )


def check_lengths(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """Validate lengths as vLLM does; returns the effective ``max_tokens``.

    ``None`` means "up to the context limit" (vLLM's chat default).
    """
    if num_prompt_tokens == 0:
        raise ApiError("The prompt cannot be empty.", param="prompt")
    if num_prompt_tokens >= max_model_len:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            "input messages.",
            param="input_tokens",
        )
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ApiError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {max_model_len} tokens and your request has "
            f"{num_prompt_tokens} input tokens ({max_tokens} > {max_model_len} - "
            f"{num_prompt_tokens}).",
            param="max_tokens",
        )
    return max_tokens
