"""The HTTP ingress the deployment's routes hang on: a FastAPI app whose every refusal, FastAPI's own included, is
an OpenAI-shaped error body, and whose unexpected failures are a 500 with an id, never the exception's text."""

# No `from __future__ import annotations`: FastAPI must see `Request` as a class, not a string.

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from darts_dist.serve.openai_api import ApiError, internal_error

logger = logging.getLogger(__name__)

api = FastAPI(title="darts-dist", docs_url=None, redoc_url=None, openapi_url=None)


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
