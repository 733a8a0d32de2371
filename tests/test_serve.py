"""`darts-dist serve` for real: a registered tiny model, the CLI in its own process, Ray Serve on a loopback port,
and the official `openai` client against it."""

from __future__ import annotations

import json
import select
import shutil
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch
import yaml
from ray._common.utils import import_attr
from ray.serve.deployment import Application
from ray.serve.schema import ServeDeploySchema
from test_generation import PROMPTS, TASKS, strong_corrections

from darts_dist.calibrate.router import fit_router
from darts_dist.config import ServeSection, parse_config
from darts_dist.core import ROUTED, prompt_features, save_corrections
from darts_dist.errors import DartsError
from darts_dist.generation import CorrectedLM
from darts_dist.serve.model import resolve_model, serve_settings
from darts_dist.sources.corrections import corrections_metadata
from darts_dist.tracking.registry import DECISIVE_METRIC, log_pyfunc_model, register_version
from darts_dist.tracking.runs import connect, experiment_id
from darts_dist.tracking.store import environment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve_load  # noqa: E402  (benchmarks/ is no package; its run_load needs no model set-up)
from serving import free_port, serve_process, stops_cleanly  # noqa: E402

pytestmark = pytest.mark.slow  # a serving process

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-served"
KEY = "test-key-123"
LIMIT = 400  # serve.max_tokens_limit: long enough that a stream cut early is far from its end
MAX_BYTES = 64 * 1024  # serve.max_request_bytes
BODY_TIMEOUT = 8.0  # serve.body_timeout_s
CODE = [f"def {name}(values, k={i}):" for i, name in enumerate(["scale", "shift", "clip", "norm", "pad", "mix"])]
MATH = [f"Question: Ann has {i + 3} coins and finds {i} more. How many coins?\nAnswer:" for i in range(6)]


def register_tiny_model(tiny_family, folder: Path) -> SimpleNamespace:
    """A registry in `folder` holding version 1 of MODEL@champion: tiny merged model, strong deep corrections (at
    decoder layer 1 and the final representation, so every served request runs a deep correction), a router
    fit on code vs. word-problem prompts, and the run config whose serve section the server takes."""
    merged_dir = folder / "merged"
    shutil.copytree(tiny_family.base, merged_dir)
    hidden_size = json.loads((merged_dir / "config.json").read_text())["hidden_size"]
    corrections = save_corrections(folder / "corrections.safetensors", strong_corrections(hidden_size, layers=(1, "final")),
                                   metadata=corrections_metadata(merged_dir))
    with CorrectedLM.load(merged_dir) as plain:
        features = prompt_features(plain.model, [plain.encode(p) for p in CODE + MATH], "final", plain.pad_id)
    router = fit_router(features, torch.tensor([0] * len(CODE) + [1] * len(MATH)), TASKS, "final", threshold=0.5)
    router_path = router.save(folder / "router.safetensors")
    uri = f"sqlite:///{folder}/mlflow.db"
    client = connect(uri)
    run_id = client.create_run(experiment_id(client, uri, "serve-test")).info.run_id
    config = parse_config({
        "name": "served",
        "sources": {"base": str(tiny_family.base),
                    "experts": [{"task": t, "path": str(tiny_family.experts[t])} for t in TASKS]},
        "tracking": {"registered_model": MODEL},
        # Small body limits, so that the tests of oversized and slow bodies are quick.
        "serve": {"max_tokens_limit": LIMIT, "max_batch_size": 8, "max_request_bytes": MAX_BYTES,
                  "body_timeout_s": BODY_TIMEOUT},
    })
    client.log_text(run_id, json.dumps(config.model_dump(mode="json")), "config.json")
    client.log_metric(run_id, DECISIVE_METRIC, 1.0)
    logged = log_pyfunc_model(uri, run_id, merged_dir, corrections, "code", router_path)
    # MLflow's sqlite registry looks the logged model up in the process-wide tracking store.
    with environment(MLFLOW_TRACKING_URI=uri):
        register_version(client, MODEL, logged, run_id, "champion")
    return SimpleNamespace(uri=uri, merged_dir=merged_dir, corrections=corrections, router=router_path)


