"""The forward passes that make calibration features: expert targets h^k with entropy H, and merged h^m.

They live below `calibrate` and `stream` so that the in-process loop and the Ray expert actors
pick their device and dtype, and compute targets, with the very same functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from darts_dist.core import capture_hidden, next_token_entropy

LayerKey = str | int


def resolve_device(device: str) -> torch.device:
    """`auto` picks CUDA where present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def model_dtype(name: str, device: torch.device) -> torch.dtype:
    """Half precision only where the device computes it well; the CPU path stays fp32."""
    dtype = getattr(torch, name)
    return torch.float32 if device.type == "cpu" else dtype


@torch.no_grad()
def expert_targets(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[LayerKey]
) -> tuple[dict[LayerKey, torch.Tensor], torch.Tensor]:
    """Expert k's hidden states at each surgery layer and its next-token entropy H_t (fp32)."""
    with capture_hidden(model, layers) as hidden:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return {k: v.float() for k, v in hidden.items()}, next_token_entropy(logits)


@torch.no_grad()
def merged_hidden(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[LayerKey]
) -> dict[LayerKey, torch.Tensor]:
    """The merged model's uncorrected hidden states h^m at the given layers."""
    with capture_hidden(model, layers) as hidden:
        model.model(input_ids=input_ids, attention_mask=attention_mask)
    return {k: v.float() for k, v in hidden.items()}
