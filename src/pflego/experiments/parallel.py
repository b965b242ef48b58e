"""Independent runs of a plan in parallel worker processes (``--jobs N``).

Each worker is a fresh interpreter (``spawn``: no torch state is forked) with its own CPU threads
and, with ``devices``, its own device (round-robin over the workers); it takes the plan's runs one
at a time, exactly as the serial plan runs them, so every run's files equal the serial plan's
(every number except wall-clock fields). A run that fails is named in the summary and the others
go on. Ctrl-C reaches every worker: each checkpoints its run in progress, and running the command
again finishes the plan.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pflego.errors import ConfigError, PflegoError
from pflego.fields import at_least, check_fields, setting
from pflego.sim.engine import is_live


@dataclass(frozen=True)
class Workers:
    """How a plan's runs are spread over processes.

    Attributes:
        jobs: Worker processes (1: the runs run one after another in this process).
        devices: Devices given to the workers round-robin (``cpu``, ``cuda:0``...); empty: each
            run's own ``device`` setting.
        threads: Torch CPU threads per worker (default: the CPU cores divided by ``jobs``).
    """

    jobs: int = setting(1, rule=at_least(1))
    devices: tuple[str, ...] = setting(factory=tuple)
    threads: int | None = setting(None, rule=at_least(1))

    def __post_init__(self) -> None:
        check_fields(self, "--")

    def threads_each(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.jobs)

    def device_of(self, worker: int) -> str | None:
        return self.devices[worker % len(self.devices)] if self.devices else None


class RunsFailedError(PflegoError):
    """Some runs of a plan failed (the others finished); the CLI exits with code 1."""

    exit_code = 1


def parse_devices(text: str | None) -> tuple[str, ...]:
    """``cpu`` or ``cuda:0,cuda:1`` as a tuple of device names, each checked."""
    if not text:
        return ()
    import torch

    devices = tuple(d.strip() for d in text.split(",") if d.strip())
    for name in devices:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ConfigError(f"--devices: {name!r} is not a device; e.g. cpu or cuda:0") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--devices: {name} asked for, but this machine has no CUDA GPU")
    return devices


#: Runs one planned run: ``(out, run, status, progress) -> final status``.
RunOne = Callable[[Path, Any, str, bool], str]

_worker_device: str | None = None
_worker_busy = False


def _interrupt_run(signum: int, frame: Any) -> None:
    """A worker's Ctrl-C: stops the run in progress (which checkpoints); an idle worker ignores it."""
    if _worker_busy:
        raise KeyboardInterrupt


def _start_worker(workers: Workers, counter: Any) -> None:
    """A worker's first act: a process group of its own (a terminal's Ctrl-C reaches the parent
    alone, which passes it on once), its threads and its device."""
    global _worker_device
    import torch

    os.setpgrp()
    signal.signal(signal.SIGINT, _interrupt_run)
    os.environ["OMP_NUM_THREADS"] = str(workers.threads_each())
    torch.set_num_threads(workers.threads_each())
    with counter.get_lock():
        _worker_device = workers.device_of(counter.value)
        counter.value += 1


def _run_in_worker(run_one: RunOne, out: str, run: Any, status: str) -> tuple[str, float]:
    """One planned run in a worker; returns its final status and seconds."""
    global _worker_busy
    if _worker_device is not None:
        run = run.on_device(_worker_device)
    start = time.perf_counter()
    _worker_busy = True
    try:
        final = run_one(Path(out), run, status, False)
    finally:
        _worker_busy = False
    return final, time.perf_counter() - start


def run_parallel(
    todo: Sequence[tuple[Any, str]], out: Path, workers: Workers, progress: bool, run_one: RunOne
) -> None:
    """Run ``todo`` (planned run, status) on ``workers.jobs`` processes, each run by
    ``run_one(out, run, status, progress)`` (a module-level function: workers import it by name).

    Raises:
        RunsFailedError: Some runs failed; the message names each with its one-line error.
        KeyboardInterrupt: Ctrl-C; every worker checkpointed its run in progress first.
    """
    context = get_context("spawn")
    counter = context.Value("i", 0)
    failed: list[str] = []
    bar = tqdm(
        total=len(todo),
        desc=f"runs on {workers.jobs} workers",
        unit="run",
        disable=not progress or not is_live(sys.stderr),
    )
    executor = ProcessPoolExecutor(
        workers.jobs,
        context,
        initializer=_start_worker,
        initargs=(workers, counter),
    )
    pending: dict[Future, Any] = {}
    try:
        for run, status in todo:
            pending[executor.submit(_run_in_worker, run_one, str(out), run, status)] = run
        done_count = 0
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                run = pending.pop(future)
                done_count += 1
                try:
                    final, seconds = future.result()
                    line = f"run {done_count} of {len(todo)} {final}: {run.dir} ({seconds:.1f} s)"
                except Exception as exc:  # noqa: BLE001  (named in the summary; the others go on)
                    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    failed.append(f"{run.dir} ({message})")
                    line = f"run {done_count} of {len(todo)} failed: {run.dir}: {message}"
                if progress:
                    tqdm.write(f"pflego: {line}", file=sys.stderr)
                bar.update(1)
    except KeyboardInterrupt:
        for future in pending:
            future.cancel()
        for process in list((executor._processes or {}).values()):
            if process.is_alive():  # a busy worker checkpoints its run, then stops
                os.kill(process.pid, signal.SIGINT)
        executor.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        bar.close()
        executor.shutdown(wait=True, cancel_futures=True)
    if failed:
        raise RunsFailedError(
            f"{len(failed)} of {len(todo)} runs failed (the others finished): " + "; ".join(failed)
        )
