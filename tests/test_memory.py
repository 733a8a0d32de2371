"""darts_dist.memory: a role's peak memory above what its process held when it began, on the CPU."""

from __future__ import annotations

import threading

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


def test_a_transient_is_caught_with_nothing_sampling_and_a_later_measure_keeps_the_earlier_ones_peak() -> None:
    """The kernel's high-water mark, reset when a measure starts: an allocation freed at once is counted (a 5 ms
    sampler could miss it), no sampling thread runs, and a second measure's reset loses nothing of the first's."""
    first = PeakMemory()
    assert first.exact and not any(t.name == "peak-memory" for t in threading.enumerate())
    torch.ones(128 * MIB // 4)  # 128 MiB, touched, freed before the next line runs
    second = PeakMemory()  # resets the mark to what is held now, far below the transient
    held = torch.ones(32 * MIB // 4)
    assert 120 * MIB <= first.peak() <= 160 * MIB
    assert 28 * MIB <= second.peak() <= 48 * MIB
    del held
    assert first.stop() >= 120 * MIB and second.stop() >= 28 * MIB
