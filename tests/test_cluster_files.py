"""cluster/ and jobs/: the launcher YAML, the KubeRay manifests and the job entry points are valid,
consistent with each other, and give the configs what they ask for."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from darts_dist.config import load_config, parse_config
from darts_dist.plan.cluster import unplaced
from darts_dist.ray_cluster.placement import custom_resources, job_bundles

REPO = Path(__file__).absolute().parent.parent
JOB_COMMANDS = ("merge", "calibrate", "recalibrate", "evaluate", "register", "serve-deploy")


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def resources_of(start_params: dict) -> dict[str, float]:
    """The custom resources a KubeRay rayStartParams gives its pods (a JSON string in a string)."""
    return yaml.safe_load(yaml.safe_load(start_params["resources"])) if "resources" in start_params else {}


def test_the_launcher_yaml_has_a_cpu_head_and_gpu_workers_for_the_llama_job() -> None:
    cluster = yaml.safe_load((REPO / "cluster" / "ray-cluster.yaml").read_text())
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type", "max_workers",
                "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in cluster, key
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["max_workers"] == 0
    workers = [t for name, t in types.items() if name != cluster["head_node_type"]]
    assert all(t["resources"]["GPU"] > 0 and t["min_workers"] <= t["max_workers"] for t in workers)
    assert sum(t["max_workers"] for t in workers) <= cluster["max_workers"]
    # At its largest, the cluster holds every expert actor and calibration worker of the llama config.
    config = load_config(REPO / "jobs" / "configs" / "llama2-7b.yaml")
    nodes = [head["resources"]] + [t["resources"] for t in workers for _ in range(t["max_workers"])]
    assert unplaced([("actor", b) for b in job_bundles(config.cluster, len(config.tasks))], nodes) == []
    assert any("--head" in command for command in cluster["head_start_ray_commands"])


TOKEN_SECRET = "darts-dist-ray-token"


def token_auth_env(container: dict) -> tuple[str | None, dict | None]:
    """A container's RAY_AUTH_MODE and where its RAY_AUTH_TOKEN comes from."""
    env = {item["name"]: item for item in container.get("env", [])}
    return env.get("RAY_AUTH_MODE", {}).get("value"), env.get("RAY_AUTH_TOKEN", {}).get("valueFrom")


def test_every_shipped_cluster_turns_on_rays_token_authentication() -> None:
    """The dashboard's job API runs code on every node: no shipped cluster starts it, or any Ray node, without
    the token, and every client the files define (KubeRay's submitter) sends it."""
    launcher = yaml.safe_load((REPO / "cluster" / "ray-cluster.yaml").read_text())
    options = launcher["docker"]["run_options"]
    assert "--env RAY_AUTH_MODE=token" in options
    [token_path] = [o.split("=", 1)[1] for o in options if o.startswith("--env RAY_AUTH_TOKEN_PATH=")]
    assert launcher["file_mounts"][token_path] == "~/.ray/auth_token"
    for command in launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]:
        if "ray start" in command:
            assert command.startswith(f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token_path} ray start"), command

    (cluster,) = load_all(REPO / "cluster" / "kuberay" / "raycluster.yaml")
    _, job = load_all(REPO / "cluster" / "kuberay" / "rayjob.yaml")
    pods = [cluster["spec"]["headGroupSpec"]["template"]["spec"],
            *(group["template"]["spec"] for group in cluster["spec"]["workerGroupSpecs"]),
            job["spec"]["submitterPodTemplate"]["spec"]]
    for pod in pods:
        for container in pod["containers"]:
            assert token_auth_env(container) == ("token", {"secretKeyRef": {"name": TOKEN_SECRET, "key": "auth_token"}}), \
                container["name"]
    # Whatever else lands in cluster/: a dashboard on every interface only beside token auth.
    for path in (REPO / "cluster").rglob("*"):
        if path.is_file() and "0.0.0.0" in path.read_text():
            assert "RAY_AUTH_MODE" in path.read_text(), path


