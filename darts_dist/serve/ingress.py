"""The HTTP ingress the deployment's routes hang on: a FastAPI app whose every refusal, FastAPI's own included, is
an OpenAI-shaped error body, and whose unexpected failures are a 500 with an id, never the exception's text. A
request carrying one of Ray Serve's client-controlled headers is refused before any route sees it."""

# No `from __future__ import annotations`: FastAPI must see `Request` as a class, not a string.

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.serve._private.constants import (
    SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER,
    SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER,
)
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from darts_dist.serve.openai_api import ApiError, internal_error

logger = logging.getLogger(__name__)

# Ray Serve's proxy reads these from the client's request before it reaches this app: a non-positive
# x-request-timeout-seconds turns the server's request timeout off, x-request-disconnect-disabled: ?1 keeps a request
# running after its client has gone. Neither can be switched off in the proxy (Ray is pinned: its constants are
# imported, not copied), so a request carrying either is answered 400 here, before any work: no client sets how
# long its request may hold a slot of the running batch.
PROXY_CONTROL_HEADERS = (SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER, SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER)


class RefuseProxyControls:
    """ASGI middleware (not Starlette's BaseHTTPMiddleware, which would sit between a stream and its client's
    disconnect) that answers a request naming PROXY_CONTROL_HEADERS with OpenAI's error body, 400."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {name.decode("latin-1").lower() for name, _ in scope["headers"]}
            named = [header for header in PROXY_CONTROL_HEADERS if header in names]
            if named:
                error = ApiError(400, f"header {named[0]} is not accepted: the server sets request timeouts and "
                                      "cancels requests whose client has gone", param=named[0], code="invalid_request")
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


api = FastAPI(title="darts-dist", docs_url=None, redoc_url=None, openapi_url=None)
api.add_middleware(RefuseProxyControls)


@api.exception_handler(ApiError)
async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


@api.exception_handler(HTTPException)
async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """FastAPI's own refusals (an unknown path, a wrong method) in OpenAI's error shape."""
    return await _api_error(request, ApiError(error.status_code, str(error.detail), code="invalid_request",
                                              headers=getattr(error, "headers", None)))


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return await _api_error(request, ApiError(400, "invalid request", code="invalid_value"))


@api.exception_handler(Exception)
async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    """Anything else is a bug: a JSON 500 with an id the log line carries, never the exception's text."""
    return await _api_error(request, internal_error(logger, f"{request.method} {request.url.path} failed"))
