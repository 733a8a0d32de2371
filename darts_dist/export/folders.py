"""`darts-dist export`: the corrected model as a Hugging Face folder (`--format hf`), or its correction alone
(`--format correction`), written to a temporary sibling and renamed into place when whole."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Literal

import torch

from darts_dist.config import CORRECTIONS_FILE
from darts_dist.core import ROUTER_FILE, TaskRouter, modeling_darts, read_header
from darts_dist.core.modeling_darts import AUTO_MAP, CODE_FILES, MERGED, ROUTED, SETTINGS_FILE, darts_section
from darts_dist.errors import DartsError
from darts_dist.export.model_card import correction_card, model_card
from darts_dist.export.source import ExportSource
from darts_dist.export.weights import INDEX_FILE, copy_weights, weight_files
from darts_dist.fsutil import atomic_dir
from darts_dist.sources.corrections import load_corrections_for

Format = Literal["hf", "correction"]
FORMATS: tuple[str, ...] = ("hf", "correction")
# The exported model's code: darts-dist's own modules, which import only torch, transformers, safetensors and
# each other (relatively), so transformers' dynamic-module loader runs them from the folder.
CORE = Path(modeling_darts.__file__).absolute().parent
# Of the merged folder, the files that go along as they are: tokenizers, chat templates, generation settings and
# the merge recipe. Nothing else does: the folder is loaded with trust_remote_code=True, so a Python file (or any
# file transformers may read) that reached the merged folder must not reach it; its code is darts-dist's own.
# The weights, config.json, the index and README.md the export writes itself.
KNOWN_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "mergekit_config.yml",
})
logger = logging.getLogger(__name__)


def _check_loadable(merged_dir: Path) -> dict[str, Any]:
    """The merged model's config.json, refused unless transformers has a causal-LM class for its architecture."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = json.loads((merged_dir / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise DartsError(f"the merged model's architecture {model_type!r} ({merged_dir}) has no causal-LM class in "
                         "this transformers, so the exported folder could not be loaded",
                         "export a model of an architecture AutoModelForCausalLM loads (Llama, Mistral, Qwen2, …)")
    return config


def darts_settings(source: ExportSource, model_type: str) -> dict[str, Any]:
    """The `darts` section: where the corrections and router are, and how routed requests are routed (the run's
    serve settings, as its server routes; without them the router's own threshold and abstention apply)."""
    files, serve = source.files, source.config.serve if source.config is not None else None
    header = read_header(files.corrections)
    return darts_section(model_type, header["spec"]["tasks"], header["layers"], files.router is not None,
                         serve.router_threshold if serve is not None else None,
                         serve is not None and serve.routing == "soft",
                         serve.router_abstain_outside if serve is not None else None)


def default_task(source: ExportSource, tasks: list[str], task: str | None) -> str:
    """The task the model applies when a call names none: `task`, else routed (a run with a router)."""
    task = task or (ROUTED if source.files.router is not None else None)
    if task is None:
        raise DartsError(f"{source.origin} has no task router, so the model cannot route by itself",
                         f"pass --task with one of {tasks} (or {MERGED}); calls can still name another")
    if task == ROUTED and source.files.router is None:
        raise DartsError(f"--task {ROUTED}: {source.origin} has no task router", f"pass one of {tasks} or {MERGED}")
    if task not in (*tasks, MERGED, ROUTED):
        raise DartsError(f"--task {task!r} is not a task of these corrections",
                         f"pass one of {[*tasks, MERGED] + ([ROUTED] if source.files.router else [])}")
    return task


def _copy_corrections(source: ExportSource, folder: Path) -> None:
    shutil.copyfile(source.files.corrections, folder / CORRECTIONS_FILE)
    if source.files.router is not None:
        TaskRouter.load(source.files.router)  # refused here if unreadable, not on the user's machine
        shutil.copyfile(source.files.router, folder / ROUTER_FILE)
    for name in CODE_FILES:
        shutil.copyfile(CORE / name, folder / name)


