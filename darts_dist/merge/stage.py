"""The merge stage: the one place that picks the merge by `merge.method` (RegMean, or mergekit for every other
method), reuses an identical earlier merge, and refuses a merge with non-finite weights."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import yaml

from darts_dist.config import RunConfig
from darts_dist.errors import DartsError
from darts_dist.merge.mergekit import build_mergekit_config, load_mergekit_yaml, run_merge
from darts_dist.merge.regmean import regmean_merge
from darts_dist.sources.models import non_finite_tensors
from darts_dist.sources.references import ResolvedSources

logger = logging.getLogger(__name__)


def mergekit_config_for(config: RunConfig, sources: ResolvedSources) -> dict:
    """The mergekit YAML this run merges with: the user's own file as it is, or one built from `merge`."""
    if config.merge.mergekit_yaml is not None:
        return load_mergekit_yaml(config.merge.mergekit_yaml)
    return build_mergekit_config(
        base=sources.base,
        experts=sources.experts,
        method=config.merge.method,
        parameters=config.merge.parameters,
        expert_parameters={e.task: e.merge_parameters for e in config.sources.experts if e.merge_parameters},
        dtype=config.merge.dtype,
    )


def merged_into(config: RunConfig, sources: ResolvedSources, out_dir: Path, overwrite: bool = False) -> Path:
    """Merge into `out_dir` by the config's method: RegMean (`merge.regmean`), or mergekit with the config's
    mergekit YAML or one built from `merge`."""
    if config.merge.from_grams:
        return regmean_merge(config, sources, out_dir=out_dir)[0]
    return run_merge(mergekit_config_for(config, sources), out_dir, overwrite=overwrite, device=config.merge.device)


def merge_stage(config: RunConfig, sources: ResolvedSources) -> Path:
    """The run's merge, into `config.merged_dir`; an identical earlier merge (the same mergekit config or RegMean
    record) is reused, a fresh one checked for NaN and inf weights."""
    if config.merge.from_grams:
        merged, fresh = regmean_merge(config, sources)
        return _finite(merged, sources) if fresh else merged
    written = config.merged_dir / "mergekit_config.yml"
    if written.is_file() and yaml.safe_load(written.read_text()) == mergekit_config_for(config, sources):
        logger.info("merge: reusing %s (same mergekit config)", config.merged_dir)
        return config.merged_dir
    return _finite(merged_into(config, sources, config.merged_dir, overwrite=True), sources)


def _finite(merged: Path, sources: ResolvedSources) -> Path:
    """The merge, unless it has NaN or inf weights (passed through from a source: they would poison every later
    number); then it is removed and the source named."""
    bad = non_finite_tensors(merged)
    if bad:
        shutil.rmtree(merged)
        if not any(merged.parent.iterdir()):  # the run folder this merge started
            merged.parent.rmdir()
        culprits = {role: non_finite_tensors(path, limit=1)
                    for role, path in {"base": sources.base, **sources.experts}.items()}
        named = "; ".join(f"{role}: {found[0]}" for role, found in culprits.items() if found) or "none of them alone"
        raise DartsError(f"the merged model has NaN or infinite weights ({', '.join(bad)}); from the sources: {named}",
                         "replace the source model named above with a finite copy of its weights")
    return merged
