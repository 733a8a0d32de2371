"""The Ray Serve app: the corrected merged model behind an OpenAI-compatible HTTP API.

One deployment, `DartsServer`, with a FastAPI ingress. Each replica loads the model once
(merged weights + corrections + router, from the registry or local files) and generates through
the continuous-batching engine (`generation.engine`) on a thread of its own: every sequence of
every request joins the running batch at the next decoding step and leaves it when it finishes,
each with its own model id's task, sampling settings, stop strings and seed. The event loop
streams each sequence's text as it becomes final; a request whose client went away is cancelled
and its sequences leave the batch at the next step. The engine's queue, running set and token
rate are Ray Serve metrics (Prometheus, through Ray's metrics export).

Model ids (`serve.model.model_ids`): `NAME:<task>` applies that task's correction, `NAME` lets the router
choose (or apply none below its threshold), `NAME:merged` is the uncorrected merged model. The registered
version served is named in `/v1/models`, `/healthz` and each choice's `darts` object; with `serve.follow_alias`
the app follows its alias to new versions (`serve.follow`), and with `serve.capture` each replica keeps the
prompts it answers (`serve.capture`).
"""

# No `from __future__ import annotations`: Serve's ingress rebuilds the route methods' signatures, and
# FastAPI must see `Request` as a class, not a string, to inject it.

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import logging
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve import metrics
from ray.serve.config import AutoscalingConfig, BackpressureConfig
from ray.serve.deployment import Application
from ray.serve.exceptions import RayServeException
from starlette.exceptions import HTTPException

from darts_dist.config import ServeSection
from darts_dist.core import ROUTED
from darts_dist.errors import DartsError
from darts_dist.generation import (Completion, ContinuousBatcher, CorrectedLM, Engine, EngineBusy, EngineStopped,
                                   EngineThread, Event, Finished, Sampling, SequenceRequest)
from darts_dist.logs import init_ray
from darts_dist.memory import PeakMemory
from darts_dist.serve.access import resolve_api_key, warn_if_exposed
from darts_dist.serve.capture import CapturedPrompt, TrafficCapture
from darts_dist.serve.follow import start_follower, stop_follower
from darts_dist.serve.model import ModelSource, model_ids, resolve_model, serve_settings
from darts_dist.serve.openai_api import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    chunk,
    completion_response,
    darts,
    internal_error,
    parse,
    role_chunk,
    sse,
    usage_chunk,
)
from darts_dist.sources.models import model_dtype

logger = logging.getLogger(__name__)
APP_NAME = "darts-dist"
METRICS_INTERVAL_S = 1.0
RETRY_AFTER_S = 1  # what a 429 tells the client to wait: about the time a few decoding steps free a slot


# --- the deployment ------------------------------------------------------------------------------


class EngineMetrics:
    """The engine's waiting and running sequences, generated tokens and tokens/s as Ray Serve metrics, read every
    METRICS_INTERVAL_S on a thread of their own; Serve tags them with the deployment and replica."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.waiting = metrics.Gauge("darts_serve_waiting_sequences", "sequences waiting to join the running batch")
        self.running = metrics.Gauge("darts_serve_running_sequences", "sequences in the running batch")
        self.tokens = metrics.Counter("darts_serve_generated_tokens", "tokens generated since the replica started")
        self.rate = metrics.Gauge("darts_serve_tokens_per_second", "tokens generated per second, last interval")
        self.cached = metrics.Gauge("darts_serve_prefix_cache_hit_ratio",
                                    "share of prompt tokens taken from the prefix cache since the replica started")
        self._stop = threading.Event()
        threading.Thread(target=self._report, name="darts-metrics", daemon=True).start()

    def _report(self) -> None:
        reported, then = 0, time.monotonic()
        while not self._stop.wait(METRICS_INTERVAL_S):
            try:
                reported, then = self._export(reported, then)
            except Exception:  # noqa: BLE001 - one failed reading must not end the replica's metrics
                logger.exception("engine metrics: a reading failed")

    def _export(self, reported: int, then: float) -> tuple[int, float]:
        """Set the metrics from the engine's stats; the tokens reported so far and when, for the next reading."""
        stats, now = self.engine.stats(), time.monotonic()
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        if stats.generated_tokens > reported:
            self.tokens.inc(stats.generated_tokens - reported)
        self.rate.set((stats.generated_tokens - reported) / (now - then))
        self.cached.set(stats.cached_prompt_tokens / max(1, stats.prompt_tokens))
        return stats.generated_tokens, now

    def close(self) -> None:
        self._stop.set()


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


