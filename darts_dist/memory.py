"""What a role really holds, to set beside what the plan says (`benchmarks/plan_accuracy.py`): the peak memory of
its work since it started, on the device the plan counts.

On a GPU, torch's peak allocation on the device. On the CPU, the process's resident memory (VmRSS: tensors,
activations and buffers, and the pages of memory-mapped weight files it has touched, since safetensors loads
fp32 weights onto the CPU without a copy) above what it held at the start: on Linux the kernel's own high-water
mark (VmHWM), reset when a measure starts (`/proc/self/clear_refs`), so no transient is missed and nothing samples;
where that cannot be reset, sampled every 5 ms by a daemon thread, which can miss a shorter transient. (The sampler
ran in every role, a serving replica included, and its 200 wake-ups a second took the GIL from the forward beside
it.) Light imports only: the stream's Ray Data coordinators import this module and never touch a device, so torch
is imported where a GPU is measured.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SAMPLE_S = 0.005
# The CPU measures alive in this process: a new measure's reset of the high-water mark would lose the peaks the
# others saw before it, so each first keeps its own.
_LIVE: weakref.WeakSet[PeakMemory] = weakref.WeakSet()
_RESET = threading.Lock()


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status in bytes (0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes() -> int:
    """This process's resident memory in bytes (Linux /proc; 0 where there is none)."""
    return _status_bytes("VmRSS")


def _reset_high_water() -> bool:
    """Set the kernel's peak resident memory of this process to what it holds now; False where it cannot be."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") > 0


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
        # `peak` may run on any thread while another raises `highest`: unlocked, one could write back a maximum taken
        # before the other's higher one (a lost update: the peak went down after a tensor was freed).
        self._lock = threading.Lock()
        with _RESET:
            for other in list(_LIVE):
                other._observe()
            self.exact = _reset_high_water()
            self.baseline = self.highest = resident_bytes()
            if self.exact:
                _LIVE.add(self)
        self._stop = threading.Event()
        if not self.exact:
            threading.Thread(target=self._sample, daemon=True, name="peak-memory").start()

    def _observe(self) -> int:
        """`highest`, raised to the kernel's high-water mark (or the resident memory now)."""
        now = _status_bytes("VmHWM") if self.exact else resident_bytes()
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
        """The peak; the measure ends (a role done with its work)."""
        peak = self.peak()
        if not self.cuda:
            self._stop.set()
            _LIVE.discard(self)
        return peak
