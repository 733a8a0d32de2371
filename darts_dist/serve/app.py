"""The Ray Serve app: the corrected merged model behind an OpenAI-compatible HTTP API (issue 6).

One deployment, `DartsServer`, with a FastAPI ingress. Each replica loads the model once
(merged weights + corrections + router, from the registry or local files) and generates through
`CorrectedLM`, like the pyfunc model does. Requests are validated in the ingress and then split
into sequences; `@serve.batch` gathers the sequences that arrive together and generates them in
one batch, each under its own model id's task; sequences whose sampling settings differ are
generated one group after the other within the batch. Generation runs on one worker thread
while the event loop streams each sequence's text as it becomes final.

Model ids (`serve.model.model_ids`): `NAME:<task>` applies that task's correction, `NAME` lets the router
choose (or apply none below its threshold), `NAME:merged` is the uncorrected merged model.
"""

# No `from __future__ import annotations`: Serve's ingress rebuilds the route methods' signatures, and
# FastAPI must see `Request` as a class, not a string, to inject it.

import asyncio
import hmac
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.config import AutoscalingConfig
from ray.serve.deployment import Application

from darts_dist.config import ServeSection
from darts_dist.errors import DartsError
from darts_dist.fanin import fan_in_async
from darts_dist.generation import Completion, CorrectedLM
from darts_dist.serve.model import ModelSource, model_ids, resolve_model, serve_settings
from darts_dist.serve.openai_api import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    chunk,
    completion_response,
    parse,
    role_chunk,
    sse,
    usage_chunk,
)
from darts_dist.sources.models import model_dtype

logger = logging.getLogger(__name__)
API_KEY_ENV = "DARTS_DIST_API_KEY"
APP_NAME = "darts-dist"


# --- the deployment ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """A sequence's generation settings; sequences with equal settings are generated together."""

    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None


@dataclass(frozen=True)
class SequenceRequest:
    ids: tuple[int, ...]
    task: str | None
    sampling: Sampling
    stream: bool


@dataclass(frozen=True)
class Finished:
    completion: Completion
    batch_size: int  # sequences generated together with this one


@dataclass(frozen=True)
class Failed:
    error: ApiError


# A batch's events per sequence: text (possibly ""), then one Finished or Failed. After the last
# event list, run_batch emits None: a plain value, because Serve pickles the ingress class by value and
# a sentinel object() would arrive in the replica as a copy of itself.
Event = str | Finished | Failed


