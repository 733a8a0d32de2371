"""What a calibration returns, whichever executor ran it (this process, `calibrate.in_process`, or the Ray job,
`calibrate.ray.job`), and what both derive from their calibration sets: the entropy weights as the loss weighed the
tokens, and which tasks' rows give the router its features."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from darts_dist.calibrate.features import TaskFeatures
from darts_dist.calibrate.loop import CalibrationResult
from darts_dist.config import CalibrationSection
from darts_dist.core import TokenizedSet, entropy_weights
from darts_dist.sources.references import ResolvedSources


@dataclass
class CalibrationOutcome:
    corrections_path: Path
    result: CalibrationResult
    entropy_weights: dict[str, torch.Tensor]  # each task's w_t on its real calibration tokens
    # The Ray job's run id, stream statistics and where its seconds went; None for the in-process loop.
    job: dict[str, object] | None = None
    # The router's features of each task's calibration prompts ([rows with a prompt, d], at the headline
    # layer), where calibration ran the merged model over rows with a prompt/response boundary anyway.
    prompt_features: dict[str, torch.Tensor] = field(default_factory=dict)
    # Each role's device and dtype, as it ran (sources.models.compute_label), by role: "expert actor (TASK)" and
    # "calibration worker" on Ray, "calibration (in-process)" here.
    compute: dict[str, str] = field(default_factory=dict)


def token_weights(features: TaskFeatures, settings: CalibrationSection) -> torch.Tensor:
    """A task's entropy weights over its whole calibration set, as the loss weighs its tokens."""
    weight_mask = features.response_mask if settings.weight_on_for(features.task) == "response" else None
    weights = entropy_weights(features.entropy, features.attention_mask, settings.beta_for(features.task), weight_mask)
    return weights[features.attention_mask.bool()]


def router_tasks(sets: Mapping[str, TokenizedSet], sources: ResolvedSources) -> list[str]:
    """The tasks whose calibration rows give the router its features (core.row_prompt_features):
    rows with a prompt part, from the data file alone (with captured traffic the set holds fewer file rows than
    the router reads, and the traffic rows have no prompt part to pool)."""
    return [task for task, data in sets.items() if data.has_boundary and sources.data[task].traffic is None]