def _copy_known_files(merged_dir: Path, folder: Path) -> list[str]:
    """Copy the merged folder's KNOWN_FILES (regular files only) into `folder`; the names left out (the weights,
    config.json, the index and README.md, which the export writes itself, are not among them)."""
    written = {path.name for path in weight_files(merged_dir)} | {"config.json", "README.md", INDEX_FILE}
    left = []
    for path in sorted(merged_dir.iterdir()):
        if path.name in written:
            continue
        if path.name in KNOWN_FILES and path.is_file() and not path.is_symlink():
            shutil.copyfile(path, folder / path.name)
        else:
            left.append(path.name + ("/" if path.is_dir() else ""))
    return left


def is_export(folder: Path) -> bool:
    """Whether `folder` is a folder `export` wrote (either format), or an empty one: what --overwrite may replace."""
    if not folder.is_dir() or folder.is_symlink():
        return False
    if not any(folder.iterdir()) or (folder / SETTINGS_FILE).is_file():
        return True
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "darts" in config and "DartsForCausalLM" in config.get("architectures", [])


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def export_model(source: ExportSource, out: Path, fmt: Format = "hf", task: str | None = None,
                 overwrite: bool = False, dtype: str | None = None) -> Path:
    """Write `source`'s corrected model (hf) or its correction (correction) to `out`; every check runs first.
    `dtype`: the exported weights' dtype (float32, bfloat16 or float16; config.json says it, so transformers loads
    them in it with dtype="auto"); None keeps the merged model's."""
    files = source.files
    if files.corrections is None:
        raise DartsError(f"{source.origin} has no corrections: there is nothing to export but the plain merge",
                         "export a run that calibrated DARTS corrections (`darts-dist calibrate` or `demo`)")
    if out.exists() and not overwrite:
        raise DartsError(f"{out} exists", "pass --overwrite to replace it, or another --out")
    inputs = [p.absolute() for p in (files.merged_dir, files.corrections, files.router) if p is not None]
    if any(p == out.absolute() or p.is_relative_to(out.absolute()) for p in inputs):
        raise DartsError(f"--out {out} holds the files being exported ({files.merged_dir})",
                         "pass an --out outside the run folder's merged model and corrections")
    if out.exists() and not is_export(out):
        raise DartsError(f"{out} exists and is not a darts-dist export (no config.json naming DartsForCausalLM, no "
                         f"{SETTINGS_FILE}): --overwrite replaces only an earlier export",
                         "pass another --out, or move that folder away yourself")
    config = _check_loadable(files.merged_dir)
    load_corrections_for(files.corrections, files.merged_dir)  # made for this merged model, or refused now
    settings = darts_settings(source, config["model_type"])
    default = default_task(source, settings["tasks"], task)
    with atomic_dir(out, overwrite=overwrite) as folder:
        _copy_corrections(source, folder)
        if fmt == "correction":
            _write_json(folder / SETTINGS_FILE, {**settings, "darts_task": default})
            (folder / "README.md").write_text(correction_card(source, settings, out.name))
            return out
        copy_weights(files.merged_dir, folder, dtype=None if dtype is None else getattr(torch, dtype))
        left = _copy_known_files(files.merged_dir, folder)
        if left:
            logger.warning("export: left out of %s: %s (only tokenizer, template, generation and recipe files go "
                           "along; the folder's code is darts-dist's own)", out, ", ".join(left))
        if dtype is not None:  # transformers 5 reads `dtype`; an older file's `torch_dtype` would contradict it
            config = {**{k: v for k, v in config.items() if k != "torch_dtype"}, "dtype": dtype}
        _write_json(folder / "config.json", {**config, "architectures": ["DartsForCausalLM"], "auto_map": AUTO_MAP,
                                             "darts": settings, "darts_task": default})
        (folder / "README.md").write_text(model_card(source, settings, default, out.name))
    return out
