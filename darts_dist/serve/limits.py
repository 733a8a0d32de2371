"""What a request must pass before the model sees it: the API key, the body's size and arrival time; and the
refusals the engine's state makes (429 with Retry-After when its waiting room is full, 503 while it stops)."""

from __future__ import annotations

import asyncio

from fastapi import Request

from darts_dist.generation import EngineStopped
from darts_dist.serve.access import ApiKeys
from darts_dist.serve.openai_api import ApiError

RETRY_AFTER_S = 1  # what a 429 tells the client to wait: about the time a few decoding steps free a slot


def client_of(request: Request, api_keys: ApiKeys) -> str | None:
    """The client whose key the request carries (`Authorization: Bearer KEY`), else None."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return api_keys.client(token.strip()) if scheme.lower() == "bearer" else None


def authorized(request: Request, api_keys: ApiKeys | None) -> bool:
    """Whether the request carries one of the keys; any request does, without keys."""
    return api_keys is None or client_of(request, api_keys) is not None


def authorize(request: Request, api_keys: ApiKeys | None) -> str | None:
    """The client the request's key names (None without keys), or 401."""
    if api_keys is None:
        return None
    client = client_of(request, api_keys)
    if client is None:
        raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                       code="invalid_api_key")
    return client


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refused with 413 once it exceeds `limit` bytes and with 408 if it has not fully arrived
    within `timeout_s`.

    A declared Content-Length above the limit is refused before any of the body is read; a chunked body is read
    piece by piece and refused as soon as it passes the limit, so neither is ever held whole in memory.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for piece in request.stream():
                body += piece
                if len(body) > limit:
                    raise _too_large(limit)
    except TimeoutError:
        # A client trickling its body would otherwise hold one of the replica's max_ongoing_requests slots.
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout") from None
    return bytes(body)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes "
                    "(serve.max_request_bytes)", code="request_too_large")


def busy() -> ApiError:
    return ApiError(429, f"this replica's waiting room (serve.max_waiting_sequences) has no room for the request "
                    f"now; retry after {RETRY_AFTER_S} s, or send fewer prompts per request",
                    code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})


def stopping(error: EngineStopped) -> ApiError:
    return ApiError(503, str(error), code="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