@pytest.fixture(scope="module")
def server(tiny_family, tmp_path_factory: pytest.TempPathFactory):
    """`darts-dist serve models:/MODEL@champion` in its own process, until the last test stops it. The key comes as
    --api-key, which works with a warning (it shows in `ps`)."""
    folder = tmp_path_factory.mktemp("serve")
    registry = register_tiny_model(tiny_family, folder)
    port = free_port()
    # Metrics exported every second instead of every ten, so the metrics test reads them soon.
    env = {"MLFLOW_TRACKING_URI": registry.uri, "RAY_metrics_report_interval_ms": "1000"}
    with serve_process([f"models:/{MODEL}@champion", "--api-key", KEY], folder, port, env) as process:
        lm = CorrectedLM.load(registry.merged_dir, registry.corrections, router_path=registry.router)
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        yield SimpleNamespace(base=base, port=port, process=process, log=folder / "serve.log", client=client, lm=lm,
                              registry=registry, folder=folder)


def post(server, path: str, body: bytes | dict, key: str | None = KEY) -> tuple[int, dict]:
    """A raw POST: status and JSON body, for requests the openai client would not send."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{server.base}{path}", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_models_lists_each_task_the_routed_and_the_merged_model(server) -> None:
    models = server.client.models.list()
    assert [model.id for model in models] == [f"{MODEL}:code", f"{MODEL}:math", MODEL, f"{MODEL}:merged"]
    assert {model.model_dump()["darts"]["model_version"] for model in models} == {"1"}  # the registered version


@pytest.mark.parametrize("suffix, task", [(":code", "code"), (":math", "math"), (":merged", None), ("", ROUTED)])
def test_greedy_completions_equal_darts_dists_own_generation(server, suffix: str, task: str | None) -> None:
    prompts = [CODE[0], MATH[0]]
    reply = server.client.completions.create(model=MODEL + suffix, prompt=prompts, max_tokens=12, temperature=0)
    own = server.lm.generate(prompts, [task] * 2, max_new_tokens=12)
    assert [c.text for c in reply.choices] == [c.text for c in own]
    assert [c.finish_reason for c in reply.choices] == [c.finish_reason for c in own]
    assert reply.usage.prompt_tokens == sum(c.prompt_tokens for c in own)
    assert reply.usage.completion_tokens == sum(c.completion_tokens for c in own)
    applied = [c.model_dump()["darts"]["task"] for c in reply.choices]
    # The router sends the code prompt to code and the word problem to math.
    assert applied == (["code", "math"] if task == ROUTED else [task, task])
    assert {c.model_dump()["darts"]["model_version"] for c in reply.choices} == {"1"}


def test_chat_applies_the_chat_template(server) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 + 26?"}]
    reply = server.client.chat.completions.create(model=f"{MODEL}:math", messages=messages, max_tokens=10,
                                                  temperature=0)
    [own] = server.lm.chat([messages], ["math"], max_new_tokens=10)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == own.text
    assert reply.usage.prompt_tokens == own.prompt_tokens == len(server.lm.encode_chat(messages))


def test_streams_add_up_to_the_unstreamed_reply(server) -> None:
    options = {"model": f"{MODEL}:math", "prompt": CODE[0], "max_tokens": 16, "temperature": 0}
    text = server.client.completions.create(**options).choices[0].text
    # A stop string first met mid-reply: the stream must never run past it.
    stop = next((text[i:i + 3] for i in range(len(text) // 2, 3, -1) if text.find(text[i:i + 3]) == i), None)
    assert stop is not None, text
    for stops in (None, [stop]):
        whole = server.client.completions.create(**options, stop=stops)
        chunks = list(server.client.completions.create(**options, stop=stops, stream=True,
                                                       stream_options={"include_usage": True}))
        pieces = [c.choices[0].text for c in chunks if c.choices]
        assert len([p for p in pieces if p]) > 1  # it really streamed
        assert "".join(pieces) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
        # A choice's last chunk carries its darts object, as the unstreamed choice does.
        assert [c.choices[0].model_dump()["darts"] for c in chunks if c.choices and c.choices[0].finish_reason] == [
            whole.choices[0].model_dump()["darts"]]
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.choices[0].text == text[: text.find(stop)]

    messages = [{"role": "user", "content": "List three fruits."}]
    reply = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content


def test_a_raw_stream_is_server_sent_events_ending_in_done(server) -> None:
    body = json.dumps({"model": f"{MODEL}:math", "prompt": PROMPTS[1], "max_tokens": 4, "stream": True}).encode()
    request = urllib.request.Request(f"{server.base}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_different_tasks_in_one_running_batch_each_get_their_own_correction(server) -> None:
    tasks = {f"{MODEL}:code": "code", f"{MODEL}:math": "math", f"{MODEL}:merged": None, MODEL: ROUTED}

    def complete(model_id: str):
        return server.client.completions.create(model=model_id, prompt=MATH[1], max_tokens=24, temperature=0)

    # A long stream of the merged model is decoding before the four are sent and still after they are answered,
    # so each of them is decoded in a running batch beside another task's sequence, however they arrive.
    body = json.dumps({"model": f"{MODEL}:merged", "prompt": MATH[2], "max_tokens": LIMIT, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{server.base}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as running:
        assert running.readline().startswith(b"data: ")  # it is decoding
        with ThreadPoolExecutor(len(tasks)) as pool:
            replies = dict(zip(tasks, pool.map(complete, tasks)))
        still_running = health(server)["running"]
    deadline = time.monotonic() + 30
    while health(server)["running"]:  # the closed stream leaves at the engine's next step
        assert time.monotonic() < deadline, "the closed stream's sequence is still running"
        time.sleep(0.05)
    texts, sizes = set(), {}
    for model_id, task in tasks.items():
        [own] = server.lm.generate(MATH[1:2], [task], max_new_tokens=24)
        choice = replies[model_id].choices[0]
        assert choice.text == own.text, model_id
        darts = choice.model_dump()["darts"]
        assert darts["task"] == (own.task if task == ROUTED else task)
        sizes[model_id] = darts["batch_size"]
        texts.add(choice.text)
    assert all(2 <= size <= len(tasks) + 1 for size in sizes.values()), (sizes, still_running)  # never alone
    assert still_running >= 1, "the long stream ended before the four were answered"
    assert len(texts) == 3  # the corrections really differ (the routed word problem gets math's)


def test_a_seeded_request_gives_the_same_text_alone_and_among_others(server) -> None:
    options = {"model": f"{MODEL}:math", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 1.0, "top_p": 0.9}
    first = server.client.completions.create(**options, seed=7).choices[0].text
    [own] = server.lm.generate(PROMPTS[1:2], ["math"], max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    assert first == own.text

    def other(index: int):  # companions with other seeds, tasks and settings
        return server.client.completions.create(model=f"{MODEL}:code", prompt=CODE[index], max_tokens=20,
                                                temperature=0.8, seed=index)

    with ThreadPoolExecutor(5) as pool:
        companions = [pool.submit(other, i) for i in range(4)]
        mine = pool.submit(server.client.completions.create, **options, seed=7)
        assert mine.result().choices[0].text == first
        assert all(c.result().choices for c in companions)


BAD_REQUESTS = [
    ("/v1/completions", {"model": f"{MODEL}:code", "prompt": ""}, 400, "prompt is empty"),
    ("/v1/completions", {"model": f"{MODEL}:poetry", "prompt": "hi"}, 404, "does not exist"),
    ("/v1/completions", {"model": f"{MODEL}:code", "prompt": "hi", "max_tokens": LIMIT + 1}, 400, "at most"),
    ("/v1/completions", {"model": f"{MODEL}:code", "prompt": "word " * 600}, 400, "context is 512 tokens"),
    # Too long by its bytes alone: refused before the tokenizer sees it.
    ("/v1/completions", {"model": f"{MODEL}:code", "prompt": "word " * 12000}, 400, "the prompt has at least"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 12000}]}, 400,
     "the prompt has at least"),
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"model": f"{MODEL}:code", "prompt": [1, 2, 3]}, 400, "prompt"),
    ("/v1/completions", {"model": f"{MODEL}:code", "prompt": "hi", "n": 2}, 400, "only n=1"),
    ("/v1/completions", {"model": f"{MODEL}:code", "prompt": "hi", "temperature": 5}, 400, "temperature"),
    ("/v1/chat/completions", {"model": f"{MODEL}:code", "messages": []}, 400, "conversation is empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
]


def test_bad_requests_get_4xx_and_the_server_serves_on(server) -> None:
    for path, body, status, message in BAD_REQUESTS:
        got, reply = post(server, path, body)
        assert got == status, (body, reply)
        assert message in reply["error"]["message"], (body, reply)
        assert reply["error"]["type"] == "invalid_request_error"
    # The official client maps them to its own exceptions.
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="at most"):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=LIMIT + 1)
    status, reply = post(server, "/v1/completions", {"model": f"{MODEL}:code", "prompt": "def f(x):", "max_tokens": 3})
    assert status == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_api_key_is_enforced(server) -> None:
    wrong = openai.OpenAI(base_url=f"{server.base}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    status, reply = post(server, "/v1/completions", {"model": f"{MODEL}:code", "prompt": "hi"}, key=None)
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    # Health checks need no key (their details do: test_the_key_flag_works_with_a_warning...).
    assert health(server, key=None)["status"] == "ok"


def test_the_serve_deploy_yaml_is_valid_and_its_builder_builds_the_app(server) -> None:
    schema = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "jobs" / "serve.yaml").read_text()))
    [application] = schema.applications
    builder = import_attr(application.import_path)
    assert set(application.args) >= {"model"}
    args = {"model": f"models:/{MODEL}/1", "tracking_uri": server.registry.uri,
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}
    assert isinstance(builder(args), Application)
    with pytest.raises(DartsError, match="autoscaling_config"):
        builder({**args, "autoscaling_config": {"min_replicas": 3, "max_replicas": 1}})
    with pytest.raises(DartsError, match="not in the registry"):
        builder({**args, "model": f"models:/{MODEL}@nobody"})


def test_serve_settings_layer_the_run_config_a_yaml_and_flags(tmp_path: Path) -> None:
    run = parse_config({"sources": {"base": "b", "experts": [{"task": "code", "path": "e"}]},
                        "serve": {"port": 9000, "max_batch_size": 4}})
    assert (serve_settings(run).port, serve_settings(run).max_batch_size) == (9000, 4)
    # The capture folder, relative to where the server starts, is made absolute there for the replicas.
    assert serve_settings(run, host="0.0.0.0", port=None).model_dump() == {
        **run.serve.model_dump(), "host": "0.0.0.0",
        "capture": {**run.serve.capture.model_dump(), "dir": Path("traffic").absolute()}}
    override = tmp_path / "other.yaml"
    override.write_text(yaml.safe_dump({"sources": {"base": "b", "experts": [{"task": "code", "path": "e"}]},
                                        "serve": {"routing": "soft"}}))
    settings = serve_settings(run, override, port=8100)
    assert (settings.routing, settings.port, settings.max_batch_size) == ("soft", 8100, ServeSection().max_batch_size)
    # The dynamic batcher's wait, in the configs of versions registered before continuous batching, is ignored.
    old = parse_config({"sources": {"base": "b", "experts": [{"task": "code", "path": "e"}]},
                        "serve": {"batch_wait_timeout_s": 0.3, "max_batch_size": 4}})
    assert old.serve.max_batch_size == 4 and "batch_wait_timeout_s" not in old.serve.model_dump()


def test_a_run_folder_or_model_folder_resolves_to_its_files(server, tmp_path: Path) -> None:
    registry = server.registry
    config = parse_config({"name": "local", "sources": {"base": "/b", "experts": [{"task": t, "path": "/e"}
                                                                                   for t in TASKS]},
                           "serve": {"port": 8123}})
    # A run folder as the pipeline writes it: merged/, the corrections, the router and the run's config.
    run_dir = tmp_path / "run"
    shutil.copytree(registry.merged_dir, run_dir / "merged")
    shutil.copy(registry.corrections, run_dir / "corrections.safetensors")
    shutil.copy(registry.router, run_dir / "router.safetensors")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    source, run_config = resolve_model(str(run_dir))
    assert (source.name, run_config.name, run_config.serve.port) == ("darts-dist-local", "local", 8123)
    assert (source.files.merged_dir, source.files.corrections, source.files.router) == (
        run_dir / "merged", run_dir / "corrections.safetensors", run_dir / "router.safetensors")
    source, run_config = resolve_model(str(registry.merged_dir), corrections=registry.corrections, name="mine")
    assert (source.name, source.files.corrections, source.files.router, run_config) == (
        "mine", registry.corrections, None, None)
    # A run folder of darts-dist 0.1 (its config in its report, no config.yaml), corrections given apart.
    old = tmp_path / "old-run"
    shutil.copytree(run_dir / "merged", old / "merged")
    (old / "report.json").write_text(json.dumps({"config": config.model_dump(mode="json")}))
    source, run_config = resolve_model(str(old), corrections=registry.corrections)
    assert (source.name, run_config.serve.port, source.files.corrections, source.files.router) == (
        "darts-dist-local", 8123, registry.corrections, None)
    with pytest.raises(DartsError, match="neither a model folder"):
        resolve_model(str(tmp_path))
    with pytest.raises(DartsError, match="missing"):
        resolve_model(str(registry.merged_dir), corrections=tmp_path / "gone.safetensors")


def raw_exchange(server, head: str, body: bytes = b"", timeout: float = 60) -> tuple[int, dict]:
    """Send a request's head (and part of its body) on a raw socket, then read the whole reply: status, JSON body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        try:
            sock.sendall(head.encode() + b"\r\n" + body)
        except OSError:  # the server may answer and close before all of an oversized body is sent
            pass
        reply = b""
        while piece := sock.recv(65536):
            reply += piece
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def request_head(length: int | None, chunked: bool = False) -> str:
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\n{framing}\r\nConnection: close\r\n")


