"""`darts-dist plan`: model sizes from config.json alone (meta device), each role's memory, and whether a cluster
holds the run, refused with error/fix and exit 2 before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import FAKE_GPUS, RAY_CLUSTER_CPUS
from transformers import AutoModelForCausalLM

from darts_dist.cli import main
from darts_dist.config import load_config, parse_config
from darts_dist.evaluate.retention import RETENTION_ROW_TOKENS
from darts_dist.plan import build_plan
from darts_dist.plan.cluster import GIB, problems, unplaced
from darts_dist.plan.roles import MAPPED_INPUTS, Role
from darts_dist.plan.shapes import model_config, shape_of

REPO = Path(__file__).absolute().parent.parent
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "torch_dtype": "float16"}


def llama_example(tmp_path: Path, name: str = "llama2-7b.yaml") -> Path:
    """A shipped 7B example with its four models as folders holding Llama-2-7B's config.json alone."""
    text = (REPO / "jobs" / "configs" / name).read_text().replace("/mnt/models", str(tmp_path / "models"))
    sources = yaml.safe_load(text)["sources"]
    for path in [sources["base"], *(expert["path"] for expert in sources["experts"])]:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text(json.dumps(LLAMA2_7B))
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def llama2_7b(tmp_path: Path) -> Path:
    """The 7B example as it shipped before the plan: 3 experts and 2 workers (5 GPUs), evaluation on 5 GPUs."""
    path = llama_example(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["cluster"] |= {"num_workers": 2, "zero_stage": 3}
    config["evaluation"] = {}
    path.write_text(yaml.safe_dump(config))
    return path


def nodes_file(tmp_path: Path, *nodes: dict) -> Path:
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(list(nodes)))
    return path


def test_llama2_7b_sizes_from_its_config_alone(llama2_7b: Path) -> None:
    plan = build_plan(load_config(llama2_7b))
    assert plan.merged.weight_bytes("bfloat16") == pytest.approx(13.5e9, rel=0.01)  # 6.74 B parameters
    assert plan.merged.kv_bytes_per_token("bfloat16") == 512 * 1024  # 2 · 32 layers · 4096 · 2 bytes
    assert plan.correction_share == pytest.approx(0.001, rel=0.05)  # the paper's 0.1%
    expert = next(role for role in plan.roles if role.name.startswith("expert actor"))
    assert expert.device == "GPU" and expert.memory["weights"] == plan.merged.weight_bytes("bfloat16")


def test_the_parameter_count_is_the_models_own(tiny_family) -> None:
    shape = shape_of(model_config(str(tiny_family.base)))
    model = AutoModelForCausalLM.from_pretrained(tiny_family.base)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert shape.kv_values_per_token == 2 * 4 * 2 * 16  # layers · KV heads · head size, keys and values


def test_a_five_gpu_plan_on_four_gpus_is_refused_in_seconds(llama2_7b: Path, tmp_path: Path, capsys) -> None:
    resources = nodes_file(tmp_path, {"CPU": 8}, {"CPU": 48, "GPU": 4, "gpu_node": 4, "accelerator_type:A100": 1})
    start = time.monotonic()
    assert main(["plan", str(llama2_7b), "--resources", str(resources)]) == 2
    assert time.monotonic() - start < 60
    err = capsys.readouterr().err
    assert "calibration: expert actor" in err and "(5 in all)" in err and "fix:" in err
    assert "evaluation:" in err  # base, three experts and the merge: five actors of one GPU each


def test_a_plan_with_room_fits_and_a_small_gpu_is_refused(llama2_7b: Path, tmp_path: Path, capsys) -> None:
    gpus = {"CPU": 48, "GPU": 4, "gpu_node": 4}
    roomy = nodes_file(tmp_path, {"CPU": 8}, {**gpus, "accelerator_type:A100": 1}, {**gpus, "accelerator_type:A100": 1})
    assert main(["plan", str(llama2_7b), "--resources", str(roomy)]) == 0
    assert "fits" in capsys.readouterr().out
    small = nodes_file(tmp_path, {"CPU": 8}, {**gpus, "accelerator_type:T4": 1}, {**gpus, "accelerator_type:T4": 1})
    assert main(["plan", str(llama2_7b), "--resources", str(small)]) == 2
    err = capsys.readouterr().err
    assert "GiB on a GPU" in err and "16 GiB" in err  # a 7B expert in bf16 is 12.6 GiB before its forward


