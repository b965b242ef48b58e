"""Where a run's wall-clock and CPU time goes (``profile.json``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


def wait_for_device(device: torch.device | str | None = None) -> None:
    """Wait for the CUDA kernels queued on ``device`` (the current CUDA device when ``None``), so
    that a clock read next counts them; nothing where CUDA is not in use."""
    if device is None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Profile:
    """Where a run's wall-clock time goes: data, train, evaluate, checkpoint (the time the round
    loop waits for it) and the rest; ``startup`` is the process's time before the run began
    (interpreter and imports), when known. The CPU time of each part is counted too, and the
    part of it the kernel spent (page faults, memory mapped and unmapped, system calls)."""

    PARTS = ("data", "train", "evaluate", "checkpoint")
    #: The clocks: wall-clock, the process's CPU time, and the kernel's share of that.
    CLOCKS = ("seconds", "cpu_seconds", "system_seconds")

    def __init__(self, startup: float | None = None) -> None:
        self.start = clocks()
        self.startup = startup
        self.spent = {clock: dict.fromkeys(self.PARTS, 0.0) for clock in self.CLOCKS}

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        start = clocks()
        try:
            yield
        finally:
            for clock, now, then in zip(self.CLOCKS, clocks(), start, strict=True):
                self.spent[clock][name] += now - then

    def summary(self, **facts: Any) -> dict[str, Any]:
        """Wall-clock seconds by part (``other``: the rest of the run), the process's CPU seconds
        by part (all threads; on a busy machine they show what the run itself cost), the system
        (kernel) share of those, and ``facts``."""
        out = {}
        for clock, now, then in zip(self.CLOCKS, clocks(), self.start, strict=True):
            parts, whole = self.spent[clock], now - then
            startup = self.startup if clock == "seconds" else None
            table = {"startup": round(startup, 3)} if startup is not None else {}
            table |= {k: round(v, 3) for k, v in parts.items()}
            table["other"] = round(max(0.0, whole - sum(parts.values())), 3)
            out[clock] = table | {"total": round(whole + (startup or 0.0), 3)}
        return out | facts


def clocks() -> tuple[float, float, float]:
    """Now by each of :attr:`Profile.CLOCKS`."""
    return time.perf_counter(), time.process_time(), os.times().system


def process_age() -> float | None:
    """Seconds since this process started (Linux), else ``None``."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
