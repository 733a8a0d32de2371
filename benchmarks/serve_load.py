"""serve_load: a bounded load test of `darts-dist serve` on loopback: mixed tasks, streams, bad requests.

The real CLI serves the demo merge (SmolLM2-135M-Instruct, corrections of the demo's shape, a router fit on
held-out prompts) in its own process; `--tiny` serves the tiny random family instead. REQUESTS requests go
out at CONCURRENCY at a time, each on its own connection: every model id the server lists (NAME:<task>,
routed NAME, NAME:merged), completions and chat, some streamed, some sampled with a seed, and about one in
eight invalid (unknown model, empty prompt, max_tokens above the limit, bad JSON, an empty conversation, a
declared body above serve.max_request_bytes). Results, as JSON lines: valid requests answered 5xx (or with
an error in their stream) and lost responses (no reply, a cut stream, an unreadable body), both must be 0;
the share of invalid requests answered 4xx (must be 1); p50/p99 latency, p50/p99 time to the first
text of the streamed ones, and throughput of the valid ones against the same kind of requests sent one at a
time first; and /healthz afterwards. Beside them, `serve_load_ceiling`: the model's own throughput on the load's first
2 × CONCURRENCY valid requests (as the server tokenises them) in waves of CONCURRENCY against one at a time, plain
transformers in this process: the most any engine could gain by batching this workload on this machine.

`--switch` runs the load across a version switch instead: the same model registered twice (two sets of
corrections) in a throwaway registry, served as models:/demo@champion with serve.follow_alias, and the alias moved
to version 2 while the load runs. Results: valid requests that failed (5xx or lost: must be 0), and the seconds from
the alias move to the first request answered by version 2 (sent after the move, by a probe one at a time beside
the load), against two poll intervals plus the rolling update the follower logged (deploy to new replica running).

`--flood` measures what one heavy client does to everyone else, in one run: (a) 32 equal clients send the mixed load
above; (b) one client holds FLOOD_REQUESTS concurrent requests of the largest prompt list the server accepts
(serve.max_prompts_per_request) × `--flood-tokens` tokens with ignore_eos, resending each as it ends (after the
Retry-After of a 429 or 503), while 8 ordinary clients send the same mixed load one request at a time each, for
`--duration` seconds. Results: the ordinary clients' p50 and p99 latency in (b) against (a)'s (a request with no
reply within `--duration` counts at that time: a bound), their lost and 5xx replies, the flood's refusals, and the
time to refuse a list of 2,000 prompts against the time to refuse a one-prompt request for an unknown model.

`run_load` is the core, with no model set-up: tests/test_serve.py runs it on the tiny model with small numbers.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

INVALID_EVERY = 8  # one request in eight is invalid
FLOOD_REQUESTS = 32  # --flood: the heavy client's concurrent requests
ORDINARY_CLIENTS = 8  # --flood: the clients sending one request at a time beside it
EQUAL_CLIENTS = 32  # --flood: the equal clients of the comparison load
SWITCH_DEADLINE_S = 900  # --switch: the longest the load runs waiting for version 2
HUGE = 1 << 40  # a declared body size no server limit allows


@dataclass(frozen=True)
class Spec:
    """One request to send: path, body (or a declared Content-Length with no body), and what it must get."""

    path: str
    body: bytes
    valid: bool
    stream: bool = False
    declared_length: int | None = None


@dataclass
class LoadResult:
    """What came back. `outcomes` counts, per valid/invalid, ok | 4xx | 5xx | lost."""

    requests: int
    concurrency: int
    seconds: float
    outcomes: dict[str, Counter] = field(default_factory=lambda: {"valid": Counter(), "invalid": Counter()})
    latencies: list[float] = field(default_factory=list)  # of the valid requests answered ok
    first_tokens: list[float] = field(default_factory=list)  # seconds to the first text of the streams answered ok
    streamed: int = 0
    healthy_after: bool = False

    @property
    def valid_5xx(self) -> int:
        return self.outcomes["valid"]["5xx"]

    @property
    def lost(self) -> int:
        return self.outcomes["valid"]["lost"] + self.outcomes["invalid"]["lost"]

    @property
    def invalid(self) -> int:
        return sum(self.outcomes["invalid"].values())

    @property
    def invalid_4xx(self) -> int:
        return self.outcomes["invalid"]["4xx"]


def request_specs(model_ids: list[str], prompts: list[str], count: int, max_tokens: int, seed: int) -> list[Spec]:
    """`count` requests over every model id, completions and chat, a quarter streamed, every eighth invalid."""
    rng = random.Random(seed)
    name = min(model_ids, key=len)  # the bare NAME is the shortest id
    invalid = [
        ("/v1/completions", {"model": f"{name}:no-such-task", "prompt": "hi"}),
        ("/v1/completions", {"model": model_ids[0], "prompt": ""}),
        ("/v1/completions", {"model": model_ids[0], "prompt": "hi", "max_tokens": 10**9}),
        ("/v1/completions", b"{not json"),
        ("/v1/chat/completions", {"model": model_ids[0], "messages": []}),
        ("/v1/completions", None),  # declared far above serve.max_request_bytes, nothing sent
    ]
    specs = []
    for index in range(count):
        if index % INVALID_EVERY == INVALID_EVERY - 1:
            path, body = invalid[(index // INVALID_EVERY) % len(invalid)]
            raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
            specs.append(Spec(path, raw, valid=False, declared_length=HUGE if body is None else None))
            continue
        model, prompt = rng.choice(model_ids), rng.choice(prompts)
        stream = rng.random() < 0.25
        body = {"model": model, "max_tokens": rng.randint(max(1, max_tokens // 2), max_tokens), "stream": stream}
        if rng.random() < 0.3:  # sampled, reproducibly
            body |= {"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(1000)}
        else:
            body["temperature"] = 0
        if rng.random() < 0.5:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            path = "/v1/completions"
            body["prompt"] = prompt
        specs.append(Spec(path, json.dumps(body).encode(), valid=True, stream=stream))
    return specs


def _outcome(status: int, payload: bytes, stream: bool) -> str:
    """ok | 4xx | 5xx | lost for one reply read to its end."""
    if status >= 500:
        return "5xx"
    if status >= 400:
        return "4xx"
    text = payload.decode()
    if stream:
        events = [e for e in text.split("\n\n") if e]
        if not events or events[-1] != "data: [DONE]":
            return "lost"  # the stream was cut before its end
        # An error after the status line went out arrives as an event: a server-side failure.
        return "5xx" if any(e.startswith('data: {"error"') for e in events) else "ok"
    reply = json.loads(text)
    return "ok" if reply.get("choices") else "lost"


def _has_text(line: bytes) -> bool:
    """Whether a server-sent event carries generated text (a completion's `text`, a chat delta's `content`)."""
    if not line.startswith(b"data: {"):
        return False
    event = json.loads(line[6:])
    return any(choice.get("text") or (choice.get("delta") or {}).get("content") for choice in event.get("choices", []))


def send(base: str, spec: Spec, api_key: str | None, timeout_s: float,
         text_times: list[float] | None = None) -> tuple[str, float, float | None]:
    """One request on its own connection: its outcome, seconds to the end of the reply, and for a stream the
    seconds to its first text (time to first token); `text_times` gets the perf_counter time of each event with
    text, for the gaps between a stream's tokens."""
    url = urlsplit(base)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    started = time.perf_counter()
    first_token = None
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    try:
        if spec.declared_length is not None:
            connection.putrequest("POST", spec.path)
            for key, value in {**headers, "Content-Length": str(spec.declared_length)}.items():
                connection.putheader(key, value)
            connection.endheaders()
        else:
            connection.request("POST", spec.path, body=spec.body, headers=headers)
        response = connection.getresponse()
        if spec.stream and response.status == 200:
            lines = []
            while line := response.readline():
                if (first_token is None or text_times is not None) and _has_text(line):
                    now = time.perf_counter()
                    first_token = now - started if first_token is None else first_token
                    if text_times is not None:
                        text_times.append(now)
                lines.append(line)
            payload = b"".join(lines)
        else:
            payload = response.read()
        outcome = _outcome(response.status, payload, spec.stream)
    except (OSError, http.client.HTTPException, ValueError):  # no reply, a cut reply, or an unreadable one
        outcome = "lost"
    finally:
        connection.close()
    return outcome, time.perf_counter() - started, first_token


