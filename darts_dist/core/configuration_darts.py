"""The config of an exported corrected model: the merged model's own config (LlamaConfig, Qwen2Config, …) plus
its DARTS section. Shipped beside the weights by `darts-dist export --format hf`; needs transformers only.

config.json says `"model_type": "darts"`, which transformers does not know, so loading it without
`trust_remote_code=True` fails instead of quietly giving the uncorrected merge; the base architecture's type is
`config.darts["base_model_type"]`, and the config built is that architecture's own class.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

MODEL_TYPE = "darts"


class DartsConfig(PretrainedConfig):
    """Loads as the base architecture's config class, carrying `darts` (corrections, router, routing) and
    `darts_task` (the task applied when a call names none: a task, "merged" or "routed")."""

    model_type = MODEL_TYPE

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> Any:
        config_dict, kwargs = cls.get_config_dict(pretrained_model_name_or_path, **kwargs)
        return cls.from_dict(config_dict, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        darts = config_dict.get("darts")
        if not isinstance(darts, dict) or "base_model_type" not in darts:
            raise ValueError("this config.json has no 'darts' section naming its base_model_type: "
                             "export the model again with `darts-dist export --format hf`")
        base_type = darts["base_model_type"]
        if base_type == "mistral" and "layer_types" in config_dict:  # as AutoConfig reads such a config
            base_type = "ministral"
        if base_type not in CONFIG_MAPPING:
            raise ValueError(f"the base architecture {base_type!r} is unknown to this transformers version: "
                             "install the transformers version the model was exported with, or newer")
        base = {key: value for key, value in config_dict.items() if key != "model_type"}
        return CONFIG_MAPPING[base_type].from_dict(base, **kwargs)
