"""A merged causal LM with its DARTS corrections (and task router) inside, for transformers alone.

`darts-dist export` puts this file, hooks.py and correction.py beside the merged
weights; they need torch, transformers and safetensors only. `AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True)` builds the base architecture's own class (LlamaForCausalLM, Qwen2ForCausalLM, …) from
the merged weights and puts the corrections on it with hooks (`hooks.py`, the hooks darts-dist trains and serves
with): the instance is of a subclass of that class whose forward takes one more argument, `darts_task`.

`darts_task` (per call, e.g. `generate(..., darts_task="math")`, one name or one per row; else
`config.darts_task`) names a task's correction, "merged" (none: the plain merge) or "routed" (the router picks
each sequence's correction from its prompt, as darts-dist's routed model id does). A routed sequence is routed
once, on the first forward of a generation (the prompt), from the merged model's uncorrected states; its decoding
steps keep that pick. A forward without a KV cache (scoring a whole text) routes on all of its input.

`DartsCorrection.from_pretrained(DIR).apply(model)` does the same to a merged model loaded by other means.
"""

from __future__ import annotations

import json
import os
import shutil
import types
import weakref
from collections.abc import Sequence
from functools import cache
from inspect import Parameter, Signature, signature
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import cached_file

from .correction import CorrectionSpec, DartsCorrections, mask_positions, one_hot_tasks
from .hooks import attach_corrections, capture_hidden, surgery_module

MERGED = "merged"
ROUTED = "routed"
CORRECTIONS_FILE, ROUTER_FILE = "corrections.safetensors", "router.safetensors"
# This file and what it imports: what a folder needs to load corrected (transformers copies them from it).
CODE_FILES = ("modeling_darts.py", "hooks.py", "correction.py")
# The model only: config.json keeps the merged model's own model_type, so its config (and AutoTokenizer, which
# reads it first) loads without remote code; AutoModelForCausalLM with trust_remote_code=True takes this class.
AUTO_MAP = {"AutoModelForCausalLM": "modeling_darts.DartsForCausalLM"}
SETTINGS_FILE = "darts_correction.json"  # a correction-only folder's settings; a model folder keeps them in config.json
HEADER_KEY = "darts_dist"  # where darts-dist's safetensors files keep their JSON header
# Fields of the merged model the corrections record and that a model they are put on must have.
_MODEL_FIELDS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "vocab_size": "vocab_size"}
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
_NO_CORRECTION, _ROUTE = -1, -2


def darts_section(base_model_type: str, tasks: Sequence[str], layers: Sequence[str | int], routed: bool,
                  threshold: float | None, soft_routing: bool, abstain_outside: bool | None) -> dict[str, Any]:
    """config.json's `darts` section (a correction folder's darts_correction.json): where the corrections and router
    are, and how routed sequences are routed (`outside`: what a prompt outside its top task's envelope gets,
    "abstain" (no correction) or "route"; None: as the router file says)."""
    outside = None if abstain_outside is None or not routed else "abstain" if abstain_outside else "route"
    return {"base_model_type": base_model_type, "tasks": list(tasks), "layers": list(layers),
            "corrections": CORRECTIONS_FILE, "router": ROUTER_FILE if routed else None,
            "threshold": threshold if routed else None, "routing": "soft" if soft_routing else "hard",
            "outside": outside}


