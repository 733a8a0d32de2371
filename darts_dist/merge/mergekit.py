"""Merging through mergekit as a library: configs built or read, checked before any weight loads, then run.

A config here is mergekit's own YAML schema as a plain dict, so a user's mergekit YAML
works unchanged and a config we build can be handed to the `mergekit-yaml` CLI.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
import yaml
from huggingface_hub.utils import HFValidationError, validate_repo_id
from mergekit import merge_methods as mergekit_methods
from mergekit.common import ModelPath, ModelReference
from mergekit.config import MergeConfiguration
from mergekit.io.tasks import LoaderCache
from mergekit.merge import run_merge as mergekit_run_merge
from mergekit.merge_methods.base import BasePolicy, MergeMethod
from mergekit.options import MergeOptions
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from darts_dist.config import GRAM_MERGES, MergeSection
from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_dir, cache_root
from darts_dist.logs import on_terminal
from darts_dist.sources.models import VOCABULARY_POLICY, added_rows, check_compatible, read_model_info, resolve_path

# Keys under which mergekit's schema holds a model reference ("path[@rev][+lora[@rev]]").
_REFERENCE_KEYS = frozenset({"model", "base_model", "tokenizer_source", "source", "lora", "path"})
# Values of a tokenizer's source that name a strategy, not a model.
_TOKENIZER_STRATEGIES = frozenset({"union", "base"})
_TOKENIZER_SOURCE_KEYS = frozenset({"tokenizer_source", "source"})


REGMEAN, REGMEAN_PLUS = GRAM_MERGES  # darts-dist's own data-aware merges (merge.regmean); mergekit has the others


def mergekit_method_names() -> tuple[str, ...]:
    """Names of the merge methods the installed mergekit knows."""
    return tuple(sorted(method.spec.name for method in mergekit_methods.registered_methods()))


def merge_methods() -> tuple[str, ...]:
    """Every merge method a run may name: mergekit's, RegMean and RegMean++."""
    return tuple(sorted((*mergekit_method_names(), *GRAM_MERGES)))


def check_merge_method(merge: MergeSection) -> None:
    """A DartsError now for a merge.method (or RegMean's merge.others.method) that neither mergekit nor darts-dist
    has: `validate` and the commands that merge say so before any work, not when the merge starts."""
    if merge.mergekit_yaml is not None:  # its YAML names its own method, which mergekit checks as it loads it
        return
    known = merge_methods()
    for key, method in (("merge.method", merge.method),
                        ("merge.others.method", merge.others.method if merge.others else None)):
        if method is None or method in known:
            continue
        close = difflib.get_close_matches(method, known, n=1)
        raise DartsError(f"{key} {method!r} is not a merge method darts-dist knows"
                         + (f" (did you mean {close[0]!r}?)" if close else ""),
                         f"use one of {list(known)}")


def build_mergekit_config(
    base: Path,
    experts: Mapping[str, Path],
    method: str,
    parameters: Mapping[str, Any] | None = None,
    expert_parameters: Mapping[str, Mapping[str, Any]] | None = None,
    dtype: str = "float32",
) -> dict:
    """The mergekit YAML, as a dict, that merges `experts` onto `base` with `method`.

    `parameters` are the method's shared ones (e.g. normalize, lambda, or defaults for
    weight/density); `expert_parameters[name]` are one expert's (e.g. weight, density).
    Methods that ignore a base (linear, ...) get only the experts as inputs. Experts with vocabulary rows beyond
    the base's merge under the base's tokenizer (`tokenizer_source`: its folder; sources.models.VOCABULARY_POLICY).
    """
    spec = _method(method).spec
    unknown = set(expert_parameters or {}) - set(experts)
    if unknown:
        raise DartsError(
            f"parameters given for {sorted(unknown)}, which are not among the experts {sorted(experts)}",
            "key expert_parameters by the experts' names",
        )
    config: dict[str, Any] = {"merge_method": method}
    if spec.contract.base not in (BasePolicy.IGNORED, BasePolicy.FORBIDDEN):
        config["base_model"] = str(resolve_path(base))
    config["models"] = [
        {"model": str(resolve_path(path)), "parameters": dict((expert_parameters or {}).get(name, {}))}
        for name, path in experts.items()
    ]
    if parameters:
        config["parameters"] = dict(parameters)
    config["dtype"] = dtype
    base_info = read_model_info(resolve_path(base))
    if any(added_rows(base_info, read_model_info(resolve_path(path))) for path in experts.values()):
        config["tokenizer_source"] = str(resolve_path(base))
    _validated(config, origin=f"the {method} merge of {sorted(experts)}")
    return config


