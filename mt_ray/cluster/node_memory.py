"""The memory a whole node uses, sampled: what a data-parallel run costs its host per parameter.

MemTotal - MemAvailable counts every process on the node and the object store's shared pages,
which no process's RSS shows. Its peak growth over a run, divided by the parameter count, is
the figure `mt-ray calc` predicts for a node (`node_host_bytes_per_param`).
"""

from __future__ import annotations

import threading

import psutil


def node_used_bytes() -> int:
    """MemTotal - MemAvailable of this node, in bytes."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def process_bytes() -> dict[str, int]:
    """This process's memory now. pss: its private pages plus its share of each shared one, so the processes
    of a run sum to the memory the run holds, a shared-memory arena counted once. uss: its private pages alone
    (what the process itself costs beside the arena)."""
    info = psutil.Process().memory_full_info()
    return {"pss": info.pss, "uss": info.uss}


class NodeMemoryPeak:
    """Samples `node_used_bytes` on a daemon thread from construction on; `growth` is the peak rise over `baseline`
    (default: the reading at construction)."""

    def __init__(self, interval_s: float = 0.05, baseline: int | None = None):
        self.peak = node_used_bytes()
        self.baseline = self.peak if baseline is None else baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval_s,), name="mt-ray-mem", daemon=True)
        self._thread.start()

    @property
    def growth(self) -> int:
        self.peak = max(self.peak, node_used_bytes())
        return self.peak - self.baseline

    def close(self) -> None:
        self._stop.set()

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.peak = max(self.peak, node_used_bytes())
