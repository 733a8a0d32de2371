"""The calibrate stage in this one process: each expert's targets collected once, then the reference loop.

It and the Ray job (`calibrate.ray.job`) return the same `CalibrationOutcome` (`calibrate.outcome`), so the
pipeline treats them alike.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

from darts_dist.calibrate.features import collect_features
from darts_dist.calibrate.loop import StepCallback, train_corrections
from darts_dist.calibrate.outcome import CalibrationOutcome, router_tasks, token_weights
from darts_dist.config import CORRECTIONS_FILE, RunConfig
from darts_dist.core import features_only, row_prompt_features
from darts_dist.sources.corrections import save_corrections_for
from darts_dist.sources.data import calibration_sets
from darts_dist.sources.models import (
    load_causal_lm,
    load_tokenizer,
    model_compute,
    model_dtype,
    resolve_device,
    why_this_device,
)
from darts_dist.sources.references import ResolvedSources

logger = logging.getLogger(__name__)


def calibrate_stage(
    config: RunConfig, sources: ResolvedSources, merged_dir: Path, on_step: StepCallback | None = None
) -> CalibrationOutcome:
    """Collect each expert's targets once, train the corrections in this process, save them in the run folder."""
    settings = config.calibration
    device = resolve_device(settings.device)
    dtype = model_dtype(settings.dtype, device)
    logger.info("calibrate: in this process, on %s in %s", why_this_device(settings.device, device),
                str(dtype).removeprefix("torch."))
    merged = load_causal_lm(merged_dir, dtype=dtype, device=device)
    features, prompt_features = [], {}
    sets = calibration_sets(config, sources.data, load_tokenizer(sources.base))
    pooled_tasks = router_tasks(sets, sources)
    for index, (task, data) in enumerate(sets.items()):
        # Experts are loaded one at a time and let go before the next: peak memory is the merged model plus one.
        expert = load_causal_lm(sources.experts[task], dtype=dtype, device=device)
        merged_for_features = merged if features_only(settings.layers) else None
        features.append(
            collect_features(task, index, data, expert, merged_for_features, settings.loss_layers(), settings.batch_size,
                             top_k=settings.logit_targets())
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
        prompt_features=prompt_features, compute={"calibration (in-process)": model_compute(merged)},
    )