def model_ids(base: str, api_key: str | None) -> list[str]:
    connection = http.client.HTTPConnection(urlsplit(base).hostname, urlsplit(base).port, timeout=30)
    connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    ids = [m["id"] for m in json.loads(connection.getresponse().read())["data"]]
    connection.close()
    return ids


def healthy(base: str) -> bool:
    try:
        connection = http.client.HTTPConnection(urlsplit(base).hostname, urlsplit(base).port, timeout=30)
        connection.request("GET", "/healthz")
        response = connection.getresponse()
        return response.status == 200 and json.loads(response.read())["status"] == "ok"
    except (OSError, http.client.HTTPException, ValueError):
        return False


def run_load(
    base: str, prompts: list[str], requests: int, concurrency: int, api_key: str | None = None, max_tokens: int = 16,
    seed: int = 0, timeout_s: float = 600.0,
) -> LoadResult:
    """Send `requests` mixed requests to the server at `base` (http://HOST:PORT), `concurrency` at a time."""
    specs = request_specs(model_ids(base, api_key), prompts, requests, max_tokens, seed)
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda spec: send(base, spec, api_key, timeout_s), specs))
    result = LoadResult(requests, concurrency, time.perf_counter() - started)
    for spec, (outcome, seconds, first_token) in zip(specs, replies):
        result.outcomes["valid" if spec.valid else "invalid"][outcome] += 1
        if spec.valid and outcome == "ok":
            result.latencies.append(seconds)
            result.streamed += spec.stream
            if first_token is not None:
                result.first_tokens.append(first_token)
    result.healthy_after = healthy(base)
    return result


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def result_lines(load: LoadResult, alone: LoadResult) -> list[dict]:
    """The JSON lines' fields (name, value, baseline, unit, details); `alone` is the same kind of requests sent
    one at a time, the latency and throughput baseline."""
    details = {"requests": load.requests, "concurrency": load.concurrency, "valid": sum(load.outcomes["valid"].values()),
               "invalid": load.invalid, "streamed_ok": load.streamed,
               "outcomes": {kind: dict(counts) for kind, counts in load.outcomes.items()}}
    valid_ok = len(load.latencies)
    return [
        {"name": "serve_load_valid_5xx", "value": load.valid_5xx, "baseline": 0, "unit": "requests", **details},
        {"name": "serve_load_lost_responses", "value": load.lost, "baseline": 0, "unit": "requests", **details},
        {"name": "serve_load_invalid_answered_4xx", "value": load.invalid_4xx / max(1, load.invalid),
         "baseline": 1.0, "unit": "share", **details},
        {"name": "serve_load_latency_p50", "value": percentile(load.latencies, 50),
         "baseline": percentile(alone.latencies, 50), "unit": "s", **details},
        {"name": "serve_load_latency_p99", "value": percentile(load.latencies, 99),
         "baseline": percentile(alone.latencies, 99), "unit": "s", **details},
        {"name": "serve_load_first_token_p50", "value": percentile(load.first_tokens, 50),
         "baseline": percentile(alone.first_tokens, 50), "unit": "s", **details},
        {"name": "serve_load_first_token_p99", "value": percentile(load.first_tokens, 99),
         "baseline": percentile(alone.first_tokens, 99), "unit": "s", **details},
        {"name": "serve_load_throughput", "value": valid_ok / load.seconds,
         "baseline": len(alone.latencies) / alone.seconds, "unit": "requests/s", **details},
        {"name": "serve_load_healthy_after", "value": float(load.healthy_after), "baseline": 1.0, "unit": "bool",
         **details},
    ]


