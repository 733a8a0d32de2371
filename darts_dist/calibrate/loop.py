"""The DARTS training loop: the calibration loss of a minibatch, the step schedule, and the in-process reference.

`calibration_loss`, `build_corrections` and `step_minibatches` are what the Ray workers reuse;
`calibrate_in_process` is the single-process reference that the distributed path is tested against.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from darts_dist.calibrate.features import TaskFeatures, with_start_hidden
from darts_dist.config import CalibrationSection
from darts_dist.core import (
    CorrectionSpec,
    DartsCorrections,
    attach_corrections,
    entropy_weights,
    features_only,
    first_decoder_layer,
    one_hot_tasks,
    run_from,
    top_k_kl,
    weighted_l1_loss,
)
from darts_dist.logs import progress_bar


class StepCallback(Protocol):
    """Hears each optimizer step: its number (from 1) and metrics (loss, rows/s); `flush` hands on what it
    holds (tracking.runs.StepLogger sends them to MLflow in batches). It must pickle: Ray workers call it."""

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def flush(self) -> object: ...


def build_corrections(tasks: Sequence[str], hidden_size: int, settings: CalibrationSection) -> DartsCorrections:
    """Fresh corrections (identity at step 0) for every task and surgery layer."""
    spec = CorrectionSpec(
        tasks=tuple(tasks),
        hidden_size=hidden_size,
        rank=settings.rank,
        max_positions=settings.max_positions,
        position_bias=settings.position_bias,
        position_rank=settings.position_rank,
    )
    return DartsCorrections(spec, settings.layers)


def calibration_loss(
    corrections: DartsCorrections,
    rows: Mapping[str, object],
    task_index: int,
    beta: float,
    weight_on: str,
    merged_model: PreTrainedModel | None = None,
    handle=None,
    logit_weight: float = 0.0,
    head: torch.nn.Module | None = None,
) -> torch.Tensor:
    """The entropy-weighted L1 loss of one task's minibatch, summed over the layers it has targets at
    (`CalibrationSection.loss_layers`: every surgery layer, or the last one); with `logit_weight`, plus that times
    the w_t-weighted KL(expert ‖ corrected) of the next-token distributions (`top_k_kl`), the corrected one from
    `head` (the merged model's LM head) on the corrected final state.

    In feature mode the final correction is applied to the stored h^m; otherwise the merged
    model runs with the corrections hooked in (`handle`, record=True) so gradients flow
    through the frozen layers between surgery layers, from the lowest corrected layer on when the
    rows carry the hidden states entering it (`start_hidden`).
    """
    mask = rows["attention_mask"]
    weight_mask = rows["response_mask"] if weight_on == "response" else None
    weights = entropy_weights(rows["entropy"], mask, beta, weight_mask)
    task_weights = one_hot_tasks(torch.full((mask.shape[0],), task_index, dtype=torch.long), len(corrections.spec.tasks))
    targets = rows["targets"]
    if merged_model is None:
        corrected = {
            k: corrections[k](rows["merged"][k], rows["positions"], task_weights) for k in corrections.layer_keys
        }
    else:
        device = next(merged_model.parameters()).device
        handle.set_task_weights(task_weights.to(device))
        start_hidden = rows.get("start_hidden")
        start = first_decoder_layer(corrections.layer_keys)
        with run_from(merged_model, start, None if start_hidden is None else start_hidden.to(device)):
            merged_model.model(input_ids=rows["input_ids"].to(device), attention_mask=mask.to(device))
        corrected = {k: handle.outputs[k] for k in targets}
    loss = torch.zeros((), device=weights.device)
    for k in targets:
        target = targets[k].to(corrected[k].device)
        loss = loss + weighted_l1_loss(corrected[k].float(), target, mask.to(target.device), weights.to(target.device))
    if logit_weight:
        at = [corrected["final"], rows["top_log_p"], rows["top_ids"], mask, weights]
        if rows.get("logit_picks") is not None:  # the KL at the step's sample of each row's tokens only
            at = [at_positions(values, rows["logit_picks"]) for values in at]
        final, top_log_p, top_ids, kl_mask, kl_weights = at
        # The head computes in its own dtype, as the served model's does; the KL upcasts its logits.
        logits = head(final.to(next(head.parameters()).dtype))
        device = logits.device
        loss = loss + logit_weight * top_k_kl(logits, top_log_p.to(device), top_ids.to(device), kl_mask.to(device),
                                              kl_weights.to(device))
    return loss


def at_positions(values: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """`values` ([B, S, ...]) at each row's positions `picks` ([B, P]): [B, P, ...]."""
    index = picks.to(values.device).long()
    index = index.view(*index.shape, *[1] * (values.dim() - 2)).expand(*index.shape, *values.shape[2:])
    return values.gather(1, index)


def step_minibatches(
    features: Sequence[TaskFeatures], batch_size: int, generator: torch.Generator, logit_positions: int | None = None
) -> list[tuple[TaskFeatures, torch.Tensor, torch.Tensor | None]]:
    """One step's sample: a random minibatch of every task, drawn in task order from `generator`, and with
    `logit_positions` (`CalibrationSection.logit_samples`) that many of each of its rows' real tokens
    ([rows, logit_positions], uniform with replacement) for the logit term, else None.

    Shared by the in-process and the distributed loops, so that one seed gives both the same schedule.
    """
    draws = []
    for task in features:
        index = torch.randperm(len(task), generator=generator)[:batch_size]
        picks = None
        if logit_positions:
            lengths = task.attention_mask[index].sum(dim=1, keepdim=True)  # rows are padded on the right
            picks = (torch.rand((len(index), logit_positions), generator=generator) * lengths).long()
        draws.append((task, index, picks))
    return draws


@dataclass
class CalibrationResult:
    """Trained corrections plus the loss curve of the run."""

    corrections: DartsCorrections
    losses: list[float]
    seconds: float


def calibrate_in_process(
    features: Sequence[TaskFeatures],
    corrections: DartsCorrections,
    settings: CalibrationSection,
    merged_model: PreTrainedModel | None = None,
    progress: bool = True,
    on_step: StepCallback | None = None,
    head: torch.nn.Module | None = None,
) -> CalibrationResult:
    """The reference loop: each Adam step takes one random minibatch of every task.

    Tasks share a step so that a shared position bias sees all of them; with per-task
    corrections the sum is the same as training each task alone. `on_step(step, metrics)`
    receives each step's number (from 1), loss and rows per second, e.g. for MLflow.
    """
    if not features_only(corrections.layer_keys) and merged_model is None:
        raise ValueError("surgery at decoder layers trains through the merged model: pass merged_model")
    if settings.logit_weight and head is None:
        raise ValueError("the logit term needs the merged model's LM head: pass head")
    generator = torch.Generator().manual_seed(settings.seed)
    device = next(corrections.parameters()).device  # where the minibatches go: the corrections' device
    optimizer = torch.optim.Adam(corrections.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    handle = None
    if merged_model is not None and not features_only(corrections.layer_keys):
        handle = attach_corrections(merged_model, corrections)
        handle.record = True
    losses: list[float] = []
    start = time.perf_counter()
    bar = progress_bar(range(settings.steps), desc="calibrate", unit="step", disable=not progress)
    rows_per_step = sum(min(settings.batch_size, len(task)) for task in features)
    try:
        for step in bar:
            step_start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for task, index, picks in step_minibatches(features, settings.batch_size, generator,
                                                       settings.logit_samples()):
                loss = calibration_loss(
                    corrections,
                    task.rows(index, device, picks),
                    task.task_index,
                    settings.beta_for(task.task),
                    settings.weight_on_for(task.task),
                    merged_model=None if handle is None else merged_model,
                    handle=handle,
                    logit_weight=settings.logit_weight,
                    head=head,
                )
                loss.backward()
                total = total + loss.detach().cpu()
            optimizer.step()
            losses.append(float(total) / len(features))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if on_step is not None:
                rate = rows_per_step / max(time.perf_counter() - step_start, 1e-9)
                on_step(step + 1, {"loss": losses[-1], "rows_per_second": rate})
    finally:
        if handle is not None:
            handle.remove()
    return CalibrationResult(corrections=corrections, losses=losses, seconds=time.perf_counter() - start)


def train_corrections(
    features: Sequence[TaskFeatures],
    settings: CalibrationSection,
    merged_model: PreTrainedModel,
    progress: bool = True,
    on_step: StepCallback | None = None,
) -> CalibrationResult:
    """Fresh corrections for the features' tasks (initialised from `settings.seed`), trained by the reference loop."""
    torch.manual_seed(settings.seed)
    tasks = [task.task for task in features]
    corrections = build_corrections(tasks, merged_model.config.hidden_size, settings)
    corrections = corrections.to(next(merged_model.parameters()).device)
    if not features_only(settings.layers):
        start = first_decoder_layer(corrections.layer_keys)
        features = [with_start_hidden(task, merged_model, start, settings.batch_size) for task in features]
    return calibrate_in_process(
        features, corrections, settings, merged_model=None if features_only(settings.layers) else merged_model,
        progress=progress, on_step=on_step, head=merged_model.get_output_embeddings(),
    )