def test_oversized_bodies_get_413_and_the_server_serves_on(server) -> None:
    # A declared size above the limit is refused at once: the server never waits for the 100 MiB.
    started = time.monotonic()
    status, reply = raw_exchange(server, request_head(100 * 1024 * 1024), b'{"model": "')
    assert status == 413, reply
    assert time.monotonic() - started < 30
    assert reply["error"]["code"] == "request_too_large" and str(MAX_BYTES) in reply["error"]["message"]
    # A chunked body carries no size: it is refused once what arrived passes the limit.
    piece = b"x" * (16 * 1024)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(MAX_BYTES // len(piece) + 2))
    status, reply = raw_exchange(server, request_head(None, chunked=True), chunks + b"0\r\n\r\n")
    assert status == 413 and reply["error"]["type"] == "invalid_request_error", reply
    # Just under the limit is read and judged on its content; then a good request is served.
    padded = json.dumps({"model": f"{MODEL}:code", "prompt": "hi", "user": "x" * (MAX_BYTES - 100)}).encode()
    assert len(padded) <= MAX_BYTES
    status, reply = post(server, "/v1/completions", {"model": f"{MODEL}:code", "prompt": "def f(x):", "max_tokens": 3})
    assert status == 200 and reply["choices"]
    status, reply = post(server, "/v1/completions", padded)
    assert status == 200, reply


def test_slow_clients_do_not_hold_up_other_requests(server) -> None:
    body = json.dumps({"model": f"{MODEL}:code", "prompt": "def f(x):", "max_tokens": 3}).encode()
    # Clients that stall: some halfway through their request line and headers, some halfway through the body.
    stalled_heads = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    stalled_bodies = [socket.create_connection(("127.0.0.1", server.port), timeout=60) for _ in range(4)]
    try:
        for sock in stalled_heads:
            sock.sendall(request_head(len(body)).encode()[:40])
        started = time.monotonic()
        for sock in stalled_bodies:
            sock.sendall(request_head(len(body)).encode() + b"\r\n" + body[: len(body) // 2])
        # Meanwhile a normal request is answered, well before the stalled bodies time out.
        reply = server.client.completions.create(model=f"{MODEL}:math", prompt=MATH[0], max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        # Answered before any stalled body got its 408 (an order of events, not a clock): a request held up
        # behind the stalled ones would be answered only after they time out.
        assert select.select(stalled_bodies, [], [], 0)[0] == [], "a stalled body was answered first"
        # Each stalled body is answered 408 once serve.body_timeout_s has passed, freeing its replica slot.
        for sock in stalled_bodies:
            reply_bytes = b""
            while piece := sock.recv(65536):
                reply_bytes += piece
            head, _, payload = reply_bytes.partition(b"\r\n\r\n")
            assert head.split()[1] == b"408", reply_bytes
            assert json.loads(payload)["error"]["code"] == "request_timeout"
        assert BODY_TIMEOUT <= time.monotonic() - started < BODY_TIMEOUT + 30
    finally:
        for sock in stalled_heads + stalled_bodies:
            sock.close()
    assert health(server)["status"] == "ok"


def health(server, key: str | None = KEY) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(f"{server.base}/healthz", headers=headers),
                                timeout=10) as response:
        return json.loads(response.read())


def test_a_disconnected_stream_frees_its_slot(server) -> None:
    prompt = MATH[2]
    [whole] = server.lm.generate([prompt], None, max_new_tokens=LIMIT)
    assert whole.completion_tokens > 100  # long enough that a cut stream is far from its end
    before = health(server)["generated_tokens"]
    body = json.dumps({"model": f"{MODEL}:merged", "prompt": prompt, "max_tokens": LIMIT, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(f"{server.base}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")  # it is streaming...
    response.close()  # ...and the client goes away
    deadline = time.monotonic() + 30
    while health(server)["running"]:
        assert time.monotonic() < deadline, "the cut stream's sequence is still running"
        time.sleep(0.05)
    # It left long before its end, and the next request is served at once.
    assert health(server)["generated_tokens"] - before < whole.completion_tokens / 2
    reply = server.client.completions.create(model=f"{MODEL}:math", prompt=MATH[0], max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_the_engine_reports_prometheus_metrics(server) -> None:
    [line] = [line for line in server.log.read_text().splitlines() if "Prometheus metrics" in line]
    url = line.split(" at ")[-1].strip()
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(url, timeout=10) as response:
            exported = response.read().decode()
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in exported.splitlines()
                  if line.startswith("ray_darts_serve_")}
        if values.get("ray_darts_serve_generated_tokens_total", 0) > 0:
            break
        assert time.monotonic() < deadline, sorted(values)
        time.sleep(1)
    assert {"ray_darts_serve_waiting_sequences", "ray_darts_serve_running_sequences",
            "ray_darts_serve_tokens_per_second"} <= set(values)


def test_a_bounded_mixed_load_gets_no_5xx_and_no_lost_responses(server) -> None:
    load = serve_load.run_load(server.base, CODE + MATH + PROMPTS, requests=40, concurrency=8, api_key=KEY,
                               max_tokens=8, timeout_s=120)
    lines = {line["name"]: line for line in serve_load.result_lines(load, load)}
    assert load.valid_5xx == 0 and load.lost == 0, load.outcomes
    assert load.invalid == 5 and load.invalid_4xx == load.invalid, load.outcomes
    assert load.outcomes["valid"]["ok"] == 35 and load.streamed > 0
    assert load.healthy_after
    assert 0 < lines["serve_load_latency_p50"]["value"] <= lines["serve_load_latency_p99"]["value"]
    assert 0 < lines["serve_load_first_token_p50"]["value"] <= lines["serve_load_first_token_p99"]["value"]
    assert len(load.first_tokens) == load.streamed


def test_with_capture_off_no_prompt_is_written(server) -> None:
    """The module's server captures nothing (serve.capture is opt-in), though it has answered every test's requests."""
    assert health(server)["capture"] is False
    assert (health(server)["device"], health(server)["warnings"]) == ("cpu", [])  # asked for no GPU: no warning
    assert health(server)["prefill_chunk_tokens"] == 64  # serve.prefill_chunk_tokens: auto, on a CPU
    assert not (server.folder / "traffic").exists()  # where capture.dir would put them, relative to its folder
    assert not list(server.folder.rglob("capture-*.jsonl"))


def test_the_key_flag_works_with_a_warning_and_health_details_need_the_key(server) -> None:
    assert "--api-key shows the key to every user of this machine" in server.log.read_text()
    assert health(server, key=None) == {"status": "ok"}  # ready, and nothing a stranger could learn from
    assert {"model", "waiting", "prompt_tokens", "cached_prompt_tokens"} <= set(health(server))


def test_ctrl_c_stops_the_server_cleanly(server) -> None:
    """Last: it ends the module's server. Idle, it stops within 10 s, and every process it started (Ray's
    daemons and workers among them) is gone."""
    took, left = stops_cleanly(server.process, signal.SIGINT, within_s=10)
    assert not left, left
    assert "server stopped" in server.log.read_text()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{server.base}/healthz", timeout=5)