def load_mergekit_yaml(path: Path) -> dict:
    """A mergekit YAML as a dict, with local model paths made absolute (YAML's folder first, then cwd)."""
    path = Path(path).absolute()
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise DartsError(f"cannot read the mergekit YAML {path}: {exc}", "fix the file's YAML syntax") from exc
    if not isinstance(raw, dict):
        raise DartsError(f"{path} is not a mergekit config (expected a mapping with merge_method, models, ...)",
                         "see mergekit's examples/ for the format")
    config = _resolve_references(raw, path)
    _validated(config, origin=str(path))
    return config


def mergekit_model_paths(config: Mapping) -> list[Path]:
    """The local model folders a config merges, base model first; hub ids are left out."""
    return _local_model_paths(_validated(config, origin="the merge config"))


def merge_device(name: str) -> torch.device:
    """`merge.device` on this machine (the driver): cpu, cuda, or auto (CUDA where this machine sees a GPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DartsError("merge.device is cuda, but this machine (the driver) sees no CUDA device",
                         "set merge.device: auto (a GPU where there is one) or cpu")
    return torch.device(name)


def run_merge(
    config: Mapping[str, Any], out_dir: Path, overwrite: bool = False, seed: int | None = 0, device: str = "cpu",
) -> Path:
    """Merge with mergekit into `out_dir` (safetensors, tokenizer, mergekit_config.yml), atomically, computing on
    `device` (`merge_device`'s names).

    `seed` fixes the random masks of dare_* and della merges; mergekit applies it with
    transformers' set_seed, which reseeds the process's global RNGs.
    """
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and not overwrite:
        raise DartsError(f"merge output folder {out_dir} already exists", "choose a new folder or pass overwrite")
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        merge_into(config, tmp, seed, named=out_dir, device=device)
    return out_dir


def merge_into(config: Mapping[str, Any], folder: Path, seed: int | None = 0, named: Path | None = None,
               device: str = "cpu") -> None:
    """mergekit's merge written into `folder` (a temporary one the caller renames), on `device` (`merge_device`'s
    names); errors name `named`."""
    merge_config = _validated(config, origin="the merge config")
    _check_sources(merge_config)
    options = MergeOptions(
        device=str(merge_device(device)),
        copy_tokenizer=True,
        lazy_unpickle=False,
        safe_serialization=True,
        random_seed=seed,
        lora_merge_cache=str(cache_root() / "adapters" / "mergekit"),
        quiet=not on_terminal(),  # its bars redraw: in a log file, one line thousands of characters long
    )
    # mergekit keeps one loader per model in a process-wide dict that is never emptied:
    # a loader from an earlier merge would serve a folder's old index after it changed.
    # Our own dump, not mergekit's to_yaml, which fails on paths with spaces.
    source = yaml.safe_dump(dict(config), sort_keys=False)
    LoaderCache.loaders.clear()
    try:
        mergekit_run_merge(merge_config, str(folder), options=options, config_source=source)
        tokenizer_model = _tokenizer_model(config)
        if tokenizer_model is not None:
            keep_padding_rows(folder, tokenizer_model)
    # mergekit raises bare RuntimeError / KeyError / ValueError for inputs it cannot merge, and passes on
    # safetensors' own error for a weight file it cannot read.
    except (RuntimeError, KeyError, ValueError, OSError, SafetensorError) as exc:
        raise DartsError(
            f"mergekit could not merge into {named or folder}: {type(exc).__name__}: {exc}",
            "check the merge parameters and that every source folder holds complete weights",
        ) from exc
    finally:
        LoaderCache.loaders.clear()


def _tokenizer_model(config: Mapping[str, Any]) -> Path | None:
    """The model folder a merge's `tokenizer_source` names (its path, or `base`: the base model's), if any."""
    source = config.get("tokenizer_source")
    if source == "base":
        source = config.get("base_model")
    return Path(source) if isinstance(source, str) and Path(source).is_dir() else None


def keep_padding_rows(folder: Path, model: Path) -> None:
    """The merged model in `folder` with the vocabulary rows of `model` (its tokenizer's source) that mergekit left
    out: mergekit sizes the embeddings to the tokenizer's tokens, so a vocabulary padded past them (rows no token
    reaches, for the hardware) would shrink. Those rows come back as `model` has them, and config.json's
    vocab_size with them."""
    rows = read_model_info(model).vocab_size
    config_path = folder / "config.json"
    merged = json.loads(config_path.read_text())
    if merged["vocab_size"] >= rows:
        return
    padding = {}
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            padding |= {name: weights.get_slice(name)[merged["vocab_size"]:] for name in weights.keys()
                        if weights.get_slice(name).get_shape()[0] == rows}
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(file)
        grown = {name: torch.cat([tensors[name], padding[name].to(tensors[name].dtype)])
                 for name in tensors.keys() & padding.keys() if len(tensors[name]) == merged["vocab_size"]}
        if grown:
            save_file({**tensors, **grown}, str(file), metadata={"format": "pt"})
    config_path.write_text(json.dumps({**merged, "vocab_size": rows}, indent=2, sort_keys=True) + "\n")


def _method(name: str) -> MergeMethod:
    if name not in mergekit_method_names():
        if name in GRAM_MERGES:
            raise DartsError(f"{name} is darts-dist's own merge, not a mergekit method: it has no mergekit YAML",
                             f"set merge.method: {name} in a darts-dist config (merge.others merges the rest)")
        raise DartsError(f"unknown merge method {name!r}", f"use one of: {', '.join(mergekit_method_names())}")
    return mergekit_methods.get(name)


def _validated(config: Mapping[str, Any], origin: str) -> MergeConfiguration:
    """mergekit's own schema check plus what it leaves to merge time: method name, parameter names, inputs."""
    try:
        merge_config = MergeConfiguration.model_validate(dict(config))
    except (ValidationError, RuntimeError, ValueError, TypeError) as exc:
        raise DartsError(f"{origin} is not a valid mergekit config: {exc}", "see mergekit's config format") from exc
    spec = _method(merge_config.merge_method).spec
    # mergekit silently ignores unknown parameter names, so a typo ("densty") would merge with defaults.
    known = {parameter.name for parameter in spec.parameters}
    unknown = sorted(set(_parameter_names(dict(config))) - known)
    if unknown:
        raise DartsError(
            f"{origin}: merge method {merge_config.merge_method!r} has no parameter(s) {unknown}",
            f"its parameters are: {', '.join(sorted(known))}",
        )
    if merge_config.models:
        inputs = [entry.model for entry in merge_config.models]
        base = merge_config.base_model
        if base is not None and base not in inputs:
            inputs.append(base)  # mergekit adds the base to the inputs the same way
        try:
            _method(merge_config.merge_method).validate_inputs(inputs, base)
        except ValueError as exc:
            raise DartsError(
                f"{origin}: {exc}", f"see the inputs {merge_config.merge_method} takes in mergekit's docs"
            ) from exc
    return merge_config


