"""A config's layer sets made concrete for its model, once, before any work: "all", "every:N", "changed".

Everything downstream (the stream, the workers, the corrections file, evaluation, serving) sees only
decoder layer indices and "final".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

from darts_dist.calibrate.coefficients import changed_layers
from darts_dist.config import RunConfig, updated
from darts_dist.core import LayerKey, parse_layer
from darts_dist.errors import DartsError
from darts_dist.sources.models import read_model_info
from darts_dist.sources.references import ResolvedSources

LAYER_SETS = ("all", "changed")  # and "every:N"


def is_layer_set(layer: object) -> bool:
    return isinstance(layer, str) and (layer in LAYER_SETS or layer.startswith("every:"))


def concrete_layers(layers: Sequence[object], num_layers: int, changed: Callable[[], Sequence[int]]) -> list[LayerKey]:
    """Decoder layer indices and "final" for `layers`: a list without sets is kept as it is (checked); with a
    set, the union in order, decoder layers from the bottom up and "final" last. `changed()` gives the
    decoder layers some expert changed."""
    keys: list[LayerKey] = []
    for layer in layers:
        if layer == "all":
            keys += range(num_layers)
        elif layer == "changed":
            keys += changed()
        elif isinstance(layer, str) and layer.startswith("every:"):
            step = int(layer.removeprefix("every:"))
            keys += range(step - 1, num_layers, step)
        else:
            keys.append(parse_layer(layer))
    out_of_range = [k for k in keys if isinstance(k, int) and k >= num_layers]
    if out_of_range:
        raise DartsError(f"surgery layers {out_of_range} are out of range: the model has decoder layers "
                         f"0..{num_layers - 1}", "use layer indices below the model's num_hidden_layers, or 'final'")
    if not any(map(is_layer_set, layers)):
        return keys
    if not keys:
        raise DartsError(f"the layer sets {list(layers)} name no layer of this model (no expert changed a decoder "
                         "layer?)", "add final, or name the layers")
    ints = sorted({k for k in keys if isinstance(k, int)})
    return [*ints, *(["final"] if "final" in keys else [])]


def with_concrete_layers(config: RunConfig, sources: ResolvedSources) -> RunConfig:
    """The config with calibration.layers (and, where the method fits them, calibration.coefficients.layers) as
    indices for the base's shape."""
    settings = config.calibration
    num_layers = read_model_info(sources.base).num_layers

    @cache
    def changed() -> tuple[int, ...]:
        return tuple(changed_layers(sources.base, sources.experts))

    layers = concrete_layers(settings.layers, num_layers, changed)
    # The coefficients' layers only where they are fitted: "changed" reads every expert's weights.
    aligned = settings.coefficients.layers
    if settings.method != "darts":
        aligned = concrete_layers(aligned, num_layers, changed)
    if layers == settings.layers and aligned == settings.coefficients.layers:
        return config
    coefficients = updated(settings.coefficients, layers=aligned)
    return updated(config, calibration=updated(settings, layers=layers, coefficients=coefficients))