@pytest.mark.parametrize("name, gpus, gib", [("llama2-7b.yaml", 4, 48), ("llama2-7b-24gb.yaml", 8, 24)])
def test_the_shipped_7b_examples_fit_the_gpus_they_name(tmp_path: Path, name: str, gpus: int, gib: int) -> None:
    """llama2-7b.yaml on one node of the launcher's 4 × 48 GB GPUs (cluster/ray-cluster.yaml), and the 24 GB example
    on one node of 8 × 24 GB: every phase fits, with GPU memory to spare for each role."""
    launcher = yaml.safe_load((REPO / "cluster" / "ray-cluster.yaml").read_text())["available_node_types"]
    gpu_node = next(t["resources"] for t in launcher.values() if t["resources"].get("GPU"))
    node = {**gpu_node, "GPU": gpus, "gpu_node": gpus, "CPU": max(gpu_node["CPU"], 12 * gpus)}
    plan = build_plan(load_config(llama_example(tmp_path, name)))
    assert problems(plan.roles, [{"CPU": 8}, node], gib * GIB) == []
    # The phase that needs the most GPUs at once: with one GPU fewer than that it does not fit.
    most = max(sum(r.count * r.bundle.get("GPU", 0) for r in plan.roles if r.phase == phase)
               for phase in ("calibration", "evaluation", "serving"))
    assert most <= gpus and problems(plan.roles, [{"CPU": 8}, {**node, "GPU": most - 1}], gib * GIB) != []


def test_no_two_actors_share_a_whole_gpu() -> None:
    worker = {"CPU": 1, "GPU": 1}
    assert unplaced([("a", worker), ("b", worker)], [{"CPU": 4, "GPU": 1}]) == [("b", worker)]
    half = {"CPU": 1, "GPU": 0.5}
    assert unplaced([("a", half), ("b", half)], [{"CPU": 4, "GPU": 1}]) == []


def test_a_fractional_gpu_counts_its_neighbours_memory(llama2_7b: Path) -> None:
    plan = build_plan(load_config(llama2_7b))
    expert = next(role for role in plan.roles if role.name.startswith("expert actor"))
    shared = type(expert)(expert.name, expert.phase, 1, {**expert.bundle, "GPU": 0.5}, expert.memory)
    assert problems([expert], [{"CPU": 8, "GPU": 1, "gpu_node": 1}], 24 * GIB) == []
    assert "GiB on a GPU" in problems([shared], [{"CPU": 8, "GPU": 1, "gpu_node": 1}], 24 * GIB)[0]


@pytest.mark.parametrize("case, expected", [("no-config", "has no config.json"),
                                            ("bad-resources", "not shaped like ray.cluster_resources")])
