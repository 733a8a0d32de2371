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
time first; and /healthz afterwards.

`run_load` is the core, with no model set-up: tests/test_serve.py runs it on the tiny model with small numbers.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

INVALID_EVERY = 8  # one request in eight is invalid
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


def send(base: str, spec: Spec, api_key: str | None, timeout_s: float) -> tuple[str, float, float | None]:
    """One request on its own connection: its outcome, seconds to the end of the reply, and for a stream the
    seconds to its first text (time to first token)."""
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
                if first_token is None and _has_text(line):
                    first_token = time.perf_counter() - started
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


def main() -> None:
    # The model set-up needs the package and the other benchmarks; run_load above needs neither.
    from common import demo_setup, emit, note, parser
    from serve_overhead import random_corrections, task_prompts

    p = parser(__doc__.splitlines()[0], samples=128, steps=400)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16, help="each valid request asks for max/2 to max tokens")
    p.add_argument("--alone", type=int, default=32, help="requests sent one at a time first: the baseline")
    p.add_argument("--replica-cpus", type=float, default=os.cpu_count() or 1,
                   help="serve.num_cpus: the replica's CPUs and torch threads (default: every core)")
    args = p.parse_args()
    config, sources, merged_dir = demo_setup("serve-load", args)
    corrections = random_corrections(config, merged_dir)
    router = fit_demo_router(config, sources, merged_dir)
    prompts = [text for _, text in task_prompts(config, sources, merged_dir, per_task=16)]
    with tempfile.TemporaryDirectory(prefix="serve-load-") as folder:
        yaml_path = Path(folder) / "serve.yaml"
        # The replica takes every core, as a serving machine would give it; room for the whole load in flight.
        yaml_path.write_text(json.dumps({
            "sources": {"base": "unused", "experts": [{"task": t, "path": "unused"} for t in config.tasks]},
            "serve": {"num_cpus": args.replica_cpus, "max_ongoing_requests": max(32, args.concurrency)}}))
        note("starting darts-dist serve")
        with serving(merged_dir, corrections, router, yaml_path, Path(folder)) as base:
            alone = run_load(base, prompts, args.alone, 1, max_tokens=args.max_tokens, seed=1)
            note(f"{args.requests} requests at concurrency {args.concurrency}")
            load = run_load(base, prompts, args.requests, args.concurrency, max_tokens=args.max_tokens)
    model = "tiny" if args.tiny else "SmolLM2-135M-Instruct demo merge"
    for line in result_lines(load, alone):
        emit(line.pop("name"), line.pop("value"), line.pop("baseline"), line.pop("unit"), model=model,
             max_tokens=args.max_tokens, replica_cpus=args.replica_cpus, **line)


def fit_demo_router(config, sources, merged_dir):
    """A router for the demo merge, fit on held-out prompts (cached): the routed model id needs one."""
    import torch
    from serve_overhead import task_prompts

    from darts_dist.calibrate.features import prompt_features
    from darts_dist.calibrate.router import fit_router
    from darts_dist.core import ROUTER_FILE
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
def serving(merged_dir: Path, corrections: Path, router: Path, yaml_path: Path, folder: Path) -> Iterator[str]:
    """`darts-dist serve` in its own process (and session) on a free loopback port, until the block ends;
    yields the server's base URL once /healthz answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    log_path = folder / "serve.log"
    command = [sys.executable, "-m", "darts_dist.cli", "serve", str(merged_dir), "--corrections", str(corrections),
               "--router", str(router), "--name", "demo", "--port", str(port), "--config", str(yaml_path)]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # a cluster of its own
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
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


if __name__ == "__main__":
    main()