def workload_tokens(tokenizer, prompts: list[str], requests: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """The valid requests of a load (`request_specs`, seed 0) as the server tokenises them: (prompt ids, max_tokens)."""
    from darts_dist.sources.models import encode_user_chat, encode_user_prompt

    work = []
    for spec in request_specs(["m"], prompts, requests, max_tokens, seed=0):
        if spec.valid:
            body = json.loads(spec.body)
            ids = (encode_user_chat(tokenizer, body["messages"])[1] if "messages" in body
                   else encode_user_prompt(tokenizer, body["prompt"]))
            work.append((ids, body["max_tokens"]))
    return work


def ceiling_lines(model, pad_id: int, work: list[tuple[list[int], int]], concurrency: int) -> list[dict]:
    """What batching can gain at most on this machine for this workload: the model's own seconds to serve `work` one
    request at a time (each prompt's prefill, then a forward per token; no HTTP, no correction, no engine) against in
    waves of `concurrency` requests (a wave's prompts prefilled in one padded forward, or one by one where that is
    faster, then its tokens decoded as one batch). A prefill is already a batch of the prompt's tokens, so where the
    prompts' prefills dominate, batching requests buys little: the server's throughput ratio can reach this one at
    most."""
    import torch
    from transformers.cache_utils import DynamicCache

    @torch.inference_mode()
    def generate(batch: list[list[int]], tokens: int) -> tuple[float, float]:
        """(prefill seconds, total seconds) of `batch` left-padded, greedy for `tokens` tokens."""
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(row)) + row for row in batch])
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in batch])
        started = time.perf_counter()
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1).logits
        prefill = time.perf_counter() - started
        for _ in range(tokens - 1):
            mask = torch.cat([mask, mask.new_ones((len(batch), 1))], dim=1)
            logits = model(input_ids=logits[:, -1].argmax(-1, keepdim=True), attention_mask=mask,
                           past_key_values=cache, logits_to_keep=1).logits
        return prefill, time.perf_counter() - started

    generate([work[0][0]], work[0][1])  # warm-up
    alone = [generate([ids], tokens) for ids, tokens in work]
    batched = 0.0
    for start in range(0, len(work), concurrency):
        wave = work[start:start + concurrency]
        prefill, total = generate([ids for ids, _ in wave], max(tokens for _, tokens in wave))
        batched += total - prefill + min(prefill, sum(alone[start + i][0] for i in range(len(wave))))
    alone_s = sum(total for _, total in alone)
    details = {"requests": len(work), "concurrency": concurrency,
               "mean_prompt_tokens": round(statistics.mean(len(ids) for ids, _ in work), 1),
               "mean_max_tokens": round(statistics.mean(tokens for _, tokens in work), 1),
               "prefill_share_alone": round(sum(prefill for prefill, _ in alone) / alone_s, 3)}
    return [{"name": "serve_load_ceiling", "value": len(work) / batched, "baseline": len(work) / alone_s,
             "unit": "requests/s", **details}]


