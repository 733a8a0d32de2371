"""darts_dist.memory: a role's peak memory above what its process held when it began, on the CPU."""

from __future__ import annotations

import torch

from darts_dist.memory import PeakMemory

MIB = 1 << 20


def test_the_peak_counts_what_the_work_held_and_keeps_it_after_release() -> None:
    memory = PeakMemory()
    held = torch.ones(64 * MIB // 4)  # 64 MiB, touched
    while_held = memory.peak()
    del held
    after = memory.stop()
    assert 60 * MIB <= while_held <= 80 * MIB
    assert after >= while_held  # the peak stays after the tensor is gone
    assert PeakMemory().stop() < 16 * MIB  # a fresh measure starts from what is held now
