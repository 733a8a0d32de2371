"""The task router: it separates clearly different tasks, saves exactly, and routes generation (or abstains)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from test_generation import PROMPTS, TASKS, strong_corrections

import darts_dist.calibrate.router as router_module
from darts_dist.calibrate.outcome import router_tasks
from darts_dist.calibrate.router import fit_router, fit_run_router, task_prompts
from darts_dist.cli import main
from darts_dist.config import EvaluationSection, TrackingSection, load_config, updated
from darts_dist.core import ROUTED, Envelope, TaskRouter, TokenizedSet, merged_hidden, prompt_features, row_prompt_features
from darts_dist.errors import DartsError
from darts_dist.generation import ContinuousBatcher, CorrectedLM, Finished, Sampling, SequenceRequest
from darts_dist.sources.data import TaskFiles, tokenized
from darts_dist.sources.models import load_causal_lm, load_tokenizer, pad_id
from darts_dist.sources.references import ResolvedSources, resolve_sources
from darts_dist.tracking.registry import fetch_model
from darts_dist.tracking.runs import connect, tracking_uri


def blobs(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three well-separated Gaussian clusters in 16 dimensions, `count` points each."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[6.0] + [0.0] * 15, [0.0, 6.0] + [0.0] * 14, [0.0, 0.0, 6.0] + [0.0] * 13]) + 3.0
    points = torch.cat([c + torch.randn(count, 16, generator=generator) for c in centres])
    return points, torch.arange(3).repeat_interleave(count)


def test_fit_separates_clear_clusters_and_routes_with_a_confidence() -> None:
    features, labels = blobs(40, seed=0)
    router = fit_router(features, labels, ("code", "math", "instruct"), "final", threshold=0.5)
    held_out, truth = blobs(20, seed=1)
    routing = router.route(held_out)
    assert torch.equal(routing.task, truth)
    assert torch.allclose(routing.probabilities.sum(-1), torch.ones(60))
    assert torch.equal(routing.confidence, routing.probabilities.max(-1).values)
    assert (routing.confidence >= 0.5).all()
    # Halfway between two clusters nothing is sure: with a threshold above the top probability, no task.
    between = ((held_out[:1] + held_out[20:21]) / 2)
    assert router.route(between, threshold=0.99).task.tolist() == [-1]
    # The same data gives the same router: full-batch L-BFGS has nothing random in it.
    again = fit_router(features, labels, ("code", "math", "instruct"), "final")
    assert torch.equal(again.weight, router.weight) and torch.equal(again.bias, router.bias)


def test_two_tasks_get_the_same_objective_as_more() -> None:
    """scikit-learn keeps one weight row for two classes; the router's softmax over two rows, fit on mean
    cross-entropy + l2/2·‖W‖² (computed here by full-batch L-BFGS), gives the same probabilities."""
    features, labels = blobs(30, seed=3)
    keep = labels < 2
    features, labels = features[keep], labels[keep]
    router = fit_router(features, labels, ("code", "math"), "final")
    x = (features - features.mean(0)) / features.std(0, unbiased=False)
    weight, bias = torch.zeros(2, 16, requires_grad=True), torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=500, line_search_fn="strong_wolfe",
                                  tolerance_grad=1e-10, tolerance_change=1e-14)

    def objective() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.T + bias, labels) + 0.5 * 1e-2 * weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(objective)
    expected = torch.softmax(x @ weight.detach().T + bias.detach(), dim=-1)
    torch.testing.assert_close(router.probabilities(features), expected, atol=1e-3, rtol=0)


def test_a_task_without_examples_is_refused() -> None:
    features, labels = blobs(5, seed=0)
    with pytest.raises(DartsError, match=r"no routing examples for tasks \['extra'\]"):
        fit_router(features, labels, ("code", "math", "instruct", "extra"), "final")


def test_save_and_load_round_trip_exactly(tmp_path: Path) -> None:
    features, labels = blobs(10, seed=2)
    router = fit_router(features, labels, ("code", "math", "instruct"), 3, threshold=0.7)
    path = router.save(tmp_path / "router.safetensors", metadata={"train_accuracy": 1.0})
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    loaded = TaskRouter.load(path)
    assert (loaded.tasks, loaded.layer, loaded.threshold) == (("code", "math", "instruct"), 3, 0.7)
    for name in ("mean", "scale", "weight", "bias"):
        assert torch.equal(getattr(loaded, name), getattr(router, name)), name
    assert torch.equal(loaded.route(features).probabilities, router.route(features).probabilities)


THREE = ("code", "math", "instruct")


@pytest.mark.parametrize("case", ["blobs", "a constant feature and a task of two prompts"])
def test_each_tasks_envelope_is_its_prompts_gaussian_with_a_leave_one_out_radius(case: str) -> None:
    features, labels = blobs(12, seed=4)
    if case != "blobs":  # the variance floor: feature 5 never varies within a task; math known from two prompts
        features[:, 5] = labels.float()
        keep = (labels != 1) | (torch.arange(len(labels)) < 14)
        features, labels = features[keep], labels[keep]
    router = fit_router(features, labels, THREE, "final")
    z = router.standardised(features).double()
    for task in range(3):
        own = z[labels == task]
        distances = []
        for i in range(len(own)):  # refit without prompt i, then its distance
            others = torch.cat([own[:i], own[i + 1:]])
            variance = others.var(dim=0, unbiased=False).clamp_min(1e-3)
            distances.append(float(((own[i] - others.mean(dim=0)) ** 2 / variance).mean()))
        spread = own.var(dim=0, unbiased=False).clamp_min(1e-3).sqrt()
        torch.testing.assert_close(router.envelope.center[task], own.mean(dim=0).float(), atol=1e-5, rtol=0)
        torch.testing.assert_close(router.envelope.spread[task], spread.float(), atol=1e-5, rtol=1e-5)
        assert float(router.envelope.radius[task]) == pytest.approx(max(distances), rel=1e-5)
        # A prompt's distance to the fit that includes it is never larger: every calibration prompt is inside.
        assert not router.outside(features[labels == task], torch.full((len(own),), task)).any()
    one = fit_router(features[[0, 12, 13, 24, 25]], labels[[0, 12, 13, 24, 25]], THREE, "final")
    assert torch.isinf(one.envelope.radius[0])  # a task known from one prompt bounds nothing


def test_a_prompt_far_from_every_task_gets_no_correction_however_sure_the_router(tmp_path: Path) -> None:
    """The softmax extrapolates: a prompt far along the code cluster's own direction, or off in a direction no task
    varies in, gets a sure pick. Outside the envelope it gets none, as below the threshold; the tasks' own unseen
    prompts stay inside."""
    features, labels = blobs(40, seed=0)
    router = fit_router(features, labels, THREE, "final")
    held_out, truth = blobs(20, seed=1)
    beyond_code = held_out[:5].clone()
    beyond_code[:, 0] += 30.0
    general = held_out[:5].clone()
    general[:, 7] += 12.0
    routing = router.route(torch.cat([held_out, beyond_code, general]))
    assert routing.outside[60:].all() and (routing.task[60:] == -1).all()
    assert (routing.probabilities[60:65].argmax(dim=-1) == 0).all() and (routing.confidence[60:65] > 0.99).all()
    inside = ~routing.outside[:60]
    assert inside.float().mean() >= 0.95
    assert torch.equal(routing.task[:60][inside], truth[inside])
    assert (router.route(beyond_code, abstain_outside=False).task == 0).all()  # routing outside: the pick stands
    # The file keeps the envelope and the setting; the exported folder's router (transformers alone) agrees.
    from darts_dist.core.modeling_darts import TaskRouter as ExportedRouter

    for abstain in (True, False):
        router.abstain_outside = abstain
        path = router.save(tmp_path / f"router-{abstain}.safetensors")
        loaded = TaskRouter.load(path)
        assert loaded.abstain_outside is abstain and ExportedRouter(str(path)).abstain_outside is abstain
        for mine, theirs in zip(loaded.envelope, router.envelope):
            assert torch.equal(mine, theirs)
        everything = torch.cat([held_out, beyond_code, general])
        top = router.probabilities(everything).argmax(dim=-1)
        assert torch.equal(ExportedRouter(str(path)).inside(everything, top), ~router.outside(everything, top))
        assert torch.equal(loaded.route(everything).task, routing.task if abstain else
                           router.route(everything, abstain_outside=False).task)
    # A router file from before envelopes (format version 1, no envelope in its header) finds nothing outside.
    from darts_dist.core.io import write_tagged

    legacy = write_tagged(tmp_path / "legacy.safetensors",
                          {name: getattr(router, name) for name in ("mean", "scale", "weight", "bias")},
                          {"format": "darts-dist-router", "version": 1, "tasks": list(THREE), "layer": "final",
                           "hidden_size": 16, "threshold": 0.5, "metadata": {}}, "router")
    old = TaskRouter.load(legacy)
    assert old.envelope is None and ExportedRouter(str(legacy)).envelope is None
    assert not old.route(beyond_code).outside.any() and (old.route(beyond_code).task == 0).all()
    assert ExportedRouter(str(legacy)).inside(beyond_code, torch.zeros(5, dtype=torch.long)).all()


def test_the_exported_folders_outside_setting_is_checked() -> None:
    from darts_dist.core.modeling_darts import _abstain_outside

    assert (_abstain_outside("abstain"), _abstain_outside("route"), _abstain_outside(None)) == (True, False, None)
    with pytest.raises(ValueError, match="darts.outside is 'Abstain'"):
        _abstain_outside("Abstain")


def test_a_damaged_router_file_is_refused(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    features, labels = blobs(10, seed=2)
    path = fit_router(features, labels, ("code", "math", "instruct"), "final").save(tmp_path / "router.safetensors")
    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["weight"] = tensors["weight"][:2]
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=header)
    with pytest.raises(DartsError, match="bad.safetensors.*stored tensors"):
        TaskRouter.load(bad)
    with pytest.raises(DartsError, match="router file .* does not exist"):
        TaskRouter.load(tmp_path / "missing.safetensors")


def write_run(tiny_family, folder: Path) -> Path:
    """Two tasks whose prompts look nothing alike: Python functions (text) and word problems (chat)."""
    data = folder / "data"
    data.mkdir(parents=True)
    names = ["apples", "pears", "coins", "books", "cars", "birds", "cups", "pens", "boxes", "keys", "hats", "rings"]
    code = [{"text": f"def scale_{i}(values, factor={i}):\n    return [v * factor for v in values]\n"}
            for i in range(16)]
    math = [{"prompt": f"Question: Sam has {3 + i} {names[i % 12]} and buys {i + 2} more. How many now?",
             "response": f"{3 + i} + {i + 2} = {5 + 2 * i}. #### {5 + 2 * i}"} for i in range(16)]
    for task, rows in (("code", code), ("math", math)):
        (data / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:10]))
        (data / f"{task}-heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[10:]))
    config = {
        "name": "routed",
        "output_dir": str(folder / "runs"),
        "sources": {"base": str(tiny_family.base), "experts": [
            {"task": t, "path": str(tiny_family.experts[t]),
             "data": {"calibration": f"data/{t}.jsonl", "heldout": f"data/{t}-heldout.jsonl"}} for t in TASKS]},
        "calibration": {"num_samples": 10, "max_length": 48, "batch_size": 4},
        "serve": {"router_threshold": 0.6},
    }
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_run_router_separates_synthetic_tasks_on_held_out_prompts(tiny_family, tmp_path: Path) -> None:
    config = load_config(write_run(tiny_family, tmp_path))
    # The tiny base stands in for the merged model: the router only needs the model's hidden states.
    report = fit_run_router(config, resolve_sources(config).data, tiny_family.base, "final")
    assert report["train_accuracy"] == 1.0
    assert report["accuracy"] == 1.0 and report["per_task"] == {"code": 1.0, "math": 1.0}
    router = TaskRouter.load(Path(report["path"]))
    assert Path(report["path"]) == config.run_dir / "router.safetensors"
    assert (router.tasks, router.layer, router.threshold) == (TASKS, "final", 0.6)
    # below_threshold by hand: the router's confidence on each held-out prompt's features, against 0.6...
    data, tokenizer = resolve_sources(config).data, load_tokenizer(tiny_family.base)
    model = load_causal_lm(tiny_family.base)
    features = torch.cat([prompt_features(model, task_prompts(data[task], "heldout", config, tokenizer), "final",
                                          pad_id(tokenizer), config.calibration.batch_size) for task in TASKS])
    confidence = router.probabilities(features).max(dim=-1).values.sort().values
    assert len(confidence) == 12
    assert report["below_threshold"] == pytest.approx(float((confidence < 0.6).sum()) / 12)
    # ...and against a threshold planted in the widest gap between the confidences: a known count falls below.
    below = int((confidence[1:] - confidence[:-1]).argmax()) + 1
    planted = float(confidence[below - 1] + confidence[below]) / 2
    assert confidence[below - 1] < planted < confidence[below]
    again = fit_run_router(updated(config, serve=updated(config.serve, router_threshold=planted)), data,
                           tiny_family.base, "final")
    assert again["below_threshold"] == pytest.approx(below / 12)
    # outside_envelope and no_correction by hand, from the file's router on the same features.
    routing = router.route(features)
    outside = router.outside(features, routing.probabilities.argmax(dim=-1))
    assert report["outside_envelope"] == pytest.approx(float(outside.float().mean()))
    assert report["no_correction"] == pytest.approx(float(((routing.confidence < 0.6) | outside).float().mean()))


def test_calibrations_merged_states_give_the_routers_features_and_router(tiny_family, tmp_path: Path,
                                                                        monkeypatch) -> None:
    """Pooled over the prompt part of calibration rows (prompt + response), the merged states calibration
    computes are the features of the prompts alone; given them, the router runs the merge only for the other
    tasks and fits the same router."""
    config = load_config(write_run(tiny_family, tmp_path))
    config = updated(config, evaluation=EvaluationSection(cache=False))  # every feature computed, none read back
    data = resolve_sources(config).data
    tokenizer, model = load_tokenizer(tiny_family.base), load_causal_lm(tiny_family.base)
    pooled = {}
    for task in TASKS:
        rows = tokenized(data[task], task, "calibration", config.calibration, tokenizer)
        hidden = merged_hidden(model, rows.input_ids, rows.attention_mask, ["final"])["final"]
        pooled[task], has_prompt = row_prompt_features(hidden, rows.attention_mask, rows.response_mask)
        assert bool(has_prompt.all()) == rows.has_boundary and bool(has_prompt.any()) == rows.has_boundary
    # math's prompt/response rows: their prompts' features; code's plain text has no prompt part.
    prompts = task_prompts(data["math"], "calibration", config, tokenizer)
    torch.testing.assert_close(pooled["math"], prompt_features(model, prompts, "final", pad_id(tokenizer)),
                               atol=1e-5, rtol=1e-4)
    assert pooled["code"].shape[0] == 0

    computed = []
    real = router_module.prompt_features
    monkeypatch.setattr(router_module, "prompt_features",
                        lambda m, p, *a, **k: computed.append(len(p)) or real(m, p, *a, **k))
    own = fit_run_router(config, data, tiny_family.base, "final", model=model)
    own_router = TaskRouter.load(Path(own["path"]))
    runs_alone = list(computed)
    computed.clear()
    given = fit_run_router(config, data, tiny_family.base, "final", model=model,
                           calibration_features={"math": pooled["math"]})
    assert given["features_from_calibration"] == ["math"] and "features_from_calibration" not in own
    assert runs_alone == [10, 10, 6, 6] and computed == [10, 6, 6]  # math's 10 calibration prompts not run
    assert given["accuracy"] == own["accuracy"] and given["train_accuracy"] == own["train_accuracy"]
    given_router = TaskRouter.load(Path(given["path"]))
    for name in ("mean", "scale", "weight", "bias"):
        torch.testing.assert_close(getattr(given_router, name), getattr(own_router, name), atol=1e-3, rtol=1e-3)


def test_only_tasks_with_prompts_from_their_data_file_give_calibration_features(tmp_path: Path) -> None:
    """Plain text has no prompt part; a set with captured traffic holds fewer file prompts than the router reads."""
    chat = TokenizedSet.from_rows("chat", [([1, 2, 3], [False, True, True])], pad_id=0, has_boundary=True)
    text = TokenizedSet.from_rows("text", [([1, 2, 3], [True] * 3)], pad_id=0, has_boundary=False)
    files = TaskFiles(calibration=tmp_path / "rows.jsonl", heldout=None)
    sources = ResolvedSources(base=tmp_path, experts={}, data={
        "chat": files, "text": files, "served": replace(files, traffic=tmp_path / "traffic.jsonl")})
    assert router_tasks({"chat": chat, "text": text, "served": chat}, sources) == ["chat"]


@pytest.mark.slow
def test_calibrate_fits_the_router_and_registers_it_with_the_model(tiny_family, tmp_path: Path) -> None:
    path = write_run(tiny_family, tmp_path)
    config = yaml.safe_load(path.read_text())
    config["calibration"].update(steps=5, learning_rate=0.01, rank=4, max_positions=16)
    config["merge"] = {"method": "task_arithmetic", "parameters": {"weight": 0.5}}
    config["tracking"] = {"experiment": "test-router", "registered_model": "routed-tiny"}
    path.write_text(yaml.safe_dump(config))
    assert main(["calibrate", str(path), "--in-process"]) == 0
    run_dir = tmp_path / "runs" / "routed"
    report = json.loads((run_dir / "calibration.json").read_text())
    assert report["router"]["path"] == str(run_dir / "router.safetensors")
    assert report["router"]["accuracy"] == 1.0 and set(report["router"]["per_task"]) == set(TASKS)
    # The registered version carries the router next to the merged model and the corrections.
    files = fetch_model(connect(tracking_uri(TrackingSection().uri)), "models:/routed-tiny/1", tmp_path / "served")
    assert files.corrections is not None and files.router is not None
    assert TaskRouter.load(files.router).tasks == TASKS


@pytest.fixture(scope="module")
def merged(tiny_family) -> CorrectedLM:
    return CorrectedLM.load(tiny_family.base)


def constant_router(lm: CorrectedLM, probabilities: list[float], threshold: float) -> TaskRouter:
    """A router that gives every prompt the same task probabilities (zero weights, log-probability biases)."""
    d = lm.model.config.hidden_size
    return TaskRouter(TASKS, "final", torch.zeros(d), torch.ones(d), torch.zeros(len(TASKS), d),
                      torch.tensor(probabilities).log(), threshold)


def routed_lm(merged: CorrectedLM, router: TaskRouter, **options) -> CorrectedLM:
    corrections = strong_corrections(merged.model.config.hidden_size)
    return CorrectedLM(merged.model, merged.tokenizer, corrections, router, **options)


def test_routed_generation_takes_the_routers_task_or_no_correction(merged: CorrectedLM) -> None:
    sure = routed_lm(merged, constant_router(merged, [0.1, 0.9], threshold=0.5))
    try:
        routed = sure.generate(PROMPTS, [ROUTED] * 3, max_new_tokens=8)
        named = sure.generate(PROMPTS, ["math"] * 3, max_new_tokens=8)
        plain = sure.generate(PROMPTS, None, max_new_tokens=8)
    finally:
        sure.close()
    assert [c.text for c in routed] == [c.text for c in named]
    assert [c.text for c in routed] != [c.text for c in plain]
    assert {(c.task, round(c.confidence, 4)) for c in routed} == {("math", 0.9)}

    unsure = routed_lm(merged, constant_router(merged, [0.4, 0.6], threshold=0.5), threshold=0.7)
    try:
        abstained = unsure.generate(PROMPTS, [ROUTED] * 3, max_new_tokens=8)
    finally:
        unsure.close()
    assert [c.text for c in abstained] == [c.text for c in plain]
    assert {c.task for c in abstained} == {None}

    # Sure of math, but every prompt lies outside math's envelope (radius 0): no correction, unless told to route.
    d = merged.model.config.hidden_size
    envelope = Envelope(torch.zeros(len(TASKS), d), torch.ones(len(TASKS), d), torch.zeros(len(TASKS)))
    enveloped = constant_router(merged, [0.1, 0.9], threshold=0.5)
    enveloped.envelope = envelope
    for abstain, want in ((None, plain), (False, named)):
        lm = routed_lm(merged, enveloped, abstain_outside=abstain)
        try:
            outcome = lm.generate(PROMPTS, [ROUTED] * 3, max_new_tokens=8)
        finally:
            lm.close()
        assert [c.text for c in outcome] == [c.text for c in want]
        assert {c.task for c in outcome} == ({None} if abstain is None else {"math"})


def test_soft_routing_mixes_the_corrections_by_the_routers_probabilities(merged: CorrectedLM) -> None:
    lm = routed_lm(merged, constant_router(merged, [0.25, 0.75], threshold=0.5), soft_routing=True)
    seen = []
    # Read the weights the correction hooks applied while generating (after each forward: the prompt's own prefill
    # routes it inside the forward).
    probe = lm.model.register_forward_hook(lambda module, args, output: seen.append(lm._handle.task_weights.clone()))
    try:
        [completion] = lm.generate(PROMPTS[:1], [ROUTED], max_new_tokens=3)
    finally:
        probe.remove()
        lm.close()
    assert completion.task == "math"
    assert seen and all(torch.allclose(w, torch.tensor([[0.25, 0.75]])) for w in seen)


def test_a_routed_prompt_is_routed_in_its_own_prefill_as_a_pass_of_its_own_would(merged: CorrectedLM) -> None:
    """One forward per routed prompt's prefill (whole, or in chunks pooled across them): the router's picks, their
    confidences and the texts are those of routing in a pass of its own (`routes`) and naming the picked task."""
    d = merged.model.config.hidden_size
    generator = torch.Generator().manual_seed(3)
    router = TaskRouter(TASKS, "final", torch.zeros(d), torch.ones(d), torch.randn(len(TASKS), d, generator=generator),
                        torch.zeros(len(TASKS)), threshold=0.5)
    lm = routed_lm(merged, router)
    prompts = [*PROMPTS, "def scale(values, k):", "Question: 3 + 4 ="]
    try:
        assert lm.routes_in_prefill
        encoded = [lm.encode(p) for p in prompts]
        picks = lm.routes(encoded)
        confidences = router.route(prompt_features(lm.model, encoded, "final", lm.pad_id), 0.5).confidence.tolist()
        assert len(set(picks)) > 1  # the prompts go to different tasks
        forwards = []
        counter = lm.model.get_decoder().register_forward_pre_hook(lambda module, args: forwards.append(1))
        try:
            routed = lm.generate(prompts, [ROUTED] * len(prompts), max_new_tokens=1)
        finally:
            counter.remove()
        assert len(forwards) == 1  # the prompts' one prefill, which drew each first (and last) token
        assert [c.task for c in routed] == picks
        assert [c.confidence for c in routed] == pytest.approx(confidences, abs=1e-4)
        routed = lm.generate(prompts, [ROUTED] * len(prompts), max_new_tokens=8)
        named = lm.generate(prompts, picks, max_new_tokens=8)
        assert [c.text for c in routed] == [c.text for c in named]
        # A long prompt prefilled a few tokens a step: its states pooled over every chunk, routed with the last.
        long_prompt = " ".join(prompts)
        batcher = ContinuousBatcher(lm, max_batch_size=2, prefill_chunk_tokens=4)
        heard = []
        batcher.add(SequenceRequest(tuple(lm.encode(long_prompt)), ROUTED, Sampling(6)), heard.append)
        batcher.run_until_idle()
        [finished] = [event for event in heard if isinstance(event, Finished)]
        [pick] = lm.routes([lm.encode(long_prompt)])
        assert finished.completion.task == pick
        assert finished.completion.text == lm.generate([long_prompt], [pick], max_new_tokens=6)[0].text
    finally:
        lm.close()


def test_a_router_must_match_the_corrections(merged: CorrectedLM) -> None:
    d = merged.model.config.hidden_size
    other = TaskRouter(("code", "poetry"), "final", torch.zeros(d), torch.ones(d), torch.zeros(2, d), torch.zeros(2))
    with pytest.raises(DartsError, match="picks among tasks"):
        routed_lm(merged, other)
    with pytest.raises(DartsError, match="asks the task router, but this model has none"):
        merged.generate(PROMPTS[:1], [ROUTED])


def test_reserved_task_names_are_refused(tiny_family, tmp_path: Path) -> None:
    path = write_run(tiny_family, tmp_path)
    config = yaml.safe_load(path.read_text())
    config["sources"]["experts"][0]["task"] = "merged"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(DartsError, match="'merged' is reserved"):
        load_config(path)