def _parameter_names(node: Any) -> Iterator[str]:
    """Every key of every `parameters` mapping, at any depth of a raw config."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "parameters" and isinstance(value, dict):
                yield from value
            else:
                yield from _parameter_names(value)
    elif isinstance(node, list):
        for item in node:
            yield from _parameter_names(item)


def _resolve_references(node: Any, yaml_file: Path) -> Any:
    """A copy of a raw config whose model references name absolute local folders where they exist."""
    if isinstance(node, list):
        return [_resolve_references(item, yaml_file) for item in node]
    if not isinstance(node, dict):
        return node
    resolved = {}
    for key, value in node.items():
        if key == "parameters":
            resolved[key] = value  # parameter values are never paths
        elif key in _REFERENCE_KEYS and isinstance(value, str):
            is_strategy = key in _TOKENIZER_SOURCE_KEYS and value in _TOKENIZER_STRATEGIES
            resolved[key] = value if is_strategy else _resolve_reference(value, yaml_file)
        else:
            resolved[key] = _resolve_references(value, yaml_file)
    return resolved


def _resolve_reference(reference: str, yaml_file: Path) -> str:
    """Resolve each path of "path[@rev][+lora[@rev]]" (read by mergekit's own ModelReference), keeping revisions."""
    try:
        parsed = ModelReference.parse(reference)
    except (RuntimeError, ValidationError) as exc:
        raise DartsError(f"{yaml_file}: {reference!r} is not a model reference: {exc}",
                         "write PATH, PATH@REVISION or PATH+LORA_PATH") from None

    def resolved(path: ModelPath | None) -> ModelPath | None:
        return None if path is None else ModelPath(path=_resolve_model_path(path.path, yaml_file),
                                                   revision=path.revision)

    return str(ModelReference(model=resolved(parsed.model), lora=resolved(parsed.lora)))


def _resolve_model_path(path: str, yaml_file: Path) -> str:
    if path.startswith("bundled:"):
        return str(resolve_path(path))
    for relative_to in (yaml_file.parent, Path.cwd()):
        try:
            return str(resolve_path(path, relative_to))
        except DartsError:
            continue
    try:
        validate_repo_id(path)
    except HFValidationError:
        hub_id = False
    else:
        hub_id = not huggingface_hub.is_offline_mode()
    if hub_id:
        return path  # mergekit fetches it from the hub
    raise DartsError(
        f"{yaml_file}: model path {path!r} not found next to the YAML ({yaml_file.parent / path}) "
        f"or in the working directory ({Path.cwd() / path})",
        "fix the path (relative paths are taken from the YAML's folder), or name a hub model "
        "on a machine with hub access",
    )


def _check_sources(merge_config: MergeConfiguration) -> None:
    """Compare the shapes of a models-style merge's inputs from their configs, before mergekit loads any weight."""
    if not merge_config.models:
        return  # slices and modules may stack differently shaped models on purpose
    paths = _local_model_paths(merge_config)
    if len(paths) < 2:
        return
    reference, *others = (read_model_info(path) for path in paths)
    if merge_config.tokenizer_source or merge_config.tokenizer:
        # mergekit aligns differing vocabularies itself when told which tokenizer to build.
        others = [dataclasses.replace(info, vocab_size=reference.vocab_size) for info in others]
    elif any(info.vocab_size != reference.vocab_size for info in others):
        sizes = {str(info.path): info.vocab_size for info in (reference, *others)}
        raise DartsError(f"the models of this mergekit YAML have different vocabularies ({sizes}) and it names no "
                         "tokenizer_source, so mergekit's handling of the rows they do not share is left to the method",
                         f"add tokenizer_source: base (darts-dist's own policy: {VOCABULARY_POLICY}) or union")
    check_compatible(reference, {str(info.path): info for info in others})


def _local_model_paths(merge_config: MergeConfiguration) -> list[Path]:
    references = sorted(merge_config.referenced_models(),
                        key=lambda ref: (ref != merge_config.base_model, str(ref)))
    return [Path(ref.model.path) for ref in references if Path(ref.model.path).is_dir()]