def replica_device(settings: ServeSection) -> tuple[torch.device, str | None]:
    """Where a replica runs the model, and a warning when `serve.use_gpu` gave it a GPU resource but this process
    finds no CUDA device (a driver or image without CUDA): it then serves from the CPU, in fp32, and says so."""
    if not settings.use_gpu:
        return torch.device("cpu"), None
    if torch.cuda.is_available():
        return torch.device("cuda"), None
    return torch.device("cpu"), ("serve.use_gpu is set, but this replica finds no CUDA device: serving from the CPU "
                                 "in fp32 (check the node's driver and the image's CUDA build of torch)")


@serve.deployment(max_constructor_retry_count=2)
@serve.ingress(api)
class DartsServer:
    """One replica: the model on its device, the OpenAI routes, and the generation engine."""

    def __init__(self, source: ModelSource, settings: ServeSection, api_key: str | None = None) -> None:
        started = time.monotonic()
        files = source.fetch()
        device, warning = replica_device(settings)
        self.device, self.warnings = device, [warning] if warning else []
        self.gpus = [str(i) for i in ray.get_gpu_ids()]  # the GPU resources Ray gave this replica
        if warning:
            logger.warning(warning)
        self.memory = PeakMemory(device)  # what the model, its caches and its batches hold, for the plan's comparison
        self.lm = CorrectedLM.load(
            files.merged_dir, files.corrections, device=device, dtype=model_dtype(settings.dtype, device),
            router_path=files.router, threshold=settings.router_threshold,
            soft_routing=settings.routing == "soft",
        )
        self.name = source.name
        self.version = source.version
        self.ids = model_ids(source.name, self.lm.tasks, self.lm.router is not None)
        self.settings = settings
        self.context = int(self.lm.model.config.max_position_embeddings)
        self.api_key = api_key
        self.created = int(time.time())
        # One engine thread: the model's correction hooks hold one forward's task weights at a time.
        self.engine: Engine = EngineThread(ContinuousBatcher(
            self.lm, settings.max_batch_size, settings.max_batch_tokens, settings.prefix_cache_tokens,
            max_waiting=settings.max_waiting_sequences))
        self.metrics = EngineMetrics(self.engine)
        self.capture = TrafficCapture(settings.capture) if settings.capture.enabled else None
        self.load_s = time.monotonic() - started

    def __del__(self) -> None:
        # Serve deletes a replica it stops; its threads go with it (if it got as far as starting them), and the
        # prompts it captured are written.
        for part in ("metrics", "engine", "capture"):
            if getattr(self, part, None) is not None:
                getattr(self, part).close()

    @api.get("/healthz")
    async def healthz(self, request: Request) -> dict[str, Any]:
        """Ready or not for anyone; the model and the engine's counters only with the key (exact prefix-cache
        counters would tell a stranger whether someone else sent a prompt)."""
        if not self.authorized(request):
            return {"status": "ok"}
        stats = self.engine.stats()
        return {"status": "ok", "model": self.name, "model_version": self.version, "load_s": round(self.load_s, 2),
                "device": self.device.type, "gpus": self.gpus, "warnings": self.warnings,
                "peak_memory_bytes": self.memory.peak(), "capture": self.capture is not None,
                **dataclasses.asdict(stats)}

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self.authorize(request)
        return {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": self.created, "owned_by": "darts-dist",
             "darts": {"model_version": self.version}}
            for model_id in self.ids
        ]}

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        self.authorize(request)
        body = parse(CompletionRequest, await self.body(request))
        task = self.task(body.model)
        prompts = list(body.prompts)
        if len(prompts) > self.settings.max_prompts_per_request:
            raise ApiError(400, f"the request has {len(prompts)} prompts, this server takes at most "
                           f"{self.settings.max_prompts_per_request} per request (serve.max_prompts_per_request); "
                           "send them in several requests", param="prompt", code="too_many_prompts")
        encoded = [self.lm.encode_text(prompt) for prompt in prompts]
        return await self.respond(body, task, prompts, encoded, body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS,
                                  chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        self.authorize(request)
        body = parse(ChatRequest, await self.body(request))
        task = self.task(body.model)
        try:
            prompt, ids = self.lm.chat_text(body.conversation)
        except DartsError as error:
            raise ApiError(400, str(error), param="messages") from None
        encoded = [ids]
        # Without a limit a reply may run to the end of the context, up to the server's limit.
        max_tokens = body.token_limit or min(self.settings.max_tokens_limit, max(1, self.context - len(encoded[0])))
        return await self.respond(body, task, [prompt], encoded, max_tokens, chat=True)

    def authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def authorize(self, request: Request) -> None:
        if not self.authorized(request):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.settings.max_request_bytes, self.settings.body_timeout_s)

    def busy(self) -> ApiError:
        return ApiError(429, f"this replica's waiting room (serve.max_waiting_sequences) has no room for the request "
                        f"now; retry after {RETRY_AFTER_S} s, or send fewer prompts per request",
                        code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})

    @staticmethod
    def stopping(error: EngineStopped) -> ApiError:
        return ApiError(503, str(error), code="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})

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
        if len(ids) + max_tokens > self.settings.max_batch_tokens:
            raise ApiError(400, f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} exceed this server's "
                           f"batch budget of {self.settings.max_batch_tokens} tokens (serve.max_batch_tokens); "
                           "shorten the prompt or lower max_tokens", param="prompt", code="context_length_exceeded")

    async def respond(
        self, body: CompletionRequest | ChatRequest, task: str | None, prompts: list[str], encoded: list[list[int]],
        max_tokens: int, chat: bool,
    ) -> Any:
        for ids in encoded:
            self.check_length(ids, max_tokens)
        if not self.engine.admits(len(encoded)):  # before a stream's 200 goes out (a race still fails in the stream)
            raise self.busy()
        temperature = 1.0 if body.temperature is None else body.temperature
        # Greedy decoding ignores top_p and the seed.
        sampling = Sampling(max_tokens, temperature, 1.0 if temperature == 0 else body.top_p or 1.0,
                            body.stop_strings, None if temperature == 0 else body.seed, body.ignore_eos)
        requests = [SequenceRequest(tuple(ids), task, sampling, body.stream) for ids in encoded]
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"

        def keep(index: int, completion: Completion) -> None:  # a finished sequence's prompt, when capturing
            if self.capture is not None:
                self.capture.record(CapturedPrompt(prompts[index], completion.task, task == ROUTED, chat,
                                                   self.version, time.time(),
                                                   body.conversation if chat else None))

        if body.stream:
            return StreamingResponse(self.stream(rid, body, requests, chat, keep), media_type="text/event-stream")
        results: dict[int, Finished] = {}
        async with contextlib.aclosing(self.generate(rid, requests)) as events:
            async for index, event in events:
                if isinstance(event, Finished):
                    results[index] = event
                    keep(index, event.completion)
        return completion_response(rid, self.created, body.model, self.version,
                                   [(results[i].completion, results[i].batch_size) for i in range(len(requests))], chat)

    async def stream(
        self, rid: str, body: CompletionRequest | ChatRequest, requests: list[SequenceRequest], chat: bool,
        keep: Callable[[int, Completion], None],
    ) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; an error mid-stream is sent
        as an error object (the status line is gone by then)."""
        finished: list[Completion] = []
        if chat:
            yield sse(role_chunk(rid, self.created, body.model))
        try:
            async with contextlib.aclosing(self.generate(rid, requests)) as events:
                async for index, event in events:
                    if isinstance(event, Finished):
                        finished.append(event.completion)
                        keep(index, event.completion)
                        yield sse(chunk(rid, self.created, body.model, index, None, event.completion.finish_reason,
                                        chat, darts(event.completion, event.batch_size, self.version)))
                    elif event:
                        yield sse(chunk(rid, self.created, body.model, index, event, None, chat))
            if body.include_usage:
                yield sse(usage_chunk(rid, self.created, body.model, finished, chat))
        except ApiError as error:
            yield sse(error.body())
        except Exception:  # noqa: BLE001 - the stream reports it and ends; the replica lives on
            yield sse(internal_error(logger, f"stream {rid} failed").body())
        yield DONE

    async def generate(self, rid: str, requests: list[SequenceRequest]) -> AsyncIterator[tuple[int, str | Finished]]:
        """(sequence index, text or Finished) as the engine produces them, until every sequence has finished.

        However this ends (done, failed, or closed because the client went away), the request's sequences that
        are still running are cancelled: they leave the batch at the engine's next step.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        tickets = []

        def listener(index: int) -> Callable[[Event], None]:
            return lambda event: loop.call_soon_threadsafe(queue.put_nowait, (index, event))

        try:
            try:
                tickets = self.engine.submit(requests, [listener(i) for i in range(len(requests))])
            except EngineBusy:
                raise self.busy() from None
            except EngineStopped as error:
                raise self.stopping(error) from None
            except DartsError as error:
                raise ApiError(400, str(error)) from None
            running = len(requests)
            while running:
                index, event = await queue.get()
                if isinstance(event, EngineStopped):  # the replica is stopping
                    raise self.stopping(event)
                if isinstance(event, Exception):  # its forward failed; the replica lives on
                    raise internal_error(logger, f"request {rid} failed", event)
                running -= isinstance(event, Finished)
                yield index, event
        finally:
            for ticket in tickets:
                self.engine.cancel(ticket)


