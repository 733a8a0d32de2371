"""A model's size from its config.json alone: parameters counted on the meta device (no weight is read or
allocated), and the KV cache a token takes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from darts_dist.errors import DartsError
from darts_dist.sources.models import BUNDLED_MODEL, read_config

BUNDLED_CONFIG = Path(__file__).absolute().parent.parent / "sources" / "bundled_config.json"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int
    kv_values_per_token: int  # keys and values of every layer: 2 · layers · KV heads · head size
    saved_dtype: str = "float32"  # of its weight files (config.json's dtype; fp32 where it names none)
    # A PEFT adapter: merged into its base once, on the driver, and saved in fp32 (sources.models.materialize_adapter).
    adapter: bool = False

    def weight_bytes(self, dtype: str) -> int:
        return self.parameters * ITEMSIZE[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        return self.kv_values_per_token * ITEMSIZE[dtype]


def shape_of(config: PretrainedConfig) -> ModelShape:
    """Parameters of the causal LM `config` describes (tied weights once), counted on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    saved = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)).removeprefix("torch.")
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()),
        hidden_size=text.hidden_size, num_layers=text.num_hidden_layers, vocab_size=text.vocab_size,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        kv_values_per_token=2 * text.num_hidden_layers * kv_heads * head_dim,
        saved_dtype=saved if saved in ITEMSIZE else "float32")


def _folder_config(folder: Path) -> PretrainedConfig:
    adapter = folder / "adapter_config.json"
    if adapter.is_file():  # a PEFT adapter has its base's shape
        base = json.loads(adapter.read_text()).get("base_model_name_or_path", "")
        return model_config(base if base == BUNDLED_MODEL or Path(base).is_absolute() else str(folder / base))
    if not (folder / "config.json").is_file():
        raise DartsError(f"{folder} has no config.json: the plan reads each model's shape from it",
                         "point the config at a Hugging Face model folder (config.json beside the weights)")
    return read_config(folder)


def is_adapter(reference: str) -> bool:
    """Whether a model source is a PEFT adapter on a base (the demo's experts are)."""
    scheme = reference.partition(":")[0]
    return scheme == "demo" or (scheme not in ("tiny", "thin") and (Path(reference) / "adapter_config.json").is_file())


def model_shape(reference: str) -> ModelShape:
    """The shape of a model source, from its config.json alone."""
    shape = shape_of(model_config(reference))
    return dataclasses.replace(shape, adapter=True, saved_dtype="float32") if is_adapter(reference) else shape


def model_config(reference: str) -> PretrainedConfig:
    """The config of a model source (a folder, an adapter, bundled:, demo:, tiny:, thin:) without its weights."""
    from darts_dist.sources.references import resolve_model  # tiny: and thin: write their family on first use

    scheme = reference.partition(":")[0]
    if reference == BUNDLED_MODEL or scheme == "demo":  # the demo experts are adapters on the bundled model
        return AutoConfig.from_pretrained(BUNDLED_CONFIG)
    path = resolve_model(reference) if scheme in ("tiny", "thin") else Path(reference)
    if not path.is_dir():
        raise DartsError(f"model {reference} is not a folder", "give a local Hugging Face model folder or adapter")
    return _folder_config(path)
