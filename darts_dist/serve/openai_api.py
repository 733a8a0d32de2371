"""The OpenAI wire format darts-dist serves: request validation, responses, stream chunks and errors.

Plain pydantic models and dicts with no Ray in them, so the protocol can be read (and checked)
apart from the serving machinery (`serve/deployment.py`). Fields OpenAI clients send that a local model has
no use for (`user`, `presence_penalty`, ...) are accepted and ignored, as other OpenAI-compatible
servers do; settings that would change the answer and are not supported (`n` > 1) are refused.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from darts_dist.generation import Completion

DONE = "data: [DONE]\n\n"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# An error body stays small whatever the request held: a few validation errors, each cut, and a count of the rest.
ERRORS_SHOWN = 3
ERROR_PART_CHARS = 300
ERROR_MESSAGE_CHARS = 2000


class ApiError(Exception):
    """A request the API refuses: an HTTP status and OpenAI's error body (its message cut to a bound)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = cut(message, ERROR_MESSAGE_CHARS)
        self.param = None if param is None else cut(param, ERROR_PART_CHARS)
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        kind = ("server_error" if self.status >= 500 else "rate_limit_error" if self.status == 429
                else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def internal_error(log: logging.Logger, what: str, error: BaseException | None = None) -> ApiError:
    """A 500 that says nothing of the failure (no exception text, path or trace) but an id; the log line, written
    here with the traceback of `error` (default: the exception being handled), carries the same id."""
    error_id = uuid.uuid4().hex[:12]
    log.error("%s (error id %s)", what, error_id, exc_info=error or True)
    return ApiError(500, f"internal error (id {error_id}); the server's log has the details", code="internal_error")


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationRequest(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    # vLLM's extension: generate max_tokens whatever the model says (benchmarks compare equal lengths).
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported; send the request n times instead")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > 4 or any(not s for s in strings):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: one prompt, or a list of prompts (one choice each)."""

    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[str]) -> str | list[str]:
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not prompts or any(not p for p in prompts):
            raise ValueError("the prompt is empty; send at least one character of text")
        return prompt

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(_GenerationRequest):
    """POST /v1/chat/completions: a conversation, answered with the tokenizer's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not any(m.text for m in messages):
            raise ValueError("the conversation is empty; send at least one message with content")
        return messages

    @property
    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text} for m in self.messages]

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse(kind: type[_GenerationRequest], raw: bytes) -> _GenerationRequest:
    """A request body, validated; bad JSON or bad fields become a 400 saying which field and why (the first few)."""
    try:
        data = json.loads(raw)
    except ValueError as error:  # bad JSON or UTF-8, and numbers past Python's digit limit
        raise ApiError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        request = kind.model_validate(data)
    except ValidationError as error:
        errors = error.errors(include_url=False, include_input=False)
        where = ".".join(str(part) for part in errors[0]["loc"])
        shown = [cut(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}", ERROR_PART_CHARS)
                 for e in errors[:ERRORS_SHOWN]]
        more = f" (and {len(errors) - ERRORS_SHOWN} more errors)" if len(errors) > ERRORS_SHOWN else ""
        raise ApiError(400, f"invalid request: {'; '.join(shown)}{more}", param=where or None,
                       code="invalid_value") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
    try:
        # JSON may escape lone UTF-16 surrogates ("\\ud800"), which are no text a tokenizer can read.
        request.model_dump_json()
    except ValueError:
        raise ApiError(400, "the request holds a lone UTF-16 surrogate (e.g. \\ud800): send valid Unicode text",
                       code="invalid_value") from None
    return request


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(data)}\n\n"


def darts(completion: Completion, batch_size: int, model_version: str | None) -> dict[str, Any]:
    """Beyond OpenAI's fields, under one key: the correction applied, the router's confidence (routed
    requests), how many sequences were generated together, and the registered version that answered."""
    return {"task": completion.task, "confidence": completion.confidence, "batch_size": batch_size,
            "model_version": model_version}


def usage(completions: Sequence[Completion]) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in completions)
    generated = sum(c.completion_tokens for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def completion_response(
    rid: str, created: int, model: str, model_version: str | None, results: Sequence[tuple[Completion, int]],
    chat: bool,
) -> dict[str, Any]:
    """The non-streamed reply: one choice per (completion, batch size), with the usage of all of them."""
    choices = []
    for index, (completion, batch_size) in enumerate(results):
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": completion.finish_reason,
                                  "darts": darts(completion, batch_size, model_version)}
        if chat:
            choice["message"] = {"role": "assistant", "content": completion.text}
        else:
            choice["text"] = completion.text
        choices.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage([c for c, _ in results])}


def chunk(
    rid: str, created: int, model: str, index: int, text: str | None, finish_reason: str | None, chat: bool,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed piece of choice `index`; a chat chunk carries it as a `delta`; a choice's last chunk carries
    its `darts` object (`details`)."""
    choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish_reason}
    if details is not None:
        choice["darts"] = details
    if chat:
        choice["delta"] = {} if text is None else {"content": text}
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}


def role_chunk(rid: str, created: int, model: str) -> dict[str, Any]:
    """A chat stream's first chunk: the assistant's role, no content yet."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]}


def usage_chunk(rid: str, created: int, model: str, completions: Sequence[Completion], chat: bool) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(completions)}
