"""Hooks that put DARTS corrections inside a Hugging Face causal LM, for training, forward and generate()."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from .correction import DartsCorrections, LayerKey, active_tasks, mask_positions, one_hot_tasks, parse_layer

# Where Llama-style (layers, norm), GPT-2-style (h, ln_f) and OPT-style decoders keep their parts.
_LAYER_LISTS = ("layers", "h", "blocks")
_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm")


def _decoder(model: nn.Module) -> nn.Module:
    """The module that runs the decoder stack (LlamaModel inside LlamaForCausalLM)."""
    get_decoder = getattr(model, "get_decoder", None)
    return get_decoder() if callable(get_decoder) else model


def _find(module: nn.Module, names: Sequence[str], kind: type[nn.Module]) -> nn.Module | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, kind):
            return child
    return None


def surgery_module(model: nn.Module, layer: str | int) -> nn.Module:
    """The module whose output is corrected: "final" -> the final norm (input of lm_head); i -> decoder layer i."""
    key = parse_layer(layer)
    decoder = _decoder(model)
    if key == "final":
        norm = _find(decoder, _FINAL_NORMS, nn.Module)
        if norm is None:
            raise ValueError(
                f"cannot find the final norm of {type(model).__name__}: looked for {_FINAL_NORMS} "
                f"on {type(decoder).__name__}"
            )
        return norm
    layers = _find(decoder, _LAYER_LISTS, nn.ModuleList)
    if layers is None:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: looked for {_LAYER_LISTS} "
            f"on {type(decoder).__name__}"
        )
    if key >= len(layers):
        raise ValueError(f"surgery layer {key} is out of range: {type(model).__name__} has layers 0..{len(layers) - 1}")
    return layers[key]


def token_positions(
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    seq_len: int,
    past_len: int,
    batch_size: int,
    device: torch.device | str,
) -> Tensor:
    """Each token's position t in its own sequence, [B, S] long, counted as position_ids are.

    position_ids if given; else from a 2D attention mask over past + current tokens
    (`mask_positions`); else past_len + arange(S).
    """
    if position_ids is not None:
        pos = position_ids if position_ids.ndim == 2 else position_ids.reshape(1, -1)
        return pos.to(device, torch.long).expand(batch_size, seq_len)
    # A 4D mask (already expanded for attention) does not say where sequences start: use arange.
    if attention_mask is not None and attention_mask.ndim == 2:
        if attention_mask.shape[1] < seq_len:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[1]} tokens but the input has {seq_len}; "
                "pass the mask over past and current tokens"
            )
        return mask_positions(attention_mask.to(device))[:, -seq_len:].expand(batch_size, seq_len)
    return torch.arange(past_len, past_len + seq_len, device=device).expand(batch_size, seq_len)


def _hidden(output: Any) -> Tensor:
    """Decoder layers return the hidden states, or a tuple whose [0] they are."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
        return output[0]
    raise TypeError(f"cannot find hidden states in a surgery module's output of type {type(output).__name__}")


def _replace_hidden(output: Any, hidden: Tensor) -> Any:
    return hidden if isinstance(output, Tensor) else (hidden, *output[1:])