# --- building and running the app ------------------------------------------------------------------


def build_app(source: ModelSource, settings: ServeSection, api_key: str | None = None) -> Application:
    """The Serve application: replicas (or autoscaling), concurrency, and one GPU each when `use_gpu`."""
    options: dict[str, Any] = {
        "max_ongoing_requests": settings.max_ongoing_requests,
        "max_queued_requests": settings.max_queued_requests,
        # Serve's own refusal past max_queued_requests: a 429 with Retry-After, like the replicas' own.
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        "ray_actor_options": {"num_cpus": settings.num_cpus, "num_gpus": 1 if settings.use_gpu else 0},
        # A rolling update (a new version, `serve.follow_alias`) starts new replicas before it stops old ones,
        # and lets an old one finish its requests, streams too, for up to drain_timeout_s.
        "max_surge_percent": settings.max_surge_percent,
        "graceful_shutdown_timeout_s": settings.drain_timeout_s,
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
    `tracking_uri`, `name`, `api_key_file` or `api_key` (else DARTS_DIST_API_KEY) and any key of the config's serve
    section."""
    args = dict(args)
    if "model" not in args:
        raise DartsError("the Serve application's args lack 'model'", "add args: {model: models:/NAME@ALIAS}")
    source, config = resolve_model(args.pop("model"), tracking=args.pop("tracking_uri", None),
                                   name=args.pop("name", None))
    api_key = resolve_api_key(args.pop("api_key", None), args.pop("api_key_file", None))
    settings = serve_settings(config, **args)
    check_capture_folder(settings)
    stop_follower()  # a follower left by `serve-deploy` must not move this app; this one pins its version
    return build_app(source, settings, api_key)


def follows(source: ModelSource, settings: ServeSection) -> bool:
    """Whether a server of `source` follows its alias: asked to, and serving models:/NAME@ALIAS."""
    return settings.follow_alias and source.alias is not None


def app_exists() -> bool:
    """Whether this app is still deployed (Serve itself may be gone: `serve shutdown`)."""
    try:
        return APP_NAME in serve.status().applications
    except RayServeException:  # no Serve instance on the cluster any more
        return False


def deploy(source: ModelSource, settings: ServeSection, api_key: str | None) -> None:
    """Deploy (or roll over to) the app on `source`; returns once its replicas run, raises if they cannot start."""
    serve.run(build_app(source, settings, api_key), name=APP_NAME, route_prefix="/", blocking=False)


def check_capture_folder(settings: ServeSection) -> None:
    """A capture folder the replicas cannot write to fails here, on the driver, before any replica starts."""
    if not settings.capture.enabled:
        return
    folder = settings.capture.dir
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as error:
        raise DartsError(f"serve.capture.dir {folder} is not a writable folder: {error}",
                         "point serve.capture.dir at a folder the server may write, or set capture.enabled: false")


def start(source: ModelSource, settings: ServeSection, api_key: str | None = None, detached: bool = False) -> str:
    """Start Serve's HTTP proxy on settings.host:port and deploy the app; returns its OpenAI base URL. With
    `serve.follow_alias` a follower starts too (`detached`: it outlives this driver).

    Returns once every replica has loaded the model.
    """
    if settings.follow_alias and not follows(source, settings):
        # A registered config may ask to follow; serving one pinned version or a run folder is still meant.
        logger.warning("serve.follow_alias is set, but %s is no models:/NAME@ALIAS: serving it without following",
                       source.registered or "a local model")
    check_capture_folder(settings)
    warn_if_exposed(settings.host, api_key)
    # request_timeout_s: the proxy answers 408 to a request still unanswered then (its own end-to-end bound).
    serve.start(http_options={"host": settings.host, "port": settings.port,
                              "request_timeout_s": settings.request_timeout_s})
    stop_follower()  # one left by an earlier deploy must not move this app
    deploy(source, settings, api_key)
    if follows(source, settings):
        start_follower(source, functools.partial(deploy, settings=settings, api_key=api_key), app_exists,
                       settings.alias_poll_s, detached)
    return f"http://{settings.host}:{settings.port}/v1"


def metrics_url() -> str:
    """Where Ray's metrics agent on this node exports Prometheus metrics, the replicas' darts_serve_* among them."""
    import ray

    node = next(n for n in ray.nodes() if n["Alive"] and n["NodeID"] == ray.get_runtime_context().get_node_id())
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


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
        init_ray(include_dashboard=False)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        url = start(source, settings, api_key)
        say(f"serving {source.name} at {url} (GET /v1/models lists the model ids; Ctrl-C stops)")
        say(f"Prometheus metrics (darts_serve_* and Ray Serve's own) at {metrics_url()}")
        if follows(source, settings):
            say(f"following {source.alias} (version {source.version} now) every {settings.alias_poll_s:g} s")
        if settings.capture.enabled:
            say(f"capturing served prompts (no responses) in {settings.capture.dir}, at most "
                f"{settings.capture.max_bytes} bytes")
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        logger.info("stopping the server")
    finally:
        stop_follower()
        if joined:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
            ray.shutdown()
    logger.info("server stopped")