def _read_tagged(path: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A darts-dist safetensors file's tensors and JSON header."""
    with safe_open(path, framework="pt") as f:
        header = json.loads((f.metadata() or {}).get(HEADER_KEY, "null"))
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a darts-dist corrections or router file (no {HEADER_KEY!r} header)")
    return tensors, header


class TaskRouter:
    """softmax(W·(h̄ − mean)/scale + b) over the tasks, h̄ a prompt's mean hidden state at `layer`, and each task's
    envelope (darts-dist's `core.router.TaskRouter`, applied the same way: on the CPU, in fp32)."""

    def __init__(self, path: str) -> None:
        tensors, header = _read_tagged(path)
        self.tasks: tuple[str, ...] = tuple(header["tasks"])
        self.layer: str | int = header["layer"]
        self.threshold: float = header["threshold"]
        self.abstain_outside: bool = header.get("abstain_outside", True)
        self.mean, self.scale, self.weight, self.bias = (tensors[k].float() for k in ("mean", "scale", "weight", "bias"))
        self.envelope = tuple(tensors[f"envelope_{k}"].float() for k in ("center", "spread", "radius")) \
            if header.get("envelope") else None

    def probabilities(self, pooled: Tensor) -> Tensor:
        x = (pooled.float().cpu() - self.mean) / self.scale
        return torch.softmax(x @ self.weight.T + self.bias, dim=-1)

    def inside(self, pooled: Tensor, task: Tensor) -> Tensor:
        """[n] bool: whether each prompt lies within `task`'s envelope, mean_j ((z_j − center_j) / spread_j)² at
        most its radius, z the standardised features (always, for a router without envelopes)."""
        if self.envelope is None:
            return torch.ones(len(task), dtype=torch.bool)
        center, spread, radius = self.envelope
        z = (pooled.float().cpu() - self.mean) / self.scale
        return (((z - center[task]) / spread[task]) ** 2).mean(dim=-1) <= radius[task]


def _abstain_outside(outside: str | None) -> bool | None:
    """The `darts` section's `outside`: "abstain" or "route", or None (absent: as the router file says)."""
    if outside not in (None, "abstain", "route"):
        raise ValueError(f"darts.outside is {outside!r}: use \"abstain\", \"route\" or leave it out")
    return None if outside is None else outside == "abstain"


def _load_corrections(path: str) -> tuple[DartsCorrections, dict[str, Any]]:
    """The corrections in a darts-dist corrections file, and what they record about their merged model."""
    tensors, header = _read_tagged(path)
    corrections = DartsCorrections(CorrectionSpec.from_dict(header["spec"]), header["layers"])
    # The file names tensors "{layer}.{parameter}"; the module keeps them under layers.
    corrections.load_state_dict({f"layers.{name}": t for name, t in tensors.items()}, strict=True)
    return corrections.requires_grad_(False), header.get("metadata", {})


class DartsCorrection:
    """The corrections and router of one darts-dist calibration, to put on a copy of the merged model they were
    trained for (`apply`): the paper's fraction of a percent of the model's parameters, shipped on its own."""

    def __init__(self, corrections: DartsCorrections, router: TaskRouter | None = None, *,
                 made_for: dict[str, Any] | None = None, threshold: float | None = None,
                 soft_routing: bool = False, files: dict[str, str] | None = None,
                 default_task: str | None = None, abstain_outside: bool | None = None) -> None:
        """`files`: the corrections and router files this was read from, which a saved model carries along;
        `default_task`: what `apply` sets as the model's darts_task unless told or the model says otherwise."""
        self.corrections = corrections
        self.default_task = default_task
        self.files = files or {}
        self.router = router
        self.made_for = made_for or {}
        self.tasks: tuple[str, ...] = tuple(corrections.spec.tasks)
        if router is not None and router.tasks != self.tasks:
            raise ValueError(f"the router picks among {list(router.tasks)}, the corrections have {list(self.tasks)}")
        self.threshold = threshold if threshold is not None else router.threshold if router is not None else 1.0
        self.soft_routing = soft_routing
        self.abstain_outside = abstain_outside if abstain_outside is not None else (
            router.abstain_outside if router is not None else True)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, settings: dict[str, Any] | None = None,
                        **hub_kwargs: Any) -> DartsCorrection:
        """The correction in a folder (or Hub repository) that `darts-dist export` wrote, either format."""
        path = str(path)
        if settings is None:
            try:
                settings = json.loads(open(cached_file(path, SETTINGS_FILE, **hub_kwargs)).read())
            except OSError:  # a model folder: the settings are config.json's darts section
                settings = json.loads(open(cached_file(path, "config.json", **hub_kwargs)).read())["darts"]
        files = {CORRECTIONS_FILE: cached_file(path, settings["corrections"], **hub_kwargs)}
        if settings.get("router"):
            files[ROUTER_FILE] = cached_file(path, settings["router"], **hub_kwargs)
        corrections, made_for = _load_corrections(files[CORRECTIONS_FILE])
        router = TaskRouter(files[ROUTER_FILE]) if ROUTER_FILE in files else None
        return cls(corrections, router, made_for=made_for, threshold=settings.get("threshold"),
                   soft_routing=settings.get("routing") == "soft", files=files,
                   default_task=settings.get("darts_task"),
                   abstain_outside=_abstain_outside(settings.get("outside")))

    def settings(self, base_model_type: str) -> dict[str, Any]:
        """The `darts` section of a folder holding these corrections."""
        return darts_section(base_model_type, self.tasks, self.corrections.layer_keys, self.router is not None,
                             self.threshold, self.soft_routing, self.abstain_outside)

    def apply(self, model: PreTrainedModel, task: str | None = None) -> PreTrainedModel:
        """Put the corrections on `model` (a merged model of the shape they were trained for) and return it, now
        of a subclass of its class whose forward and generate() take `darts_task`; `task` sets its default."""
        if isinstance(model, _DartsForward):
            raise ValueError("this model has DARTS corrections already")
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        wrong = [f"{field}: the corrections' model has {self.made_for[field]}, this one {getattr(config, attr)}"
                 for field, attr in _MODEL_FIELDS.items()
                 if field in self.made_for and getattr(config, attr, None) != self.made_for[field]]
        if wrong:
            raise ValueError("these corrections were trained for another model (" + "; ".join(wrong)
                             + "): put them on the merged model darts-dist exported with them")
        default = (task or getattr(model.config, "darts_task", None) or self.default_task
                   or (ROUTED if self.router else MERGED))
        model.__class__ = darts_class(type(model))
        if "_old_forward" in model.__dict__:  # accelerate's dispatch (device_map, offload) calls the forward it kept
            model._old_forward = types.MethodType(type(model).forward, model)
            model.forward.__wrapped__ = model._old_forward  # generate() reads the signature: darts_task is in it
        model._darts_init(self)
        model.config.darts_task = default
        model.config.darts = self.settings(getattr(model.config, "darts", {}).get("base_model_type",
                                                                                  model.config.model_type))
        model.config.auto_map = AUTO_MAP
        model._darts_indices(default, 1)  # an unknown default is refused now, not at the first call
        return model