class CorrectionHandle:
    """Live hooks: a pre-hook on the decoder computes every forward's token positions (each generate()
    step with a KV cache included); a forward hook on each surgery module replaces its hidden states
    with corrections[layer](h, positions, task_weights)."""

    def __init__(self, model: nn.Module, corrections: DartsCorrections) -> None:
        self.model = model
        self.corrections = corrections
        # record: keep each surgery layer's output of the last forward in outputs (with grad), which is
        # where the calibration loss reads ĥ; with no task weights set that output is the plain h.
        self.record = False
        self.outputs: dict[str | int, Tensor] = {}
        self.set_task_weights(None)  # [B, K] task weights; None: every hook passes through
        self.positions: Tensor | None = None  # [B, S] of the running forward, set by the pre-hook
        modules = {layer: surgery_module(model, layer) for layer in corrections.layer_keys}
        # On the decoder, not the LM wrapper: it sees the same kwargs, and also runs when called alone.
        self._hooks = [_decoder(model).register_forward_pre_hook(self._read_positions, with_kwargs=True)]
        self._hooks += [m.register_forward_hook(self._correct_hook(layer)) for layer, m in modules.items()]

    def _read_positions(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None:
            inputs = kwargs["inputs_embeds"]
        batch_size, seq_len = inputs.shape[:2]
        # transformers 5 calls the KV cache `cache`; `past_key_values` is its deprecated name.
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past_len = cache.get_seq_length() if cache is not None else 0
        self.positions = token_positions(
            kwargs.get("attention_mask"), kwargs.get("position_ids"), seq_len, past_len, batch_size, inputs.device
        )
        self.outputs = {}

    def _correct_hook(self, layer: str | int):
        correction = self.corrections[layer]

        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            h = _hidden(output)
            if self.task_weights is None:
                if self.record:
                    self.outputs[layer] = h
                return None
            if self.task_weights.shape[0] != h.shape[0]:
                raise ValueError(
                    f"the forward has batch size {h.shape[0]} but task weights were set for "
                    f"{self.task_weights.shape[0]} sequences; call set_tasks/set_task_weights for this batch"
                )
            if self.positions is None or self.positions.shape != h.shape[:2]:
                raise ValueError(
                    f"no token positions for hidden states {list(h.shape[:2])} at layer {layer!r}: "
                    "run the model's forward, not the surgery module alone"
                )
            # Weights kept on the host (the engine's, the exported model's) say which tasks are active without a
            # device sync; weights on a GPU are read there once per layer.
            weights = self.task_weights
            if weights.device.type == "cpu":
                if self._active is None:  # once per forward's weights, not once per layer
                    self._active = active_tasks(weights)
                active = self._active
            else:
                active = None
            corrected = correction(h, self.positions.to(h.device), self._on(h.device), active)
            if self.record:
                self.outputs[layer] = corrected
            return _replace_hidden(output, corrected)

        return hook

    def set_task_weights(self, task_weights: Tensor | None) -> None:
        """[B, K] weights of each sequence's task corrections; None turns the correction off."""
        if task_weights is not None:
            K = self.corrections.spec.num_tasks
            if task_weights.ndim != 2 or task_weights.shape[1] != K:
                raise ValueError(f"task weights must be [batch, {K}], got {list(task_weights.shape)}")
            task_weights = task_weights.float()
        self.task_weights = task_weights
        self._active: list[int] | None = None  # the tasks in use, from host weights
        self._placed: dict[torch.device, Tensor] = {}  # the weights on each device a hook read them on

    def _on(self, device: torch.device) -> Tensor:
        """The task weights on `device`, copied there once for all the layers of the forwards they apply to."""
        if device not in self._placed:
            self._placed[device] = self.task_weights.to(device)
        return self._placed[device]

    def set_tasks(self, task_ids: Sequence[int] | Tensor) -> None:
        """One task index per sequence; −1 = no correction for that sequence."""
        self.set_task_weights(one_hot_tasks(torch.as_tensor(task_ids), self.corrections.spec.num_tasks))

    @contextmanager
    def weighted(self, task_weights: Tensor | None) -> Iterator[None]:
        """set_task_weights(task_weights) inside the block; the previous task weights come back after it."""
        previous = self.task_weights
        self.set_task_weights(task_weights)
        try:
            yield
        finally:
            self.set_task_weights(previous)

    def tasks(self, task_ids: Sequence[int] | Tensor) -> contextlib.AbstractContextManager[None]:
        """set_tasks(task_ids) inside the block; the previous task weights come back after it."""
        return self.weighted(one_hot_tasks(torch.as_tensor(task_ids), self.corrections.spec.num_tasks))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> CorrectionHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def attach_corrections(model: nn.Module, corrections: DartsCorrections) -> CorrectionHandle:
    """Hook `corrections` into `model`; no correction applies until set_tasks / set_task_weights."""
    return CorrectionHandle(model, corrections)


@contextmanager
def capture_hidden(model: nn.Module, layers: Sequence[str | int]) -> Iterator[dict[str | int, Tensor]]:
    """Yield a dict filled, at each forward, with every layer's output hidden states.

    Hooks run in the order they were attached: a correction attached before this sees its output here.
    """
    captured: dict[str | int, Tensor] = {}

    def store(layer: str | int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            captured[layer] = _hidden(output)

        return hook

    keys = [parse_layer(layer) for layer in layers]
    hooks = [surgery_module(model, k).register_forward_hook(store(k)) for k in keys]
    try:
        yield captured
    finally:
        for hook in hooks:
            hook.remove()


class _Skipped(nn.Module):
    """A decoder layer below the first one that must run: it hands on what it gets."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states


class _Given(nn.Module):
    """The last skipped layer: its output is the hidden state computed once before (`hidden`)."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.hidden.shape != hidden_states.shape:
            raise ValueError(f"the given hidden states are {list(self.hidden.shape)}, the forward's "
                             f"{list(hidden_states.shape)}: give them for the same rows and length")
        return self.hidden.to(hidden_states.dtype)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's list of layers."""
    layers = _find(_decoder(model), _LAYER_LISTS, nn.ModuleList)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: looked for {_LAYER_LISTS}")
    return layers


@contextmanager
def run_from(model: nn.Module, start: int, hidden: Tensor | None) -> Iterator[None]:
    """Inside the block a forward runs decoder layers `start`… only: layer start−1 returns `hidden`
    (its output, computed once before, [B, S, d]) and the layers below it return their input at no cost.

    Training whose trainable parts all sit at or above layer `start` (corrections, merge coefficients)
    needs nothing below it recomputed at every step. Decoder layers here return their hidden states as
    a tensor (transformers 5). start = 0 (or hidden None) changes nothing.
    """
    if start == 0 or hidden is None:
        yield
        return
    layers = decoder_layers(model)
    kept = [layers[i] for i in range(start)]
    for i in range(start - 1):
        layers[i] = _Skipped()
    layers[start - 1] = _Given(hidden)
    try:
        yield
    finally:
        for i, layer in enumerate(kept):
            layers[i] = layer


class _Reached(Exception):
    """Raised by the decoder layer whose output `layer_output` wanted: the layers above it need not run."""


@torch.no_grad()
def layer_output(model: nn.Module, index: int, input_ids: Tensor, attention_mask: Tensor,
                 entering: Tensor | None) -> Tensor:
    """Decoder layer `index`'s output for a batch whose states entering it are `entering` (None: the embeddings'),
    [B, S, d]: that layer alone runs (`run_from` skips those below; the forward stops once it has the output)."""
    found: list[Tensor] = []

    def reached(module: nn.Module, args: tuple, output: Any) -> None:
        found.append(_hidden(output))
        raise _Reached

    handle = decoder_layers(model)[index].register_forward_hook(reached)
    try:
        with run_from(model, index, entering):
            model.model(input_ids=input_ids, attention_mask=attention_mask)
    except _Reached:
        pass
    finally:
        handle.remove()
    return found[0]


@contextmanager
def fed_inputs(model: nn.Module, inputs: Mapping[str | int, Tensor]) -> Iterator[None]:
    """Inside the block each surgery module `key` of `inputs` (a decoder layer, or "final": the final norm)
    takes inputs[key] as its input hidden states, whatever the layer below it computed: teacher forcing,
    so that each layer is judged on the input a reference model gave it."""

    def feed(key: str | int):
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            given = inputs[key]
            if args:
                return (given.to(args[0].dtype), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": given.to(kwargs["hidden_states"].dtype)}

        return hook

    hooks = [surgery_module(model, key).register_forward_pre_hook(feed(key), with_kwargs=True) for key in inputs]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def merged_hidden(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[LayerKey]
) -> dict[LayerKey, torch.Tensor]:
    """The merged model's uncorrected hidden states h^m at the given layers."""
    with capture_hidden(model, layers) as hidden:
        model.model(input_ids=input_ids, attention_mask=attention_mask)
    return {k: v.float() for k, v in hidden.items()}
