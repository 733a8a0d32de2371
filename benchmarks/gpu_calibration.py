"""gpu_calibration: a Llama-2-7B-shaped calibration on GPUs: tokens/s, the ratio to its forward floor, GPU memory.

Runs only where CUDA is present; elsewhere it prints one line saying it skipped, and exits 0.
Nothing is downloaded. The base is a random-init model of Llama-2-7B's shape (d=4096, FFN 11008,
32 heads, vocab 32000, 32 layers: `--layers` makes it shallower), in bf16. The three experts are
the base with their top layer and final norm perturbed, saved as shards hard-linked to the base's
wherever they are the same, so four models cost the disk little more than one. The merged model is
the base itself: calibration throughput does not depend on what the merge computed. The layout is
`darts-dist plan`'s: each expert gets a GPU of its own where there are four or more GPUs and every
other GPU a worker (ZeRO-0, the frozen model replicated, unless the plan finds it does not fit a GPU:
then ZeRO-3); with fewer, one worker holds a GPU (half of it where there is only one) and the experts
share the rest. A layout the plan refuses is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from common import emit, forward_floor, note, parser

from darts_dist.calibrate.ray.job import job_plan, run_calibration_job
from darts_dist.config import RunConfig, parse_config
from darts_dist.fsutil import atomic_dir, cache_root
from darts_dist.plan import build_plan
from darts_dist.plan.check import local_node
from darts_dist.plan.cluster import placement_problems, size_problems
from darts_dist.sources.demo.tiny import build_tiny_tokenizer
from darts_dist.sources.references import resolve_sources

TASKS = ("code", "math", "instruct")


def llama2_7b_shape(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, dtype="bfloat16")


def build_family(root: Path, layers: int) -> dict[str, Path]:
    """Base and experts on disk (cached by shape); the experts' unchanged shards are hard links."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    base = root / "base"
    if not (base / "model.safetensors.index.json").is_file():
        note(f"building a random Llama-2-7B-shaped base with {layers} layers")
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = LlamaForCausalLM(llama2_7b_shape(layers)).to(torch.bfloat16)
        with atomic_dir(base, overwrite=True) as tmp:
            model.save_pretrained(tmp, max_shard_size="2GB")
            build_tiny_tokenizer().save_pretrained(tmp)  # its ids are a subset of the model's vocabulary
        del model
        torch.cuda.empty_cache()
    weight_map = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    top = f"model.layers.{layers - 1}."
    changed = {name for name, shard in weight_map.items() if name.startswith(top) or name == "model.norm.weight"}
    experts = {}
    for index, task in enumerate(TASKS):
        folder = root / task
        experts[task] = folder
        if folder.is_dir():
            continue
        with atomic_dir(folder) as tmp:
            for item in base.iterdir():
                if item.name in {weight_map[name] for name in changed}:
                    tensors = load_file(item)
                    generator = torch.Generator().manual_seed(index + 1)
                    for name in changed & tensors.keys():
                        noise = torch.randn(tensors[name].shape, generator=generator)
                        tensors[name] = tensors[name] + (0.05 * noise).to(tensors[name].dtype)
                    save_file(tensors, tmp / item.name, metadata={"format": "pt"})
                elif item.suffix == ".safetensors":
                    os.link(item, tmp / item.name)
                else:
                    shutil.copy2(item, tmp / item.name)
    return {"base": base, **experts}


def layouts(gpus: int) -> list[dict[str, object]]:
    """Cluster sections to try, the first the plan accepts wins: a GPU per expert and per worker, ZeRO-0 then
    ZeRO-3; with fewer GPUs than roles, one worker and the experts sharing what is left."""
    experts = len(TASKS)
    if gpus >= experts + 1:
        own = {"num_workers": gpus - experts, "expert_resources": {"GPU": 1}}
        return [own | {"zero_stage": 0}, own | {"zero_stage": 3}]
    worker = 1.0 if gpus > 1 else 0.5
    return [{"num_workers": 1, "zero_stage": 0, "worker_resources": {"GPU": worker},
             "expert_resources": {"GPU": (gpus - worker) / experts}}]


def planned_config(family: dict[str, Path], args, gpus: int, gpu_bytes: int) -> tuple[RunConfig, list[str]]:
    """The first layout `darts-dist plan` finds room for on one node of `gpus` GPUs of `gpu_bytes`, or the last
    one tried with what the plan found wrong with it."""
    for cluster in layouts(gpus):
        config = parse_config({
            "name": "gpu", "output_dir": str(cache_root() / "benchmarks" / "gpu-runs"),
            "sources": {"base": str(family["base"]), "experts": [
                {"task": task, "path": str(family[task]), "data": {"calibration": f"demo:{task}"}} for task in TASKS]},
            "calibration": {"num_samples": args.samples, "steps": args.steps, "max_length": 512, "max_positions": 512,
                            "batch_size": 8, "dtype": "bfloat16"},
            "cluster": {"use_gpu": True, "run_id": f"gpu-{time.strftime('%Y%m%d-%H%M%S')}", **cluster},
        })
        roles = [role for role in build_plan(config).roles if role.phase == "calibration"]
        node = local_node(roles) | {"GPU": float(gpus)}  # the job's local cluster, on this machine's GPUs
        found = placement_problems(roles, [node]) + size_problems(roles, [node], gpu_bytes)
        if not found:
            return config, []
    return config, found


def main() -> None:
    p = parser(__doc__.splitlines()[0], samples=64, steps=100)
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    if not torch.cuda.is_available():
        note("no CUDA device: gpu_calibration skipped")
        print(json.dumps({"name": "gpu_calibration", "value": None, "baseline": None, "ratio": None, "unit": "tokens/s",
                          "skipped": "no CUDA device"}), flush=True)
        return
    gpus = torch.cuda.device_count()
    family = build_family(cache_root() / "benchmarks" / f"llama2-7b-shaped-{args.layers}", args.layers)
    config, found = planned_config(family, args, gpus, torch.cuda.get_device_properties(0).total_memory)
    if found:
        note("the plan refuses every layout on these GPUs:\n    " + "\n    ".join(found))
        print(json.dumps({"name": "gpu_calibration", "value": None, "baseline": None, "ratio": None,
                          "unit": "tokens/s", "skipped": found}), flush=True)
        return
    sources = resolve_sources(config)
    merged = family["base"]
    note("timing the bare forward passes on one GPU")
    floor = forward_floor(config, sources, merged)
    torch.cuda.empty_cache()
    plan = job_plan(config, sources, merged)
    tokens = sum(int(rows.attention_mask.sum()) for rows in plan.data.values())
    start = time.perf_counter()
    job = run_calibration_job(plan)
    wall = time.perf_counter() - start
    emit("gpu_calibration", tokens / wall, tokens / floor["total"], "tokens/s",
         seconds={"calibrate": round(wall, 2), "floor": round(floor["total"], 2)},
         floor_ratio=round(wall / floor["total"], 3),
         breakdown={k: round(v, 2) for k, v in job.timings.items()},
         peak_gpu_memory_per_worker_gib=round(max(job.memory["workers"]) / 2**30, 2),
         gpus=gpus, workers=config.cluster.num_workers, zero_stage=config.cluster.zero_stage, layers=args.layers,
         tokens=tokens,
         steps=len(job.losses), device=torch.cuda.get_device_name(0))


if __name__ == "__main__":
    main()