def _execution_device(module: torch.nn.Module, fallback: torch.device) -> torch.device:
    """Where `module` computes: accelerate's execution device for a dispatched (offloaded) module, else where its
    weights are; never `meta` (an offloaded module's weights sit there while it is not running)."""
    hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(hook_device)
    weight = next(module.parameters(), None)
    if weight is not None and weight.device.type != "meta":
        return weight.device
    return fallback if fallback.type != "meta" else torch.device("cpu")


def _order(layer: str | int) -> float:
    """Where a surgery layer comes in the forward: decoder layers by index, then the final norm."""
    return float("inf") if layer == "final" else int(layer)


class _DartsForward:
    """What a corrected model adds to its architecture's class: the correction each forward applies."""

    def _darts_init(self, darts: DartsCorrection) -> None:
        self.darts = darts
        self._darts_handle = attach_corrections(self, darts.corrections)
        # Each generation's routing, by its KV cache: its decoding steps keep the prompt's pick.
        self._darts_routes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Routing within the corrected forward itself, when no correction comes before the router's layer: its
        # states there are the uncorrected ones the router reads, so a hook on that layer, run before the
        # correction's, routes the rows waiting in _darts_pending (weights, rows, mask). Else a pass of its own.
        self._darts_pending: tuple[Tensor, list[int], Tensor] | None = None
        self._darts_routing: Tensor | None = None  # the running forward's routed weights
        router = darts.router
        self._darts_in_pass = router is not None and all(
            _order(layer) >= _order(router.layer) for layer in darts.corrections.layer_keys)
        if self._darts_in_pass:
            surgery_module(self, router.layer).register_forward_hook(self._darts_route_hook, prepend=True)
        self._darts_place()

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """The base's save_pretrained (push_to_hub's too), plus what makes the folder load corrected again: the
        corrections and router files, this code, and config.json's DartsForCausalLM."""
        if set(self.darts.files) != {CORRECTIONS_FILE, *([ROUTER_FILE] if self.darts.router else [])}:
            raise ValueError("these corrections were not read from files, so they cannot be saved with the model")
        if kwargs.get("push_to_hub"):  # transformers would upload before the files below are written
            raise ValueError("save_pretrained(push_to_hub=True) would upload the model without its corrections: "
                             "call model.push_to_hub(repo_id), which saves all of it first")
        super().save_pretrained(save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True):
            return
        folder, here = Path(save_directory), Path(__file__).absolute().parent
        for name, path in [*self.darts.files.items(), *((name, here / name) for name in CODE_FILES)]:
            shutil.copyfile(path, folder / name)
        config = json.loads((folder / "config.json").read_text())
        config.update(architectures=[DartsForCausalLM.__name__])
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def _darts_place(self) -> None:
        """Each layer's correction on the device of the module it corrects (a model split over GPUs included)."""
        for layer in self.darts.corrections.layer_keys:
            self.darts.corrections[layer].to(_execution_device(surgery_module(self, layer), self.device))
        self._darts_device = self.device

    def _darts_indices(self, task: str | Sequence[str], rows: int) -> list[int]:
        names = [task] * rows if isinstance(task, str) else list(task)
        if names and rows % len(names) == 0:  # generate() repeats each row for its beams or returned sequences
            names = [name for name in names for _ in range(rows // len(names))]
        if len(names) != rows:
            raise ValueError(f"darts_task names {len(names)} tasks for a batch of {rows} sequences")
        known = {MERGED: _NO_CORRECTION, ROUTED: _ROUTE, **{t: k for k, t in enumerate(self.darts.tasks)}}
        unknown = sorted({name for name in names if name not in known})
        if unknown or (ROUTED in names and self.darts.router is None):
            raise ValueError(f"darts_task {unknown or ROUTED} is not one this model knows: it has "
                             f"{[*self.darts.tasks, MERGED] + ([ROUTED] if self.darts.router else [])}")
        return [known[name] for name in names]

    def _darts_weights(self, task: str | Sequence[str] | None, inputs: dict[str, Any]) -> Tensor | None:
        """Each row's [K] correction weights for this forward (None: no row is corrected)."""
        first = inputs.get("input_ids") if inputs.get("input_ids") is not None else inputs["inputs_embeds"]
        indices = self._darts_indices(self.config.darts_task if task is None else task, first.shape[0])
        if all(index == _NO_CORRECTION for index in indices):
            return None
        weights = one_hot_tasks(torch.tensor([max(i, _NO_CORRECTION) for i in indices]), len(self.darts.tasks))
        routed = [row for row, index in enumerate(indices) if index == _ROUTE]
        if not routed:
            return weights
        kv = inputs.get("cache", inputs.get("past_key_values"))
        if kv is not None and kv.get_seq_length() > 0:  # a decoding step: the prompt's routing holds
            if kv not in self._darts_routes:
                raise ValueError("a routed decoding step without its prompt's forward: route on the prompt first "
                                 "(generate() does), or name a task")
            return self._darts_routes[kv]
        if self._darts_in_pass:
            self._darts_pending = (weights, routed, self._darts_mask(inputs, first)[routed])
        else:
            weights[routed] = self._darts_route(inputs, routed)
        self._darts_routing = weights  # kept by the forward's cache, once it ran (_darts_forward)
        return weights

    @staticmethod
    def _darts_mask(inputs: dict[str, Any], first: Tensor) -> Tensor:
        """The rows' real tokens [B, S]: the forward's 2D attention mask, or every token."""
        mask = inputs.get("attention_mask")
        if mask is None:
            return torch.ones(first.shape[:2], dtype=torch.long, device=first.device)
        if mask.ndim != 2:
            raise ValueError("routing reads a 2D attention mask (which tokens are real): pass one, or name a task")
        return mask

    def _darts_pick(self, states: Tensor, mask: Tensor) -> Tensor:
        """The router's [n, K] weights for states [n, S, d] at its layer, pooled over the mask's real tokens."""
        darts, keep = self.darts, mask.to(states.device).float()
        pooled = torch.einsum("bs,bsd->bd", keep, states.float()) / keep.sum(dim=1, keepdim=True)
        probabilities = darts.router.probabilities(pooled)
        confidence, task = probabilities.max(dim=-1)
        chosen = probabilities if darts.soft_routing else one_hot_tasks(task, len(darts.tasks))
        keep = confidence >= darts.threshold
        if darts.abstain_outside:
            keep &= darts.router.inside(pooled, task)
        return chosen * keep.float()[:, None]

    @torch.no_grad()
    def _darts_route_hook(self, module: Any, args: Any, output: Any) -> None:
        if self._darts_pending is None:
            return
        weights, rows, mask = self._darts_pending
        self._darts_pending = None
        states = output if isinstance(output, Tensor) else output[0]
        weights[rows] = self._darts_pick(states[rows], mask)  # in place: the correction's hook reads it next

    @torch.no_grad()
    def _darts_route(self, inputs: dict[str, Any], rows: list[int]) -> Tensor:
        """The router's weights for `rows`, from a pass of the merged model, uncorrected, over this forward's input."""
        layer = self.darts.router.layer
        first = inputs.get("input_ids") if inputs.get("input_ids") is not None else inputs["inputs_embeds"]
        mask = self._darts_mask(inputs, first)[rows]
        positions = inputs.get("position_ids")
        positions = mask_positions(mask) if positions is None else positions.expand(first.shape[0], -1)[rows]
        with self._darts_handle.weighted(None), capture_hidden(self, [layer]) as hidden:
            self.get_decoder()(**{"input_ids" if inputs.get("input_ids") is not None else "inputs_embeds": first[rows]},
                               attention_mask=mask, position_ids=positions, use_cache=False)
        return self._darts_pick(hidden[layer], mask)

    def _darts_forward(self, base_forward, base_signature: Signature, *args: Any,
                       darts_task: str | Sequence[str] | None = None, **kwargs: Any):
        if self.device != self._darts_device:  # the model moved (model.to(...)) since the last forward
            self._darts_place()
        inputs = base_signature.bind_partial(self, *args, **kwargs).arguments
        extra = next((p.name for p in base_signature.parameters.values() if p.kind == Parameter.VAR_KEYWORD), None)
        inputs = {**inputs.pop(extra, {}), **inputs}
        self._darts_routing = None
        try:
            with self._darts_handle.weighted(self._darts_weights(darts_task, inputs)):
                output = base_forward(self, *args, **kwargs)
        finally:
            self._darts_pending = None  # a forward that failed before the router's layer leaves nothing behind
        kv = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        if self._darts_routing is not None and kv is not None:  # a routed prompt: its decoding steps keep the pick
            self._darts_routes[kv] = self._darts_routing
        return output


@cache
def darts_class(base: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """`base` (e.g. LlamaForCausalLM) with DARTS corrections: the same name, weights and outputs, plus `darts_task`.

    Named as its base, so that pipelines and lm-eval, which check the class name, treat it as the base."""
    base_forward = base.forward
    base_signature = signature(base_forward)

    def forward(self, *args: Any, darts_task: str | Sequence[str] | None = None, **kwargs: Any):
        return self._darts_forward(base_forward, base_signature, *args, darts_task=darts_task, **kwargs)

    # generate() passes what the forward's signature names (position_ids, logits_to_keep, darts_task): the base's.
    parameters = list(base_signature.parameters.values())
    extra = Parameter("darts_task", Parameter.KEYWORD_ONLY, default=None)
    at = next((i for i, p in enumerate(parameters) if p.kind == Parameter.VAR_KEYWORD), len(parameters))
    forward.__signature__ = base_signature.replace(parameters=[*parameters[:at], extra, *parameters[at:]])
    forward.__doc__ = base_forward.__doc__
    return type(base.__name__, (_DartsForward, base), {"forward": forward, "__module__": __name__,
                                                        "__doc__": f"{base.__name__} with DARTS corrections."})


class DartsForCausalLM(PreTrainedModel):
    """What `auto_map` names: loads the merged model as its base architecture's class, corrections on."""

    config_class = PretrainedConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, config: Any = None,
                        **kwargs: Any) -> PreTrainedModel:
        hub = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
        if config is None:
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        if not isinstance(getattr(config, "darts", None), dict):
            raise ValueError("this config.json has no 'darts' section: export the model again with "
                             "`darts-dist export --format hf`")
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
            pretrained_model_name_or_path, *args, config=config, **kwargs)
        return DartsCorrection.from_pretrained(pretrained_model_name_or_path, config.darts, **hub).apply(model)

