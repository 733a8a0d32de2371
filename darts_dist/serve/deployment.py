"""The Ray Serve deployment: the corrected merged model behind an OpenAI-compatible HTTP API.

One deployment, `DartsServer`, on the FastAPI ingress (`serve.ingress`). Each replica loads the model once
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
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
import torch
from fastapi import Request
from fastapi.responses import StreamingResponse
from ray import serve

from darts_dist.config import ServeSection
from darts_dist.core import ROUTED
from darts_dist.errors import DartsError
from darts_dist.generation import (Completion, ContinuousBatcher, CorrectedLM, Engine, EngineBusy, EngineStopped,
                                   EngineThread, Event, Finished, Sampling, SequenceRequest)
from darts_dist.memory import PeakMemory
from darts_dist.serve.access import ApiKeys
from darts_dist.serve.capture import CapturedPrompt, TrafficCapture
from darts_dist.serve.ingress import api
from darts_dist.serve.limits import authorize, authorized, busy, read_body, stopping
from darts_dist.serve.metrics import EngineMetrics
from darts_dist.serve.model import ModelSource, model_ids
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
from darts_dist.sources.models import longest_token_bytes, model_dtype

logger = logging.getLogger(__name__)


def replica_device(settings: ServeSection) -> tuple[torch.device, str | None]:
    """Where a replica runs the model, and a warning when `serve.use_gpu` gave it a GPU resource but this process
    finds no CUDA device (a driver or image without CUDA): it then serves from the CPU, in the dtype serve.dtype
    gives a CPU, and says so."""
    if not settings.use_gpu:
        return torch.device("cpu"), None
    if torch.cuda.is_available():
        return torch.device("cuda"), None
    return torch.device("cpu"), ("serve.use_gpu is set, but this replica finds no CUDA device: serving from the CPU "
                                 f"in {model_dtype(settings.dtype, torch.device('cpu'))} (check the node's driver "
                                 "and the image's CUDA build of torch)")


@serve.deployment(max_constructor_retry_count=2)
@serve.ingress(api)
class DartsServer:
    """One replica: the model on its device, the OpenAI routes, and the generation engine."""

    def __init__(self, source: ModelSource, settings: ServeSection, api_key: ApiKeys | None = None) -> None:
        started = time.monotonic()
        files = source.fetch()
        device, warning = replica_device(settings)
        self.device, self.warnings = device, [warning] if warning else []
        self.gpus = [str(i) for i in ray.get_gpu_ids()]  # the GPU resources Ray gave this replica
        if warning:
            logger.warning(warning)
        self.memory = PeakMemory(device)  # what the model, its caches and its batches hold, for the plan's comparison

        self.prefill_chunk_tokens = settings.prefill_chunk_for(device.type == "cuda")

        def engine() -> ContinuousBatcher:
            lm = CorrectedLM.load(
                files.merged_dir, files.corrections, device=device, dtype=model_dtype(settings.dtype, device),
                router_path=files.router, threshold=settings.router_threshold,
                soft_routing=settings.routing == "soft", abstain_outside=settings.router_abstain_outside,
            )
            return ContinuousBatcher(lm, settings.max_batch_size, settings.max_batch_tokens,
                                     settings.prefix_cache_tokens, max_waiting=settings.max_waiting_sequences,
                                     prefill_chunk_tokens=self.prefill_chunk_tokens)

        # One engine thread, which loads the model too (EngineThread: the replica's torch work on one thread); one,
        # since the model's correction hooks hold one forward's task weights at a time.
        self.engine: Engine = EngineThread(engine)
        self.lm = self.engine.batcher.lm
        self.name = source.name
        self.version = source.version
        self.ids = model_ids(source.name, self.lm.tasks, self.lm.router is not None)
        self.settings = settings
        self.context = int(self.lm.model.config.max_position_embeddings)
        self.token_bytes = longest_token_bytes(self.lm.tokenizer)  # a prompt's bytes bound its tokens from below
        self.api_key = api_key
        self.created = int(time.time())
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
                "device": self.device.type, "dtype": str(self.lm.dtype).removeprefix("torch."), "gpus": self.gpus, "warnings": self.warnings,
                "peak_memory_bytes": self.memory.peak(), "capture": self.capture is not None,
                "prefill_chunk_tokens": self.prefill_chunk_tokens,
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
        client = self.authorize(request)
        body = parse(CompletionRequest, await self.body(request))
        task = self.task(body.model)
        prompts = list(body.prompts)
        if len(prompts) > self.settings.max_prompts_per_request:
            raise ApiError(400, f"the request has {len(prompts)} prompts, this server takes at most "
                           f"{self.settings.max_prompts_per_request} per request (serve.max_prompts_per_request); "
                           "send them in several requests", param="prompt", code="too_many_prompts")
        max_tokens = body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        for prompt in prompts:
            self.check_bytes(prompt, max_tokens)
        # Off the event loop: a prompt of up to serve.max_request_bytes takes the tokenizer a good part of a second,
        # during which no stream would move.
        encoded = await asyncio.to_thread(lambda: [self.lm.encode_text(prompt) for prompt in prompts])
        return await self.respond(body, task, prompts, encoded, max_tokens, chat=False, client=client)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        client = self.authorize(request)
        body = parse(ChatRequest, await self.body(request))
        task = self.task(body.model)
        self.check_bytes("".join(str(message.get("content") or "") for message in body.conversation),
                         body.token_limit or 1)
        try:
            prompt, ids = await asyncio.to_thread(self.lm.chat_text, body.conversation)
        except DartsError as error:
            raise ApiError(400, str(error), param="messages") from None
        encoded = [ids]
        # Without a limit a reply may run to the end of the context, up to the server's limit.
        max_tokens = body.token_limit or min(self.settings.max_tokens_limit, max(1, self.context - len(encoded[0])))
        return await self.respond(body, task, [prompt], encoded, max_tokens, chat=True, client=client)

    def authorized(self, request: Request) -> bool:
        return authorized(request, self.api_key)

    def authorize(self, request: Request) -> str | None:
        return authorize(request, self.api_key)

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.settings.max_request_bytes, self.settings.body_timeout_s)

    def task(self, model_id: str) -> str | None:
        if model_id not in self.ids:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server has {list(self.ids)}",
                           param="model", code="model_not_found")
        return self.ids[model_id]

    def check_bytes(self, text: str, max_tokens: int) -> None:
        """Refuse a prompt that cannot fit the context by its length in bytes alone, before tokenising it: it has at
        least one token per `token_bytes` bytes."""
        size = len(text.encode())
        least = -(-size // self.token_bytes)
        if least + max_tokens > self.context:
            raise ApiError(400, f"this model's context is {self.context} tokens, but the prompt has at least {least} "
                           f"({size} bytes) and max_tokens asks for {max_tokens} more; shorten the prompt or lower "
                           "max_tokens", param="prompt", code="context_length_exceeded")

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
        max_tokens: int, chat: bool, client: str | None,
    ) -> Any:
        for ids in encoded:
            self.check_length(ids, max_tokens)
        if not self.engine.admits(len(encoded)):  # before a stream's 200 goes out (a race still fails in the stream)
            raise busy()
        temperature = 1.0 if body.temperature is None else body.temperature
        # Greedy decoding ignores top_p and the seed.
        sampling = Sampling(max_tokens, temperature, 1.0 if temperature == 0 else body.top_p or 1.0,
                            body.stop_strings, None if temperature == 0 else body.seed, body.ignore_eos)
        requests = [SequenceRequest(tuple(ids), task, sampling, body.stream, cache_salt=client) for ids in encoded]
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"

        def keep(index: int, completion: Completion) -> None:  # a finished sequence's prompt, when capturing
            if self.capture is not None:
                self.capture.record(CapturedPrompt(prompts[index], completion.task, task == ROUTED, chat,
                                                   self.version, time.time(),
                                                   body.conversation if chat else None, client))

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
                raise busy() from None
            except EngineStopped as error:
                raise stopping(error) from None
            except DartsError as error:
                raise ApiError(400, str(error)) from None
            running = len(requests)
            while running:
                index, event = await queue.get()
                if isinstance(event, EngineStopped):  # the replica is stopping
                    raise stopping(event)
                if isinstance(event, Exception):  # its forward failed; the replica lives on
                    raise internal_error(logger, f"request {rid} failed", event)
                running -= isinstance(event, Finished)
                yield index, event
        finally:
            for ticket in tickets:
                self.engine.cancel(ticket)