def run_batch(lm: CorrectedLM, requests: Sequence[SequenceRequest], emit: Callable[[object], None]) -> None:
    """Generate a batch, one group of equal sampling settings at a time, emitting one event list per step.

    A group that fails fails alone: its sequences get Failed, the other groups still run.
    """
    count = len(requests)
    groups: dict[Sampling, list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(request.sampling, []).append(index)
    try:
        for sampling, members in groups.items():

            def on_text(deltas: list[str], members: list[int] = members) -> None:
                events: list[Event] = [""] * count
                for index, delta in zip(members, deltas):
                    events[index] = delta
                emit(events)

            streaming = any(requests[i].stream for i in members)
            events: list[Event] = [""] * count
            try:
                completions = lm.generate_ids(
                    [requests[i].ids for i in members], [requests[i].task for i in members],
                    max_new_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                    stop=sampling.stop, seed=sampling.seed, on_text=on_text if streaming else None,
                )
                for index, completion in zip(members, completions):
                    events[index] = Finished(completion, len(members))
            except Exception as error:  # the replica lives on; these requests get a 500 (or 400) each
                logger.exception("generation failed for %d sequences", len(members))
                status = 400 if isinstance(error, DartsError) else 500
                for index in members:
                    events[index] = Failed(ApiError(status, f"generation failed: {error}"))
            emit(events)
    finally:
        emit(None)


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


api = FastAPI(title="darts-dist", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(ApiError)
async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


@serve.deployment(max_constructor_retry_count=2)
@serve.ingress(api)
class DartsServer:
    """One replica: the model on its device, the OpenAI routes, and the request batcher."""

    def __init__(self, source: ModelSource, settings: ServeSection, api_key: str | None = None) -> None:
        files = source.fetch()
        device = torch.device("cuda" if settings.use_gpu and torch.cuda.is_available() else "cpu")
        self.lm = CorrectedLM.load(
            files.merged_dir, files.corrections, device=device, dtype=model_dtype(settings.dtype, device),
            router_path=files.router, threshold=settings.router_threshold,
            soft_routing=settings.routing == "soft",
        )
        self.name = source.name
        self.ids = model_ids(source.name, self.lm.tasks, self.lm.router is not None)
        self.settings = settings
        self.context = int(self.lm.model.config.max_position_embeddings)
        self.api_key = api_key
        self.created = int(time.time())
        # One thread: the model's correction hooks hold one batch's task weights at a time.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="darts-generate")
        self.generate_batch.set_max_batch_size(settings.max_batch_size)
        self.generate_batch.set_batch_wait_timeout_s(settings.batch_wait_timeout_s)

    @api.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok", "model": self.name}

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self.authorize(request)
        return {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": self.created, "owned_by": "darts-dist"}
            for model_id in self.ids
        ]}

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        self.authorize(request)
        body = parse(CompletionRequest, await self.body(request))
        task = self.task(body.model)
        encoded = [self.lm.encode(prompt) for prompt in body.prompts]
        return await self.respond(body, task, encoded, body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        self.authorize(request)
        body = parse(ChatRequest, await self.body(request))
        task = self.task(body.model)
        try:
            encoded = [self.lm.encode_chat(body.conversation)]
        except DartsError as error:
            raise ApiError(400, str(error), param="messages") from None
        # Without a limit a reply may run to the end of the context, up to the server's limit.
        max_tokens = body.token_limit or min(self.settings.max_tokens_limit, max(1, self.context - len(encoded[0])))
        return await self.respond(body, task, encoded, max_tokens, chat=True)

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.settings.max_request_bytes, self.settings.body_timeout_s)

    def task(self, model_id: str) -> str | None:
        if model_id not in self.ids:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server has {list(self.ids)}",
                           param="model", code="model_not_found")
        return self.ids[model_id]

    def check_length(self, ids: list[int], max_tokens: int) -> None:
        limit = self.settings.max_tokens_limit
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenisation; send at least one token of text",
                           param="prompt")
        if max_tokens > limit:
            raise ApiError(400, f"max_tokens is {max_tokens}, this server allows at most {limit}",
                           param="max_tokens", code="invalid_value")
        if len(ids) + max_tokens > self.context:
            raise ApiError(400, f"this model's context is {self.context} tokens, but the prompt has {len(ids)} "
                           f"and max_tokens asks for {max_tokens} more; shorten the prompt or lower max_tokens",
                           param="prompt", code="context_length_exceeded")

    async def respond(
        self, body: CompletionRequest | ChatRequest, task: str | None, encoded: list[list[int]], max_tokens: int,
        chat: bool,
    ) -> Any:
        for ids in encoded:
            self.check_length(ids, max_tokens)
        temperature = 1.0 if body.temperature is None else body.temperature
        # Greedy decoding ignores top_p and the seed: equal keys let greedy requests share a group.
        sampling = Sampling(max_tokens, temperature, 1.0 if temperature == 0 else body.top_p or 1.0,
                            body.stop_strings, None if temperature == 0 else body.seed)
        requests = [SequenceRequest(tuple(ids), task, sampling, body.stream) for ids in encoded]
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(self.stream(rid, body, requests, chat), media_type="text/event-stream")
        results: dict[int, Finished] = {}
        try:
            async for index, event in fan_in_async({i: self.generate_batch(r) for i, r in enumerate(requests)}):
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Finished):
                    results[index] = event
        except ApiError:
            raise
        except Exception as error:  # a failed batch fails its requests, never the replica
            logger.exception("request %s failed", rid)
            raise ApiError(500, f"generation failed: {error}") from None
        return completion_response(rid, self.created, body.model,
                                   [(results[i].completion, results[i].batch_size) for i in range(len(requests))], chat)

    async def stream(
        self, rid: str, body: CompletionRequest | ChatRequest, requests: list[SequenceRequest], chat: bool
    ) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; an error mid-stream is sent
        as an error object (the status line is gone by then)."""
        finished: list[Completion] = []
        if chat:
            yield sse(role_chunk(rid, self.created, body.model))
        try:
            async for index, event in fan_in_async({i: self.generate_batch(r) for i, r in enumerate(requests)}):
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Finished):
                    finished.append(event.completion)
                    yield sse(chunk(rid, self.created, body.model, index, None, event.completion.finish_reason, chat))
                elif event:
                    yield sse(chunk(rid, self.created, body.model, index, event, None, chat))
            if body.include_usage:
                yield sse(usage_chunk(rid, self.created, body.model, finished, chat))
        except ApiError as error:
            yield sse(error.body())
        except Exception as error:  # noqa: BLE001 - the stream reports it and ends; the replica lives on
            logger.exception("stream %s failed", rid)
            yield sse(ApiError(500, f"generation failed: {error}").body())
        yield DONE

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def generate_batch(self, requests: list[SequenceRequest]) -> AsyncIterator[list[object]]:
        """The sequences that arrived together, generated as one batch; per step, one event for each
        (StopIteration once a sequence has finished, which tells Serve that its stream ended)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        work = loop.run_in_executor(self.executor, run_batch, self.lm, requests,
                                    lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        ended = [False] * len(requests)
        while (events := await queue.get()) is not None:
            out: list[object] = []
            for index, event in enumerate(events):
                out.append(StopIteration if ended[index] else event)
                ended[index] = ended[index] or isinstance(event, (Finished, Failed))
            yield out
        await work


# --- building and running the app ------------------------------------------------------------------


def build_app(source: ModelSource, settings: ServeSection, api_key: str | None = None) -> Application:
    """The Serve application: replicas (or autoscaling), concurrency, and one GPU each when `use_gpu`."""
    options: dict[str, Any] = {
        "max_ongoing_requests": settings.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": settings.num_cpus, "num_gpus": 1 if settings.use_gpu else 0},
    }
    if settings.autoscaling_config is not None:
        try:
            AutoscalingConfig(**settings.autoscaling_config)
        except (ValidationError, ValueError, TypeError) as error:  # pydantic's and Ray's own validation errors
            raise DartsError(f"serve.autoscaling_config is not valid for Ray Serve: {error}",
                             "see Ray Serve's AutoscalingConfig (min_replicas, max_replicas, ...)") from None
        options["autoscaling_config"] = settings.autoscaling_config
    else:
        options["num_replicas"] = settings.num_replicas
    return DartsServer.options(**options).bind(source, settings, api_key)


def app_builder(args: dict[str, Any]) -> Application:
    """The import path for `serve deploy` / `serve run` (jobs/serve.yaml): `args` has `model` and optionally
    `tracking_uri`, `name`, `api_key` (else DARTS_DIST_API_KEY) and any key of the config's serve section."""
    args = dict(args)
    if "model" not in args:
        raise DartsError("the Serve application's args lack 'model'", "add args: {model: models:/NAME@ALIAS}")
    source, config = resolve_model(args.pop("model"), tracking=args.pop("tracking_uri", None),
                                   name=args.pop("name", None))
    api_key = args.pop("api_key", None) or os.environ.get(API_KEY_ENV)
    return build_app(source, serve_settings(config, **args), api_key)


def start(source: ModelSource, settings: ServeSection, api_key: str | None = None) -> str:
    """Start Serve's HTTP proxy on settings.host:port and deploy the app; returns its OpenAI base URL.

    Returns once every replica has loaded the model.
    """
    # request_timeout_s: the proxy answers 408 to a request still unanswered then (its own end-to-end bound).
    serve.start(http_options={"host": settings.host, "port": settings.port,
                              "request_timeout_s": settings.request_timeout_s})
    serve.run(build_app(source, settings, api_key), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{settings.host}:{settings.port}/v1"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_foreground(
    source: ModelSource, settings: ServeSection, api_key: str | None, say: Callable[[str], None] = print
) -> None:
    """`darts-dist serve`: serve until Ctrl-C (or SIGTERM), then shut Serve down.

    On a cluster this process joined (RAY_ADDRESS) only the app is deleted; a cluster it started
    itself is shut down with it.
    """
    import ray

    joined = ray.is_initialized() or bool(os.environ.get("RAY_ADDRESS"))
    if not ray.is_initialized():
        ray.init(include_dashboard=False)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        url = start(source, settings, api_key)
        say(f"serving {source.name} at {url} (GET /v1/models lists the model ids; Ctrl-C stops)")
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        logger.info("stopping the server")
    finally:
        if joined:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
            ray.shutdown()
    logger.info("server stopped")
