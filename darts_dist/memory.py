"""What a role really holds, to set beside what the plan says (`benchmarks/plan_accuracy.py`): the peak memory of
its work since it started, on the device the plan counts.

On a GPU, torch's peak allocation on the device. On the CPU, the process's resident memory (VmRSS: tensors,
activations and buffers, and the pages of memory-mapped weight files it has touched, since safetensors loads
fp32 weights onto the CPU without a copy) above what it held at the start, sampled every 5 ms by a daemon
thread: a transient shorter than that can be missed. Light imports only: the stream's Ray Data coordinators import
this module and never touch a device, so torch is imported where a GPU is measured.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SAMPLE_S = 0.005


def resident_bytes() -> int:
    """This process's resident memory in bytes (Linux /proc; 0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakMemory:
    """The most memory held since construction, above what was held then (`peak()`, in bytes)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = device
        self.cuda = str(device).startswith("cuda")
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            return
        self.baseline = self.highest = resident_bytes()
        # The sampler and `peak` both raise `highest`: unlocked, one could write back a maximum taken before the
        # other's higher one (a lost update: the peak went down after a tensor was freed).
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True, name="peak-memory").start()

    def _observe(self) -> int:
        """`highest`, raised to the resident memory now."""
        now = resident_bytes()
        with self._lock:
            self.highest = max(self.highest, now)
            return self.highest

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._observe()

    def peak(self) -> int:
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return self._observe() - self.baseline

    def stop(self) -> int:
        """The peak; the sampling stops (a role done with its work)."""
        peak = self.peak()
        if not self.cuda:
            self._stop.set()
        return peak
