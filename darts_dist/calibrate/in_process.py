"""The calibrate stage in this one process: each expert's targets collected once, then the reference loop.

It and the Ray job (`calibrate.ray.job`) return the same `CalibrationOutcome`, so the pipeline
treats them alike.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from darts_dist.calibrate.corrections import save_corrections_for
from darts_dist.calibrate.features import TaskFeatures, collect_features, features_only, row_prompt_features
from darts_dist.calibrate.loop import CalibrationResult, StepCallback, train_corrections
from darts_dist.config import CORRECTIONS_FILE, CalibrationSection, RunConfig
from darts_dist.core import TokenizedSet, entropy_weights
from darts_dist.sources.data import tokenized
from darts_dist.sources.models import load_causal_lm, load_tokenizer, model_dtype, resolve_device
from darts_dist.sources.references import ResolvedSources

logger = logging.getLogger(__name__)


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


def token_weights(features: TaskFeatures, settings: CalibrationSection) -> torch.Tensor:
    """A task's entropy weights over its whole calibration set, as the loss weighs its tokens."""
    weight_mask = features.response_mask if settings.weight_on_for(features.task) == "response" else None
    weights = entropy_weights(features.entropy, features.attention_mask, settings.beta_for(features.task), weight_mask)
    return weights[features.attention_mask.bool()]


def calibration_sets(config: RunConfig, sources: ResolvedSources, tokenizer) -> dict[str, TokenizedSet]:
    """Every task's calibration set, tokenised; samples cut to `max_length` are said, once per task."""
    sets = {task: tokenized(sources.data[task], task, "calibration", config.calibration, tokenizer)
            for task in config.tasks}
    for task, rows in sets.items():
        if rows.num_truncated:
            logger.info("calibrate: %d %s samples cut to max_length=%d", rows.num_truncated, task,
                        config.calibration.max_length)
    return sets


def router_tasks(sets: Mapping[str, TokenizedSet], sources: ResolvedSources) -> list[str]:
    """The tasks whose calibration rows give the router its features (calibrate.features.row_prompt_features):
    rows with a prompt part, from the data file alone (with captured traffic the set holds fewer file rows than
    the router reads, and the traffic rows have no prompt part to pool)."""
    return [task for task, data in sets.items() if data.has_boundary and sources.data[task].traffic is None]


def calibrate_stage(
    config: RunConfig, sources: ResolvedSources, merged_dir: Path, on_step: StepCallback | None = None
) -> CalibrationOutcome:
    """Collect each expert's targets once, train the corrections in this process, save them in the run folder."""
    settings = config.calibration
    device = resolve_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    merged = load_causal_lm(merged_dir, dtype=dtype, device=device)
    features, prompt_features = [], {}
    sets = calibration_sets(config, sources, load_tokenizer(sources.base))
    pooled_tasks = router_tasks(sets, sources)
    for index, (task, data) in enumerate(sets.items()):
        # Experts are loaded one at a time and let go before the next: peak memory is the merged model plus one.
        expert = load_causal_lm(sources.experts[task], dtype=dtype, device=device)
        merged_for_features = merged if features_only(settings.layers) else None
        features.append(
            collect_features(task, index, data, expert, merged_for_features, settings.loss_layers(), settings.batch_size)
        )
        del expert
        gc.collect()
        if task in pooled_tasks and settings.headline_layer() in features[-1].merged:
            prompt_features[task], _ = row_prompt_features(features[-1].merged[settings.headline_layer()],
                                                           data.attention_mask, data.response_mask)
    result = train_corrections(features, settings, merged, on_step=on_step)
    path = save_corrections_for(config.run_dir / CORRECTIONS_FILE, result.corrections, merged_dir)
    return CalibrationOutcome(
        corrections_path=path, result=result, entropy_weights={f.task: token_weights(f, settings) for f in features},
        prompt_features=prompt_features,
    )
