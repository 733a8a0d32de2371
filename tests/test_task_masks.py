"""TALL masks and EMR-merging (core.task_masks) against the papers' rules written out entry by entry."""

from __future__ import annotations

import itertools

import pytest
import torch

from darts_dist.core import TaskVectors
from darts_dist.core.task_masks import emr_deltas, emr_unified, mask_bytes, tall_deltas


@pytest.fixture
def vectors() -> TaskVectors:
    generator = torch.Generator().manual_seed(0)
    base = {"a": torch.randn(3, 4, generator=generator), "b": torch.randn(5, generator=generator)}
    deltas = {name: torch.randn(3, *value.shape, generator=generator) for name, value in base.items()}
    deltas["b"][1] = 0.0  # an expert that left a tensor alone
    return TaskVectors(("code", "math", "chat"), base, deltas, num_layers=1)


def entries(tensor: torch.Tensor):
    return itertools.product(*(range(n) for n in tensor.shape))


def test_tall_keeps_the_merges_entries_where_the_tasks_own_vector_dominates(vectors: TaskVectors) -> None:
    merged = {name: vectors.base[name] + 0.5 * vectors.deltas[name].sum(0) for name in vectors.base}
    for task, lam in [(0, 0.4), (1, 0.4), (2, 1.0)]:
        got = tall_deltas(vectors, merged, task, lam)
        for name, base in vectors.base.items():
            merge = merged[name] - base
            for index in entries(base):
                own, whole = float(vectors.deltas[name][task][index]), float(merge[index])
                want = whole if abs(own) >= lam * abs(whole - own) else 0.0
                assert float(got[name][index]) == pytest.approx(want, abs=1e-6), (task, name, index)
    # λ = 0 keeps every entry: each task's model is the merge.
    assert all(torch.equal(d, merged[n] - vectors.base[n]) for n, d in tall_deltas(vectors, merged, 0, 0.0).items())


def test_emr_elects_a_sign_keeps_the_largest_agreeing_magnitude_and_rescales_each_task(vectors: TaskVectors) -> None:
    unified = emr_unified(vectors)
    for name, stacked in vectors.deltas.items():
        for index in entries(vectors.base[name]):
            values = [float(stacked[t][index]) for t in range(3)]
            sign = (sum(values) > 0) - (sum(values) < 0)
            want = sign * max([abs(v) for v in values if v * sign > 0], default=0.0)
            assert float(unified[name][index]) == pytest.approx(want, abs=1e-6)
    for task in range(3):
        got = emr_deltas(vectors, unified, task)
        own = sum(float(d[task].abs().sum()) for d in vectors.deltas.values())
        masked = {n: torch.where(vectors.deltas[n][task] * unified[n] > 0, unified[n], 0.0) for n in unified}
        scale = own / sum(float(m.abs().sum()) for m in masked.values())
        for name in unified:
            torch.testing.assert_close(got[name], scale * masked[name])
        # The rescaler gives the task's model as much change as its expert had.
        assert sum(float(d.abs().sum()) for d in got.values()) == pytest.approx(own, rel=1e-5)
    # Where a task left a tensor alone, its mask keeps nothing of it.
    assert not emr_deltas(vectors, unified, 1)["b"].any()


def test_a_task_adds_a_bit_per_changed_parameter(vectors: TaskVectors) -> None:
    assert mask_bytes(vectors) == 3  # 12 + 5 parameters: 17 bits
    assert mask_bytes(vectors, numbers=1) == 7
