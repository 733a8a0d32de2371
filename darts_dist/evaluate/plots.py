"""PNG plots of what people would rather see than read: bias by position, loss curves, entropy weights."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: runs on cluster nodes and CI without a display
import matplotlib.pyplot as plt  # noqa: E402

from darts_dist.fsutil import atomic_file  # noqa: E402


def _save(fig: plt.Figure, path: Path) -> Path:
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Path(path).absolute()


def plot_bias_by_position(tasks: Mapping[str, Mapping[str, object]], path: Path) -> Path:
    """One panel per task: mean |h^m_t − h^k_t| per position bucket, merged vs. corrected."""
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    for ax, (task, result) in zip(axes[0], tasks.items()):
        for key, label, style in (("bias_before_by_position", "merged", "o-"), ("bias_after_by_position", "corrected", "s-")):
            series = result.get(key)
            if series:
                ax.plot(list(series), list(series.values()), style, label=label)
        ax.set_title(task)
        ax.set_xlabel("position bucket")
        if ax is axes[0][0]:  # one shared label; repeated ones collide between panels
            ax.set_ylabel("mean |h_merged − h_expert|")
        ax.tick_params(axis="x", rotation=45)
        ax.legend()
    return _save(fig, path)


def plot_loss(losses: Sequence[float], path: Path) -> Path:
    """The calibration loss per step."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("entropy-weighted L1 loss")
    ax.set_yscale("log")
    return _save(fig, path)


def plot_entropy_weights(weights: Mapping[str, Sequence[float]], path: Path) -> Path:
    """Histogram of each task's entropy weights w_t over its calibration tokens (1 everywhere when β = 0)."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for task, values in weights.items():
        ax.hist(list(values), bins=40, histtype="step", label=task)
    ax.set_xlabel("entropy weight w_t")
    ax.set_ylabel("tokens")
    ax.legend()
    return _save(fig, path)


def plot_ablation_bias(methods: Mapping[str, Mapping[str, Mapping[str, object]]], path: Path) -> Path:
    """A grid, merge methods × tasks: each variant's held-out bias per position bucket after its correction.

    `methods[method][variant]` is a variant's evaluation ({"tasks": {task: result}}); the uncorrected
    merged model's bias is the `merged` variant's line.
    """
    tasks = list(next(iter(next(iter(methods.values())).values()))["tasks"])
    fig, axes = plt.subplots(len(methods), len(tasks), figsize=(4.2 * len(tasks), 3.4 * len(methods)), squeeze=False)
    for row, (method, variants) in zip(axes, methods.items()):
        for ax, task in zip(row, tasks):
            for name, variant in variants.items():
                series = variant["tasks"][task].get("bias_after_by_position") or {}
                ax.plot(list(series), list(series.values()), "o-", markersize=3, label=name)
            ax.set_title(f"{method}: {task}")
            ax.set_xlabel("position bucket")
            ax.tick_params(axis="x", rotation=45)
        row[0].set_ylabel("mean |h_variant − h_expert|")
    axes[0][0].legend()
    return _save(fig, path)


def plot_frontier(points: Sequence[Mapping[str, object]], path: Path) -> Path:
    """Score against what serving it adds per task (log scale, 0 bytes at the left edge) and, beside it, the
    retention of what a request without a task gets: one point per merge and variant, with its sd over seeds.
    `points`: `ablation.frontier`'s rows."""
    fig, (score_ax, retention_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    floor = min([p["bytes_per_task"] for p in points if p["bytes_per_task"]] or [1]) / 4
    for point in points:
        x = point["bytes_per_task"] or floor
        label = f"{point['merge']}/{point['variant']}"
        if point["score"] is not None:
            score_ax.errorbar(x, 100 * point["score"], yerr=100 * (point["score_sd"] or 0), fmt="o", capsize=3)
            score_ax.annotate(label, (x, 100 * point["score"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if point["retention_nll"] is not None:
            retention_ax.plot(100 * point["score"] if point["score"] is not None else 0, point["retention_nll"], "o")
            retention_ax.annotate(label, (100 * point["score"] if point["score"] is not None else 0,
                                          point["retention_nll"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    score_ax.set_xscale("log")
    score_ax.set_xlabel("extra bytes per task served (0 drawn at the left edge)")
    score_ax.set_ylabel("held-out score, mean over tasks (%)")
    score_ax.set_title("score against what a task costs to serve")
    retention_ax.set_xlabel("held-out score (%)")
    retention_ax.set_ylabel("retention: NLL of the base's replies (lower keeps more)")
    retention_ax.set_title("score against retention (a request without a task)")
    return _save(fig, path)


def plot_task_scores(tasks: Mapping[str, Mapping[str, object]], path: Path) -> Path | None:
    """Grouped bars per scored task: base, expert, merged, corrected and routed scores with their 95% intervals;
    None when no task has a score."""
    scored = {task: result for task, result in tasks.items() if "score_name" in result}
    if not scored:
        return None
    models = [m for m in ("base", "expert", "merged", "corrected", "routed")
              if any(r.get(f"score_{m}") is not None for r in scored.values())]
    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(1.2 + 1.6 * len(scored), 3.6))
    for offset, model in enumerate(models):
        xs, heights, errors = [], [], [[], []]
        for x, result in enumerate(scored.values()):
            score, interval = result.get(f"score_{model}"), result.get(f"score_{model}_ci")
            if score is None:
                continue
            xs.append(x + (offset - (len(models) - 1) / 2) * width)
            heights.append(100 * score)
            errors[0].append(100 * (score - interval[0]))
            errors[1].append(100 * (interval[1] - score))
        ax.bar(xs, heights, width, yerr=errors, capsize=2, label=model)
    ax.set_xticks(range(len(scored)), [f"{task}\n(n={r['score_n']})" for task, r in scored.items()])
    ax.set_ylabel("task score, % (95% CI)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize="small", ncols=len(models), loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return _save(fig, path)


def plot_coefficients(table: Mapping[str, Mapping[str, float]], path: Path) -> Path:
    """The learned merge coefficients: one line per expert over the layer groups (decoder layers, then "other")."""
    groups = list(table)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for expert in next(iter(table.values())):
        ax.plot(range(len(groups)), [table[g][expert] for g in groups], marker="o", markersize=3, label=expert)
    ax.set_xticks(range(len(groups)), groups, fontsize=6, rotation=90)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("task-arithmetic coefficient")
    ax.legend()
    return _save(fig, path)