def run_for(base: str, ids: list[str], prompts: list[str], duration_s: float, concurrency: int,
            api_key: str | None = None, max_tokens: int = 16) -> LoadResult:
    """`concurrency` clients each sending the mixed load over model `ids` one request at a time until `duration_s`
    has passed; a request still unanswered then is lost, and counts at `duration_s` in the latencies (a bound)."""
    specs = request_specs(ids, prompts, 100_000, max_tokens, seed=2)
    started = time.perf_counter()
    lock, taken, replies = threading.Lock(), iter(specs), []

    def client() -> None:
        while time.perf_counter() - started < duration_s:
            with lock:
                spec = next(taken)
            outcome, seconds, _ = send(base, spec, api_key, duration_s)
            with lock:
                replies.append((spec, outcome, seconds))

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result = LoadResult(len(replies), concurrency, time.perf_counter() - started)
    for spec, outcome, seconds in replies:
        result.outcomes["valid" if spec.valid else "invalid"][outcome] += 1
        if spec.valid:
            result.latencies.append(seconds if outcome == "ok" else max(seconds, duration_s))
    result.healthy_after = healthy(base)
    return result


class Flood:
    """One client holding FLOOD_REQUESTS requests in flight, each `prompts` prompts × `max_tokens` tokens; a refused
    request (429, 503) is sent again after the Retry-After the server gave. Outcomes after `stop` are not counted:
    the benchmark cuts those requests itself."""

    def __init__(self, base: str, model: str, prompts: int, max_tokens: int) -> None:
        self.url = urlsplit(base)
        self.body = json.dumps({"model": model, "prompt": [f"Write a story, part {i}." for i in range(prompts)],
                                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}).encode()
        self.stop = threading.Event()
        self.outcomes: Counter = Counter()
        self.in_flight = 0  # requests sent and not answered yet: at the end, the flood's accepted ones
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(FLOOD_REQUESTS)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _client(self) -> None:
        while not self.stop.is_set():
            connection = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=3600)
            with self.lock:
                self.in_flight += 1
            try:
                connection.request("POST", "/v1/completions", body=self.body,
                                   headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                response.read()
                status, wait = response.status, float(response.getheader("Retry-After") or 0)
            except (OSError, http.client.HTTPException):
                status, wait = 0, 0.0
            finally:
                connection.close()
                with self.lock:
                    self.in_flight -= 1
            if self.stop.is_set():
                return
            self.outcomes[status] += 1
            self.stop.wait(wait)


def refusal_seconds(base: str, body: dict, tries: int = 20, budget_s: float = 60.0) -> float:
    """The median time to an answer to `body` (meant to be refused), over `tries` or as many as `budget_s` allows
    (a server that does not refuse it runs it)."""
    spec = Spec("/v1/completions", json.dumps(body).encode(), valid=False)
    started, times = time.perf_counter(), []
    while len(times) < tries and time.perf_counter() - started < budget_s:
        times.append(send(base, spec, None, budget_s)[1])
    return statistics.median(times)


def flood_lines(base: str, prompts: list[str], args) -> list[dict]:
    """(a) equal clients, then (b) the flood beside ordinary clients, then the refusal times (see the docstring)."""
    ids = model_ids(base, None)
    print(f"(a) {args.requests} requests from {EQUAL_CLIENTS} equal clients", file=sys.stderr, flush=True)
    equal = run_load(base, prompts, args.requests, EQUAL_CLIENTS, max_tokens=args.max_tokens)
    flood = Flood(base, ids[0], args.flood_prompts, args.flood_tokens)
    print(f"(b) a flood of {FLOOD_REQUESTS} × {args.flood_prompts} prompts × {args.flood_tokens} tokens, "
          f"{ORDINARY_CLIENTS} ordinary clients for {args.duration:g} s", file=sys.stderr, flush=True)
    flood.start()
    time.sleep(5)  # the flood is in
    ordinary = run_for(base, ids, prompts, args.duration, ORDINARY_CLIENTS, max_tokens=args.max_tokens)
    flood.stop.set()
    with flood.lock:
        in_flight = flood.in_flight
    refused_list = refusal_seconds(base, {"model": ids[0], "prompt": ["hi"] * 2000, "max_tokens": 1})
    refused_one = refusal_seconds(base, {"model": "no-such-model", "prompt": "hi", "max_tokens": 1})
    flood_outcomes = {str(status or "lost"): count for status, count in sorted(flood.outcomes.items())}
    details = {"equal_clients": EQUAL_CLIENTS, "ordinary_clients": ORDINARY_CLIENTS, "duration_s": args.duration,
               "flood_requests": FLOOD_REQUESTS, "flood_prompts": args.flood_prompts,
               "flood_tokens": args.flood_tokens, "flood_outcomes": flood_outcomes, "flood_in_flight_at_end": in_flight,
               "ordinary_outcomes": {kind: dict(c) for kind, c in ordinary.outcomes.items()},
               "equal_outcomes": {kind: dict(c) for kind, c in equal.outcomes.items()}}
    return [
        {"name": "serve_flood_ordinary_latency_p50", "value": percentile(ordinary.latencies, 50),
         "baseline": percentile(equal.latencies, 50), "unit": "s", **details},
        {"name": "serve_flood_ordinary_latency_p99", "value": percentile(ordinary.latencies, 99),
         "baseline": percentile(equal.latencies, 99), "unit": "s", **details},
        {"name": "serve_flood_ordinary_lost", "value": ordinary.lost, "baseline": 0, "unit": "requests", **details},
        {"name": "serve_flood_5xx", "value": ordinary.valid_5xx + equal.valid_5xx + sum(
            count for status, count in flood.outcomes.items() if status >= 500 and status != 503), "baseline": 0,
         "unit": "requests", **details},
        {"name": "serve_flood_refused", "value": flood.outcomes[429] + flood.outcomes[503],
         "baseline": sum(flood.outcomes.values()) + in_flight, "unit": "requests", **details},
        {"name": "serve_refuse_2000_prompts", "value": refused_list, "baseline": refused_one, "unit": "s"},
        {"name": "serve_flood_healthy_after", "value": float(healthy(base)), "baseline": 1.0, "unit": "bool"},
    ]


def main() -> None:
    # The model set-up needs the package and the other benchmarks; run_load above needs neither.
    from common import demo_setup, emit, note, parser
    from serve_overhead import random_corrections, task_prompts

    p = parser(__doc__.splitlines()[0], samples=128, steps=400)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16, help="each valid request asks for max/2 to max tokens")
    p.add_argument("--alone", type=int, default=32, help="requests sent one at a time first: the baseline")
    p.add_argument("--replica-cpus", type=float, default=None,
                   help="serve.num_cpus: the replica's CPUs and torch threads (default: every core; with --switch "
                        "half of them, so that the new replica has room beside the old one)")
    p.add_argument("--switch", action="store_true", help="run the load across a version switch (see above)")
    p.add_argument("--poll", type=float, default=2.0, help="with --switch: serve.alias_poll_s")
    p.add_argument("--switch-after", type=float, default=20.0, help="with --switch: seconds of load before the move")
    p.add_argument("--flood", action="store_true", help="equal clients, then a flood beside ordinary ones (see above)")
    p.add_argument("--duration", type=float, default=90.0, help="with --flood: seconds of the ordinary clients' load")
    p.add_argument("--flood-prompts", type=int, default=16, help="with --flood: prompts per flood request")
    p.add_argument("--flood-tokens", type=int, default=512, help="with --flood: tokens per flood prompt")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    args.replica_cpus = args.replica_cpus or (max(1, cores // 2) if args.switch else cores)
    config, sources, merged_dir = demo_setup("serve-load", args)
    router = fit_demo_router(config, sources, merged_dir)
    prompts = [text for _, text in task_prompts(config, sources, merged_dir, per_task=16)]
    model = "tiny" if args.tiny else "SmolLM2-135M-Instruct demo merge"
    with tempfile.TemporaryDirectory(prefix="serve-load-") as scratch:
        folder = Path(scratch)
        yaml_path = folder / "serve.yaml"
        # Room for the whole load in flight; by default the replica takes every core, as a serving machine would
        # give it.
        yaml_path.write_text(json.dumps({
            "sources": {"base": "unused", "experts": [{"task": t, "path": "unused"} for t in config.tasks]},
            "serve": {"num_cpus": args.replica_cpus, "max_ongoing_requests": max(32, args.concurrency),
                      "follow_alias": args.switch, "alias_poll_s": args.poll}}))
        if args.switch:
            uri = register_versions(config, merged_dir, router, folder)
            note("starting darts-dist serve on models:/demo@champion, following the alias")
            with serving(["models:/demo@champion"], yaml_path, folder, {"MLFLOW_TRACKING_URI": uri}) as base:
                deadline = time.monotonic() + 300
                while "following models:/" not in (folder / "serve.log").read_text():  # said once the follower runs
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the follower did not start:\n{(folder / 'serve.log').read_text()[-4000:]}")
                    time.sleep(0.5)
                lines = switch_lines(base, prompts, args, uri, folder / "serve.log")
        else:
            corrections = random_corrections(config, merged_dir)
            note("starting darts-dist serve")
            command = [str(merged_dir), "--corrections", str(corrections), "--router", str(router), "--name", "demo"]
            with serving(command, yaml_path, folder) as base:
                if args.flood:
                    lines = flood_lines(base, prompts, args)
                else:
                    ceiling = model_ceiling(merged_dir, prompts, args)
                    alone = run_load(base, prompts, args.alone, 1, max_tokens=args.max_tokens, seed=1)
                    note(f"{args.requests} requests at concurrency {args.concurrency}")
                    load = run_load(base, prompts, args.requests, args.concurrency, max_tokens=args.max_tokens)
                    lines = result_lines(load, alone) + ceiling
    for line in lines:
        emit(line.pop("name"), line.pop("value"), line.pop("baseline"), line.pop("unit"), model=model,
             max_tokens=args.max_tokens, replica_cpus=args.replica_cpus, **line)


def model_ceiling(merged_dir: Path, prompts: list[str], args) -> list[dict]:
    """`ceiling_lines` for the served merge, in this process while the idle server waits (the replica's
    threads sleep), on as many requests as two waves of the load's concurrency."""
    import torch
    from common import note

    from darts_dist.sources.models import load_causal_lm, load_tokenizer

    note("the model's own ceiling for this workload (one at a time, then in waves)")
    tokenizer = load_tokenizer(merged_dir)
    model = load_causal_lm(merged_dir, dtype=torch.float32).eval()
    work = workload_tokens(tokenizer, prompts, 2 * args.concurrency * INVALID_EVERY // (INVALID_EVERY - 1) + 1,
                           args.max_tokens)[:2 * args.concurrency]
    lines = ceiling_lines(model, tokenizer.pad_token_id or 0, work, args.concurrency)
    del model
    return lines


def register_versions(config, merged_dir: Path, router: Path, folder: Path) -> str:
    """A throwaway registry in `folder` with versions 1 and 2 of `demo` (the same merge, two sets of corrections),
    the alias `champion` on version 1; returns its tracking URI."""
    from common import note
    from serve_overhead import random_corrections

    from darts_dist.tracking.registry import log_pyfunc_model
    from darts_dist.tracking.runs import connect, experiment_id
    from darts_dist.tracking.store import environment

    uri = f"sqlite:///{folder}/mlflow.db"
    client = connect(uri)
    client.create_registered_model("demo")
    for seed in (1, 2):
        note(f"registering version {seed}")
        run_id = client.create_run(experiment_id(client, uri, "serve-switch")).info.run_id
        logged = log_pyfunc_model(uri, run_id, merged_dir, random_corrections(config, merged_dir, seed),
                                  config.tasks[0], router)
        with environment(MLFLOW_TRACKING_URI=uri):  # the sqlite registry finds the logged model through it
            client.create_model_version("demo", source=logged, run_id=run_id, model_id=logged.removeprefix("models:/"))
    client.set_registered_model_alias("demo", "champion", "1")
    return uri


class VersionProbe(threading.Thread):
    """One small request at a time beside the load: when it was sent, and which version answered it."""

    def __init__(self, base: str, model: str) -> None:
        super().__init__(daemon=True)
        self.base, self.model = base, model
        self.answers: list[tuple[float, str | None]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
        while not self.halt.is_set():
            sent = time.monotonic()
            request = urllib.request.Request(f"{self.base}/v1/completions", data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    self.answers.append((sent, json.loads(response.read())["choices"][0]["darts"]["model_version"]))
            except (OSError, ValueError, KeyError):
                self.answers.append((sent, None))
            time.sleep(0.2)


def switch_lines(base: str, prompts: list[str], args, uri: str, log: Path) -> list[dict]:
    """The load across a move of the alias from version 1 to 2; the switch's seconds against its allowance."""
    from common import note

    from darts_dist.tracking.runs import connect

    probe = VersionProbe(base, min(model_ids(base, None), key=len))
    probe.start()
    moved: list[float] = []

    def move_alias() -> None:
        connect(uri).set_registered_model_alias("demo", "champion", "2")
        moved.append(time.monotonic())
        note("moved the alias to version 2")

    timer = threading.Timer(args.switch_after, move_alias)
    timer.start()

    def first_from_2() -> float | None:
        return next((sent for sent, version in list(probe.answers) if moved and sent >= moved[0] and version == "2"),
                    None)

    # Rounds of REQUESTS until one has run wholly after version 2 answered: the load spans the whole switch.
    outcomes: dict[str, Counter] = {"valid": Counter(), "invalid": Counter()}
    rounds, started, after = 0, time.monotonic(), 0
    while after < 1:
        after += first_from_2() is not None
        note(f"round {rounds + 1}: {args.requests} requests at concurrency {args.concurrency}"
             + ("" if moved else f"; the alias moves {args.switch_after:g} s after the start"))
        load = run_load(base, prompts, args.requests, args.concurrency, max_tokens=args.max_tokens)
        for kind, counts in load.outcomes.items():
            outcomes[kind].update(counts)
        rounds += 1
        if time.monotonic() - started > SWITCH_DEADLINE_S:
            break
    timer.join()
    probe.halt.set()
    probe.join()
    first = first_from_2()
    if first is not None:
        note(f"first request answered by version 2 sent {first - moved[0]:.1f} s after the move")
    deadline = time.monotonic() + SWITCH_DEADLINE_S
    while "rolling update done" not in log.read_text() and time.monotonic() < deadline:  # old replicas draining
        time.sleep(0.5)
    for line in log.read_text().splitlines():  # the switch as the server saw it, next to this side's notes
        if "serve.follow" in line or "controller" in line:
            note(f"server: {line.strip()[:200]}")
    rolled = re.findall(r"rolling update done in ([0-9.]+) s", log.read_text())
    if first is None or not rolled:
        raise RuntimeError(f"version 2 did not answer within {SWITCH_DEADLINE_S} s:\n{log.read_text()[-4000:]}")
    update_s = float(rolled[-1])
    invalid = sum(outcomes["invalid"].values())
    details = {"requests": rounds * args.requests, "rounds": rounds, "concurrency": args.concurrency,
               "poll_s": args.poll, "rolling_update_s": update_s, "load_s": round(time.monotonic() - started, 1),
               "outcomes": {kind: dict(counts) for kind, counts in outcomes.items()},
               "probe_failed": sum(version is None for _, version in probe.answers)}
    return [
        {"name": "serve_switch_failed_requests", "value": outcomes["valid"]["5xx"] + outcomes["valid"]["lost"]
         + outcomes["invalid"]["lost"], "baseline": 0, "unit": "requests", **details},
        {"name": "serve_switch_invalid_answered_4xx", "value": outcomes["invalid"]["4xx"] / max(1, invalid),
         "baseline": 1.0, "unit": "share", **details},
        {"name": "serve_switch_seconds", "value": first - moved[0], "baseline": 2 * args.poll + update_s,
         "unit": "s", **details},
    ]


def fit_demo_router(config, sources, merged_dir):
    """A router for the demo merge, fit on held-out prompts (cached): the routed model id needs one."""
    import torch
    from serve_overhead import task_prompts

    from darts_dist.calibrate.router import fit_router
    from darts_dist.core import ROUTER_FILE, prompt_features
    from darts_dist.fsutil import cache_root
    from darts_dist.generation import CorrectedLM

    path = cache_root() / "benchmarks" / "serve" / f"{merged_dir.parent.name}-{ROUTER_FILE}"
    if path.is_file():
        return path
    pairs = task_prompts(config, sources, merged_dir, per_task=16)
    with CorrectedLM.load(merged_dir) as lm:
        features = prompt_features(lm.model, [lm.encode(text) for _, text in pairs], "final", lm.pad_id)
    labels = torch.tensor([config.tasks.index(task) for task, _ in pairs])
    return fit_router(features, labels, config.tasks, "final", threshold=0.5).save(path)


@contextlib.contextmanager
def serving(model: list[str], yaml_path: Path, folder: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """`darts-dist serve MODEL...` in its own process (and session) on a free loopback port, until the block ends;
    yields the server's base URL once /healthz answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    log_path = folder / "serve.log"
    command = [sys.executable, "-m", "darts_dist.cli", "serve", *model, "--port", str(port), "--config", str(yaml_path)]
    # A cluster of its own.
    env = {**{key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}, **(env or {})}
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while not healthy(base):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not come up:\n{log_path.read_text()[-4000:]}")
                time.sleep(1)
            yield base
        finally:
            process.send_signal(signal.SIGINT)  # a clean stop: Serve, and the Ray cluster it started
            stopping = time.monotonic()
            try:
                process.wait(timeout=120)
                print(f"the server stopped {time.monotonic() - stopping:.1f} s after SIGINT", file=sys.stderr)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                print(f"the server did not stop in 120 s of SIGINT:\n{log_path.read_text()[-3000:]}", file=sys.stderr)


if __name__ == "__main__":
    main()
