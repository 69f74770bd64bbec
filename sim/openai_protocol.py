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


MAX_LOGPROBS: int = 20
"""vLLM's ``--max-logprobs`` default: the most top logprobs a request may ask for."""


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None
    """Logprob tokens rendered as ``token_id:<id>`` (vLLM's flag of the same name)."""
    temperature: float | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, description="Samples of each prompt (vLLM fans a parent out into n children).")
    top_k: int | None = Field(default=None, ge=-1, description="-1 or 0: no limit (vLLM).")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    """vLLM's default for completions is 16."""
    logprobs: int | None = Field(default=None, ge=0)
    """Top logprobs per output token (``None``: no logprobs)."""


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)


_NOT_SIMULATED: dict[str, str] = {
    "prompt_logprobs": "prompt logprobs are not simulated",
    "echo": "echoing the prompt is not simulated",
    "suffix": "suffix is not simulated",
    "logit_bias": "logit_bias is not simulated",
    "use_beam_search": "beam search is not simulated",
    "min_tokens": "min_tokens is not simulated (the modelled length is drawn by the engine)",
    "stop": "stop strings are not simulated (use stop_token_ids with special ids, or none)",
    "guided_json": "guided decoding is not simulated",
    "guided_regex": "guided decoding is not simulated",
    "guided_choice": "guided decoding is not simulated",
    "guided_grammar": "guided decoding is not simulated",
    "structured_outputs": "structured outputs are not simulated",
}
"""Parameters that change what an answer contains and that the simulator cannot honour: a
request that sets one (to anything but its off value) is a 400 naming it, never ignored."""


def _is_set(value: object) -> bool:
    return value not in (None, False, 0, "", [], {})


def check_simulated(body: CompletionRequest | ChatCompletionRequest, *, first_regular_id: int,
                    eos_token_id: int | None) -> None:
    """Refuse (400, ``param`` named) what the simulator cannot honour; see ``_NOT_SIMULATED``."""
    fields = {**(body.model_extra or {}), "prompt_logprobs": body.prompt_logprobs}
    for name, why in _NOT_SIMULATED.items():
        if _is_set(fields.get(name)):
            raise ApiError(f"{name}: {why}.", param=name)
    best_of = fields.get("best_of")
    if best_of is not None and best_of != body.n:
        raise ApiError("best_of: only best_of == n is simulated.", param="best_of")
    fmt = fields.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise ApiError("response_format: only type 'text' is simulated.", param="response_format")
    # A special id is never generated and EOS stops the engine anyway: those are honoured as
    # given. A regular id would have to stop generation mid-way, which the engine model cannot.
    regular = [t for t in body.stop_token_ids or () if t >= first_regular_id and t != eos_token_id]
    if regular:
        raise ApiError(
            f"stop_token_ids: only special ids (< {first_regular_id}) and EOS are simulated, got {regular}.",
            param="stop_token_ids",
        )


def requested_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Top logprobs per token the request asks for (None: no logprobs), validated as vLLM does."""
    if isinstance(body, CompletionRequest):
        k, param = body.logprobs, "logprobs"
    else:
        if not body.logprobs:
            if body.top_logprobs:
                raise ApiError("top_logprobs: when top_logprobs is set, logprobs must be true.",
                               param="top_logprobs")
            return None
        k, param = body.top_logprobs or 0, "top_logprobs"
    if k is not None and k > MAX_LOGPROBS:
        raise ApiError(f"{param}: requested {k} logprobs, the most allowed is {MAX_LOGPROBS}.", param=param)
    return k


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