def test_bad_input_is_refused(llama2_7b: Path, tmp_path: Path, capsys, case: str, expected: str) -> None:
    args = ["plan", str(llama2_7b)]
    if case == "no-config":
        (tmp_path / "models" / "WizardMath-7B-V1.0" / "config.json").unlink()
    else:
        (tmp_path / "bad.json").write_text(json.dumps({"CPU": "many"}))
        args += ["--resources", str(tmp_path / "bad.json")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert expected in err and "fix:" in err


@pytest.mark.slow
def test_a_live_cluster_with_four_fake_gpus_is_asked(llama2_7b: Path, ray_cluster) -> None:
    """The test session's Ray cluster (4 GPUs it does not have: Ray takes the count as given), asked by `plan
    --address` from a process of its own as a user's head is: the plan reads its nodes, and the 7B example's five
    GPU actors do not fit."""
    import ray

    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run([sys.executable, "-m", "darts_dist.cli", "plan", str(llama2_7b), "--address",
                             ray.get_runtime_context().gcs_address, "--gpu-memory", "80"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"1 node(s), {RAY_CLUSTER_CPUS} CPUs, {FAKE_GPUS} GPUs of 80 GiB" in result.stdout
    assert "(5 in all)" in result.stderr and "fix:" in result.stderr


def test_the_commands_check_before_they_start_anything(llama2_7b: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """`calibrate`, `evaluate` and `serve` run the plan's check first: on this machine (no Ray cluster joined, no
    GPU) a config asking for GPUs is refused before any merge, MLflow run or Ray session, its `cluster.autoscaler`
    notwithstanding (no autoscaler adds nodes to a local cluster)."""
    assert load_config(llama2_7b).cluster.autoscaler
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as a fresh command: not the test session's cluster
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for command in (["calibrate", str(llama2_7b)], ["evaluate", str(llama2_7b), "--corrections", str(llama2_7b)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "error: the cluster cannot hold this run" in err and "(on a local Ray cluster on this machine)" in err
        assert "GPU: 1" in err and "fix:" in err
    assert not (tmp_path / "mnt").exists() and not Path("/mnt/runs/llama2-7b-code-math-chat").exists()
    merged = tmp_path / "models" / "Llama-2-7b-hf"  # its serve section: 2 replicas, a GPU each
    assert main(["serve", str(merged), "--config", str(llama2_7b)]) == 2
    err = capsys.readouterr().err
    assert "serving: serving replica asks for {CPU: 1, GPU: 1}" in err


def test_an_autoscaler_waits_for_nodes_but_no_gpu_grows(llama2_7b: Path, monkeypatch, caplog) -> None:
    from darts_dist.errors import DartsError
    from darts_dist.plan.check import check_launch

    config = load_config(llama2_7b)
    plan = build_plan(config)
    roles = [role for role in plan.roles if role.phase == "calibration"]
    head = [{"CPU": 8.0, "memory": 32.0 * GIB}]  # the autoscaler has not added a GPU node yet
    monkeypatch.setattr("darts_dist.plan.check.launch_nodes", lambda address, roles: (head, "a test cluster"))
    with pytest.raises(DartsError, match="no node has it free"):
        check_launch(roles, config.cluster.model_copy(update={"autoscaler": False}))  # a fixed cluster
    scaling = config.cluster.model_copy(update={"autoscaler": True})  # as the shipped 7B examples say
    check_launch(roles, scaling)  # left to the autoscaler
    assert "waiting up to 900 s" in caplog.text
    small_gpus = [{"CPU": 64.0, "GPU": 8.0, "gpu_node": 8.0, "accelerator_type:T4": 1.0}]
    monkeypatch.setattr("darts_dist.plan.check.launch_nodes", lambda address, roles: (small_gpus, "a test cluster"))
    evaluation = [role for role in plan.roles if role.phase == "evaluation"]  # 24 GiB each with their KV cache
    with pytest.raises(DartsError, match="GiB on a GPU"):
        check_launch(evaluation, scaling)


def test_the_driver_holds_no_model_when_the_models_are_on_gpus(llama2_7b: Path) -> None:
    config = load_config(llama2_7b)
    plan = build_plan(config)
    driver = plan.driver
    # Only the merge, on the CPU: the four models' fp16 files mapped and read once, a 5 GB output shard held.
    assert list(driver.stages) == ["merge"] and "weights" not in driver.parts
    assert driver.parts["mapped inputs"] == 4 * plan.merged.weight_bytes("float16")
    assert driver.resident_bytes - driver.memory["calibration rows"] == 5 * 10**9
    # An export (a command of its own) holds a 5 GB output shard and the largest tensor read, the LM head in fp32.
    [export] = [role for role in plan.roles if role.phase == "export"]
    assert export.bytes == 5 * 10**9 + 32000 * 4096 * 4
    # MLflow's check of the logged model takes a GPU of its own, in the run's bf16.
    [check] = [role for role in plan.roles if role.phase == "registration"]
    assert check.device == "GPU" and check.memory["weights"] > plan.merged.weight_bytes("bfloat16")
    cpu = parse_config(config.model_dump(mode="json") | {"cluster": {"use_gpu": False}})
    on_cpu = build_plan(cpu)
    # On CPUs evaluation runs in-process: the merged model and one other at a time, in the config's dtype (which
    # the CPU computes in too), and the registration check on the driver.
    assert on_cpu.driver.stages["in-process"]["weights"] == 2 * on_cpu.merged.weight_bytes("bfloat16")
    assert "router and registration check" in on_cpu.driver.stages
    assert not [role for role in on_cpu.roles if role.phase == "registration"]


def test_a_role_holds_its_largest_stage_and_needs_no_memory_for_inputs_read_once() -> None:
    role = Role("driver", "driver", 1, {"CPU": 1.0}, {"rows": 1},
                {"merge": {MAPPED_INPUTS: 100, "merge output": 10}, "router": {"weights": 50}})
    assert role.peak_stage == "merge" and role.bytes == 111 and role.parts == {"rows": 1, MAPPED_INPUTS: 100,
                                                                               "merge output": 10}
    assert role.resident_bytes == 51  # the router's weights: the mapped files can be dropped, weights cannot


def test_evaluation_actors_score_then_answer_and_the_base_answers_and_scores_retention(tiny_family) -> None:
    config = parse_config({"name": "t", "sources": {"base": str(tiny_family.base), "experts": [
        {"task": t, "path": str(p)} for t, p in tiny_family.experts.items()]},
        "evaluation": {"executor": "ray", "generation_batch_size": 4}})
    plan = build_plan(config)
    actors = {role.name: role for role in plan.roles if role.phase == "evaluation"}
    assert set(actors["evaluation actor (base)"].stages) == {"answers", "retention", "retention replies"}
    merged = actors["evaluation actor (merged)"]
    assert merged.stages["retention"]["logits"] == 3 * 4 * RETENTION_ROW_TOKENS * plan.merged.vocab_size * 4
    # For the retention set alone the base runs first in the merge's bundle: no actor of its own.
    retention_only = parse_config(config.model_dump(mode="json") | {"evaluation": {
        **config.evaluation.model_dump(mode="json"), "score_base": False}})
    roles = {role.name: role for role in build_plan(retention_only).roles}
    assert "evaluation actor (base)" not in roles and "retention replies" in roles["evaluation actor (merged)"].stages
    c, shape = config.calibration, plan.merged
    # Logits in fp32, then NLL's fp32 copy of the shifted logits and its log-softmax.
    assert merged.stages["scoring"]["logits"] == 3 * c.batch_size * c.max_length * shape.vocab_size * 4
    assert merged.bytes == shape.weight_bytes("float32") + max(sum(stage.values()) for stage in merged.stages.values())


def test_a_zero3_worker_holds_the_whole_model_while_it_loads_then_its_partition(llama2_7b: Path) -> None:
    """Each ZeRO-3 rank loads the whole merged model before DeepSpeed partitions it: the plan's peak is the whole
    model beside the rank's partition, not the partition alone (13.5 GB of bf16 weights, 2 ranks)."""
    plan = build_plan(load_config(llama2_7b))
    worker = next(role for role in plan.roles if role.name == "calibration worker")
    weights = plan.merged.weight_bytes("bfloat16")
    assert worker.peak_stage == "load"
    assert worker.parts["whole model before partitioning"] == weights
    assert worker.memory["weights"] == weights // 2 + plan.correction_parameters * 4  # fp32 corrections
    assert weights * 1.5 <= worker.bytes < weights * 1.6


def test_regmean_gram_actors_hold_an_experts_grams_and_the_driver_solves_one_linear_at_a_time(
    llama2_7b: Path, tmp_path: Path,
) -> None:
    """Llama-2-7B's Grams by hand: per layer q/k/v's, o_proj's and gate/up's [4096²] and down_proj's [11008²], fp32:
    22.0 GB an expert, held by its actor on a GPU node, never by the driver."""
    config = load_config(llama2_7b)
    regmean = parse_config(config.model_dump(mode="json") | {"merge": {"method": "regmean"}})
    plan = build_plan(regmean)
    actors = [role for role in plan.roles if role.phase == "merge"]
    assert [role.name for role in actors] == [f"Gram actor ({t})" for t in regmean.tasks]
    assert actors[0].parts["grams"] == 32 * (3 * 4096**2 + 11008**2) * 4
    assert actors[0].parts["weights"] == plan.merged.weight_bytes("bfloat16") and actors[0].device == "GPU"
    solve = plan.driver.stages["regmean"]["solve"]  # down_proj: 3 experts' fp32 shares, float64 sums and factor
    assert solve == 3 * (11008**2 + 11008 * 4096) * 4 + (2 * 11008**2 + 11008 * 4096) * 8
    assert "experts and their grams" not in plan.driver.stages["regmean"]
    assert "carried states" not in actors[0].parts
    # RegMean++'s actors also carry their task's states between layers (and through the next one): bf16, rows ×
    # length × 4096, twice.
    plus = build_plan(parse_config(config.model_dump(mode="json") | {"merge": {"method": "regmean_plus"}}))
    c = config.calibration
    carried = [role for role in plus.roles if role.phase == "merge"][0].parts["carried states"]
    assert carried == 2 * c.num_samples * c.max_length * 4096 * 2
    assert not [role for role in build_plan(config).roles if role.phase == "merge"]  # mergekit merges: no actors
    # The fit is checked phase by phase: three Gram actors need three GPUs of room for 36 GB each.
    small = nodes_file(tmp_path, {"CPU": 16, "GPU": 4, "memory": 256 * GIB})
    found = problems(plan.roles, json.loads(small.read_text()), 24 * GIB)
    assert any(line.startswith("merge: Gram actor (code) needs") for line in found), found


def test_an_evaluation_keeps_its_passes_in_host_memory_and_the_plan_counts_them(tiny_family, tmp_path: Path) -> None:
    """Kept passes are each held-out token's hidden state in the compute dtype: an expert actor's over its task's
    rows, the merged actor's over every task's, with the experts' it judges against; host memory beside a GPU."""
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(30)))
    experts = [{"task": t, "path": str(p), "data": {"calibration": str(heldout), "heldout": str(heldout)}}
               for t, p in tiny_family.experts.items()]
    config = parse_config({"name": "t", "sources": {"base": str(tiny_family.base), "experts": experts},
                           "calibration": {"max_length": 16, "dtype": "bfloat16"},
                           "cluster": {"use_gpu": True}, "evaluation": {"executor": "ray"}})
    plan = build_plan(config)
    token_bytes = 16 * plan.merged.hidden_size * 2  # a row's tokens at most, bf16
    actors = {role.name: role for role in plan.roles if role.phase == "evaluation"}
    assert actors["evaluation actor (code)"].host == {"kept outputs": 30 * token_bytes}
    assert actors["evaluation actor (merged)"].host == {"kept outputs": 2 * 3 * 30 * token_bytes}
    assert "kept outputs" not in actors["evaluation actor (merged)"].parts  # not on the GPU
    in_process = build_plan(parse_config(config.model_dump(mode="json") | {"cluster": {"use_gpu": False},
                                                                           "evaluation": {"executor": "in-process"}}))
    assert in_process.driver.stages["in-process"]["kept outputs"] == 2 * 30 * token_bytes
    # A node without the host memory for them is refused.
    assert any("keeps" in p and "host memory" in p for p in problems(
        plan.roles, [{"CPU": 64, "GPU": 8, "memory": 2 * 3 * 30 * token_bytes - 1}], 80 * GIB))


def test_a_cpu_role_computing_in_another_dtype_than_its_file_holds_both_while_it_loads(tiny_family) -> None:
    """Measured (benchmarks/scaling.py): a bf16 worker of an fp32 merge peaks at both copies while it loads; on a GPU
    only the cast copy is on the device."""
    sources = {"base": str(tiny_family.base), "experts": [{"task": "code", "path": str(tiny_family.experts["code"])}]}
    cpu = build_plan(parse_config({"sources": sources, "calibration": {"dtype": "bfloat16"}}))
    worker = next(role for role in cpu.roles if role.name == "calibration worker")
    assert worker.stages["load"] == {"weights as saved, while cast": cpu.merged.weight_bytes("float32")}
    assert worker.memory["weights"] >= cpu.merged.weight_bytes("bfloat16")
    same = build_plan(parse_config({"sources": sources, "calibration": {"dtype": "float32"}}))
    assert "load" not in next(role for role in same.roles if role.name == "calibration worker").stages
    gpu = build_plan(parse_config({"sources": sources, "calibration": {"dtype": "bfloat16"},
                                   "cluster": {"use_gpu": True}}))
    assert not next(role for role in gpu.roles if role.name == "calibration worker").stages


def test_the_logit_term_adds_its_top_tokens_to_the_feature_store_and_its_logits_to_a_workers_step(
    llama2_7b: Path,
) -> None:
    """calibration.logit_weight: a row brings 8 bytes a listed token (fp32 log-probability, int32 id) per token, and a
    step holds the head's fp32 logits, their log-softmax and its gradient ([B, S, V] each; [B, P, V] at
    calibration.logit_positions P)."""
    from darts_dist.config import updated

    config = load_config(llama2_7b)
    config = updated(config, cluster=updated(config.cluster, zero_stage=2, feature_memory_mb=1 << 20))
    held = {}
    for weight, positions in ((0.0, None), (1.0, None), (1.0, 16)):
        calibration = updated(config.calibration, logit_weight=weight, logit_positions=positions)
        plan = build_plan(updated(config, calibration=calibration))
        held[weight, positions] = next(role for role in plan.roles if role.name == "calibration worker").parts
    c = config.calibration
    tokens = len(config.tasks) * c.num_samples / config.cluster.num_workers * c.max_length
    without = held[0.0, None]
    assert held[1.0, None]["feature store"] - without["feature store"] == int(tokens * 8 * c.logit_top_k)
    assert held[1.0, 16]["feature store"] == held[1.0, None]["feature store"]  # every token's targets are kept
    assert held[1.0, None]["activations"] - without["activations"] == 3 * c.batch_size * c.max_length * 32000 * 4
    assert held[1.0, 16]["activations"] - without["activations"] == 3 * c.batch_size * 16 * 32000 * 4