def test_kuberay_cluster_and_job_fit_the_config_they_carry() -> None:
    (cluster,) = load_all(REPO / "cluster" / "kuberay" / "raycluster.yaml")
    config_map, job = load_all(REPO / "cluster" / "kuberay" / "rayjob.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (config_map["kind"], job["kind"]) == ("ConfigMap", "RayJob")
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]

    # The ConfigMap holds the llama config unchanged, and it validates.
    (name, text), = config_map["data"].items()
    assert yaml.safe_load(text) == yaml.safe_load((REPO / "jobs" / "configs" / name).read_text())
    config = parse_config(yaml.safe_load(text))

    # The entrypoint runs an existing job command on the config where the head pod mounts the ConfigMap.
    entry = shlex.split(job["spec"]["entrypoint"])
    assert entry[:2] == ["python", "/app/jobs/run.py"] and (REPO / "jobs" / "run.py").is_file()
    assert entry[2] in JOB_COMMANDS and entry[3] == f"/config/{name}"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in head["volumes"]}
    config_volume = next(n for n, v in volumes.items() if v.get("configMap", {}).get("name") == config_map["metadata"]["name"])
    assert mounts[config_volume] == "/config"

    # GPU requests match the resources Ray is told about, and the largest cluster fits the job.
    nodes = [{"CPU": 8}]
    for group in cluster["spec"]["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert int(container["resources"]["requests"]["nvidia.com/gpu"]) == gpus > 0
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        node = {"CPU": float(container["resources"]["limits"]["cpu"]), "GPU": gpus, **resources_of(group["rayStartParams"])}
        nodes += [node] * group["maxReplicas"]
    bundles = job_bundles(config.cluster, len(config.tasks))
    assert unplaced([("actor", bundle) for bundle in bundles], nodes) == []
    assert set(custom_resources(bundles)) <= {k for n in nodes for k in n}
    # Every image is the one cluster/Dockerfile builds, at this version.
    images = {c["image"] for spec in (head, *(g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]))
              for c in spec["containers"]}
    assert images == {"ghcr.io/darts-dist/darts-dist:0.2.0-gpu"}
    assert "FROM rayproject/ray:2.60.0" in (REPO / "cluster" / "Dockerfile").read_text()


def test_the_runtime_env_pins_this_version_and_ships_no_build_output() -> None:
    import darts_dist

    env = yaml.safe_load((REPO / "jobs" / "runtime_env.yaml").read_text())
    assert env["working_dir"] == "."
    assert env["env_vars"]["DARTS_DIST_VERSION"] == darts_dist.__version__
    assert {".venv", ".git", "runs", "mlruns"} <= set(env["excludes"])


@pytest.mark.parametrize("config", [*sorted((REPO / "jobs" / "configs").glob("*.yaml")),
                                    *sorted((REPO / "darts_dist" / "configs").glob("*.yaml"))],
                         ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_every_shipped_config_validates_and_its_record_reads_back(config: Path) -> None:
    loaded = load_config(config)
    assert len(loaded.tasks) >= 2 and all(expert.data.calibration for expert in loaded.sources.experts)
    # What a run records of it (run.json, MLflow's params) is a config that reads back as the same one.
    assert parse_config(loaded.model_dump(mode="json")) == loaded


def test_the_job_entry_point_forwards_to_the_command_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "jobs/run.py", "calibrate", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "--address" in result.stdout
    result = subprocess.run([sys.executable, "jobs/run.py", "validate", "x"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "usage:" in result.stderr  # validate is not a job command
    # A runtime env pinning another version: refused before the command runs.
    result = subprocess.run([sys.executable, "jobs/run.py", "calibrate", "x.yaml"], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "DARTS_DIST_VERSION": "0.0.1"})
    assert result.returncode == 2
    assert "pins darts-dist 0.0.1" in result.stderr and "fix:" in result.stderr


def test_serve_deploy_needs_a_cluster_to_deploy_onto(monkeypatch, capsys) -> None:
    from darts_dist.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["serve-deploy", "models:/anything@champion"]) == 2
    err = capsys.readouterr().err
    assert "running Ray cluster" in err and "jobs/run.py serve-deploy" in err
