"""The in-process calibration: features, the loss in both modes, and the training loop."""

from __future__ import annotations

import pytest
import torch

from darts_dist.calibrate.features import collect_features
from darts_dist.calibrate.loop import build_corrections, calibrate_in_process, calibration_loss
from darts_dist.config import CalibrationSection
from darts_dist.core import attach_corrections, capture_hidden, entropy_weights, features_only, next_token_entropy
from darts_dist.sources.data import tokenize_rows
from darts_dist.sources.models import load_causal_lm
from darts_dist.sources.references import demo_data

TASKS = ("code", "math")


@pytest.fixture(scope="module")
def models(tiny_family):
    merged = load_causal_lm(tiny_family.base)  # the base stands in for a merge: any frozen model works here
    experts = {task: load_causal_lm(tiny_family.experts[task]) for task in TASKS}
    return merged, experts


@pytest.fixture(scope="module")
def calibration_sets():
    from darts_dist.sources.data import load_rows
    from darts_dist.sources.demo.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    files = demo_data()
    return {
        task: tokenize_rows(load_rows(files[task]["calibration"]), tokenizer, task, max_length=24, max_samples=12)
        for task in TASKS
    }


def _features(models, calibration_sets, layers):
    merged, experts = models
    return [
        collect_features(task, i, calibration_sets[task], experts[task], merged if features_only(layers) else None,
                         layers, batch_size=5, progress=False)
        for i, task in enumerate(TASKS)
    ]


def test_features_are_the_experts_states_and_entropy(models, calibration_sets) -> None:
    merged, experts = models
    [code, _] = _features(models, calibration_sets, ["final"])
    data = calibration_sets["code"]
    with torch.no_grad(), capture_hidden(experts["code"], ["final"]) as hidden:
        logits = experts["code"](input_ids=data.input_ids, attention_mask=data.attention_mask).logits
    real = data.attention_mask.bool()
    # Batched in fives and re-padded: equal on every real token to one full-batch forward.
    torch.testing.assert_close(code.targets["final"][real], hidden["final"][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(code.entropy[real], next_token_entropy(logits)[real], atol=1e-5, rtol=1e-5)
    with torch.no_grad(), capture_hidden(merged, ["final"]) as hidden:
        merged(input_ids=data.input_ids, attention_mask=data.attention_mask)
    torch.testing.assert_close(code.merged["final"][real], hidden["final"][real], atol=1e-5, rtol=1e-5)
    assert code.positions[0, :5].tolist() == [0, 1, 2, 3, 4]


def test_feature_mode_loss_equals_the_hooked_model_loss(models, calibration_sets) -> None:
    """Training on stored h^m must optimise exactly what running the merged model would."""
    merged, _ = models
    [_, math] = _features(models, calibration_sets, ["final"])
    settings = CalibrationSection(rank=4, max_positions=16)
    torch.manual_seed(0)
    corrections = build_corrections(TASKS, merged.config.hidden_size, settings)
    with torch.no_grad():
        for p in corrections.parameters():
            p.add_(0.05 * torch.randn_like(p))  # away from the identity, so the correction matters
    rows = math.rows(torch.arange(6))
    from_features = calibration_loss(corrections, rows, 1, beta=0.7, weight_on="all")
    with attach_corrections(merged, corrections) as handle:
        handle.record = True
        through_model = calibration_loss(corrections, rows, 1, 0.7, "all", merged_model=merged, handle=handle)
    torch.testing.assert_close(from_features, through_model, atol=1e-6, rtol=1e-5)
    # And it is the design's formula: entropy-weighted L1 against the expert.
    mask = rows["attention_mask"]
    weights = entropy_weights(rows["entropy"], mask, 0.7)
    corrected = corrections["final"](rows["merged"]["final"], rows["positions"], torch.tensor([[0.0, 1.0]] * 6))
    by_hand = ((corrected - rows["targets"]["final"]).abs().sum(-1) * weights * mask).sum() / (
        merged.config.hidden_size * (weights * mask).sum()
    )
    torch.testing.assert_close(from_features, by_hand, atol=1e-6, rtol=1e-5)


def test_loop_lowers_the_loss_and_is_deterministic(models, calibration_sets) -> None:
    merged, _ = models
    features = _features(models, calibration_sets, ["final"])
    settings = CalibrationSection(rank=4, max_positions=16, steps=40, batch_size=4, learning_rate=1e-2, seed=3)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        corrections = build_corrections(TASKS, merged.config.hidden_size, settings)
        runs.append(calibrate_in_process(features, corrections, settings, progress=False))
    first, second = runs
    assert first.losses == second.losses
    for a, b in zip(first.corrections.parameters(), second.corrections.parameters()):
        assert torch.equal(a, b)
    assert sum(first.losses[-5:]) / 5 < 0.8 * first.losses[0]


def test_multi_layer_surgery_trains_through_the_merged_model(models, calibration_sets) -> None:
    merged, _ = models
    layers = [1, "final"]
    features = _features(models, calibration_sets, layers)
    assert features[0].merged == {}  # nothing stored: the merged model runs each step
    # A smaller step than feature mode: a moved layer-1 correction shifts everything above it.
    settings = CalibrationSection(layers=layers, rank=4, max_positions=16, steps=15, batch_size=4, learning_rate=1e-3)
    torch.manual_seed(0)
    corrections = build_corrections(TASKS, merged.config.hidden_size, settings)
    result = calibrate_in_process(features, corrections, settings, merged_model=merged, progress=False)
    assert result.losses[-1] < result.losses[0]
    assert all(p.grad is None for p in merged.parameters())
    with pytest.raises(ValueError, match="merged_model"):
        calibrate_in_process(features, corrections, settings, progress=False)
