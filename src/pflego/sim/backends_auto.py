"""``--backend auto``: pick the fastest backend by a short measured probe on the run's first cohort.

Where the rule of :func:`~pflego.sim.backends.resolve_backend` is sure, on CPU with every local
step fused and clients of at least ``FUSED_MIN_SAMPLES`` samples (fused steps beat autograd in any
backend), ``auto`` is ``fused`` with no probe. Otherwise, on its first call, :class:`AutoBackend`
times every candidate (:func:`candidates`) on that round's real cohort with its local schedules
cut to one and then two steps per client (the better of two tries of each, after an untimed
one-step warm-up). The two timings give each backend a fixed cost per round and a cost per local
step, from which it predicts the whole round (:func:`predicted_round`). The fastest prediction
wins, and runs the round; the choice then holds for the run (a checkpoint stores it, so a resumed
run keeps it).

In a distributed run every process probes on its own share of the first cohort it trains; at
the end of that round the processes agree (:func:`agreed_choice`): each backend's prediction is
its slowest process's (the round waits for that one), the least such wins, and every process
trains with it from the next round on (that first round, each used its own choice).

The probe works on copies of the downlink and states and restores torch's, NumPy's and Python's
global random generators afterwards, so a run's numbers are those of naming the chosen backend
explicitly. Setting the environment variable ``PFLEGO_BACKEND_PROBE=0`` skips it: ``auto`` then
follows the rule (reproducible choices, no timing).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch

from pflego import tree
from pflego.algorithms import Algorithm
from pflego.sim.backends import Backend, make_backend
from pflego.sim.clients import Cohort, pad_schedules
from pflego.sim.profile import wait_for_device
from pflego.tree import Params
from pflego.types import ClientOut, ClientState, RoundContext

#: Local steps per client of the probe's two timed runs (after a warm-up of the first).
PROBE_STEPS = (1, 2)

#: ``timer(name, work)`` runs ``work()`` (the probe of backend ``name``) and returns its seconds.
Timer = Callable[[str, Callable[[], object]], float]


def wall_clock(
    name: str, work: Callable[[], object], device: torch.device | str | None = None
) -> float:
    """Wall-clock seconds of ``work()`` with its kernels on ``device`` (``name`` only labels it):
    without waiting for them before and after, a backend that queues its kernels would look as
    fast as its launches, and the one timed next would pay for them."""
    wait_for_device(device)
    start = time.perf_counter()
    work()
    wait_for_device(device)
    return time.perf_counter() - start


def probing_enabled() -> bool:
    """Whether ``auto`` measures (``PFLEGO_BACKEND_PROBE`` unset or not ``0``)."""
    return os.environ.get("PFLEGO_BACKEND_PROBE", "1").strip() != "0"


def candidates(algorithm: Algorithm, device: torch.device) -> list[str]:
    """The backends ``auto`` measures for ``algorithm`` on ``device``, in order of preference on
    a tie (on CPU ``fused`` stands for ``loop`` too: the same updates, over threads; ``graph``
    only on CUDA, where it replays CUDA graphs)."""
    vmap = ["vmap"] if getattr(algorithm, "vmappable", True) else []
    if device.type == "cpu":
        return ["fused", *vmap]
    graph = ["graph"] if vmap and device.type == "cuda" else []
    return [*graph, *vmap, "loop"]


def truncated(cohort: Cohort, steps: int, padded: bool = False) -> Cohort:
    """The cohort with every client's schedules cut to their last ``steps`` steps (a client's
    real steps come last); ``padded``: its stacked data shares the cohort's padded samples."""
    cut = lambda plans: [(idx[-steps:], mask[-steps:]) for idx, mask in plans]  # noqa: E731
    named = {name: cut(plans) for name, plans in cohort.named.items()}
    short = Cohort(cohort.clients, cohort.pool, cut(cohort.run), named, cohort.validation)
    if padded:  # the samples are padded once (and reused by the round if vmap wins)
        whole = cohort.data
        batches, batch_mask = pad_schedules(short.run, whole.x.dtype)
        schedules = {k: pad_schedules(v, whole.x.dtype) for k, v in named.items()}
        short.__dict__["data"] = whole._replace(
            batches=batches, batch_mask=batch_mask, schedules=schedules
        )
    return short


@contextmanager
def untouched_generators() -> Iterator[None]:
    """Restores torch's (CPU and CUDA), NumPy's and Python's global random state on exit."""
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def predicted_round(name: str, one: float, two: float, cohort: Cohort) -> float:
    """A backend's round seconds from its probe timings of one and two steps per client: a
    fixed cost plus a cost per step, times the cohort's longest schedule for ``vmap`` and
    ``graph`` (they pad every client to it) and its mean one for the others (each client runs
    its own)."""
    per_step = max(two - one, 0.0)
    steps = cohort.steps
    length = float(steps.max() if name in ("vmap", "graph") else steps.mean())
    return max(one - per_step, 0.0) + per_step * length


class AutoBackend:
    """A backend that, on its first call, probes its candidates and from then on is the fastest.

    Args:
        names: The eligible backends (:func:`candidates`).
        build: ``build(name)`` makes the backend of that name.
        timer: Measures one probe run (tests inject fake timings).
        settled: Why no probe is needed, when the rule is sure (then ``names[0]`` is chosen).

    Attributes:
        chosen: The backend picked (``None`` before the first call).
        timings: Each candidate's probe seconds (``steps_1``, ``steps_2``) and predicted round.
        probe_seconds: Wall-clock seconds the whole probe took.
    """

    def __init__(
        self,
        names: Sequence[str],
        build: Callable[[str], Backend],
        timer: Timer = wall_clock,
        settled: str | None = None,
    ) -> None:
        self.names, self.build, self.timer = list(names), build, timer
        self.chosen: str | None = None
        self.backend: Backend | None = None
        self.timings: dict[str, dict[str, float]] = {}
        self.failed: dict[str, str] = {}
        self.probe_seconds = 0.0
        #: Each backend's predicted round on the slowest process of a distributed run.
        self.group_predictions: dict[str, float] = {}
        self.reason = settled
        if settled:
            self.fix(self.names[0])

    def fix(self, name: str, reason: str | None = None) -> None:
        """Use backend ``name`` without probing (``reason``: why, e.g. a resumed run's choice)."""
        self.chosen, self.backend = name, self.build(name)
        self.reason = reason or self.reason

    def __call__(
        self,
        algorithm: Algorithm,
        downlink: Params,
        states: ClientState,
        cohort: Cohort,
        ctx: RoundContext,
    ) -> tuple[ClientOut, ClientState]:
        if self.backend is None:
            self.fix(self.probe(algorithm, downlink, states, cohort, ctx))
        return self.backend(algorithm, downlink, states, cohort, ctx)

    def probe(
        self,
        algorithm: Algorithm,
        downlink: Params,
        states: ClientState,
        cohort: Cohort,
        ctx: RoundContext,
    ) -> str:
        """The candidate of the least predicted round time on this cohort (the first candidate
        when every probe fails: the round itself then reports the error)."""
        start = time.perf_counter()
        padded = "vmap" in self.names or "graph" in self.names
        runs = {steps: truncated(cohort, steps, padded) for steps in PROBE_STEPS}
        with untouched_generators():
            for name in self.names:
                backend = self.build(name)

                def work(steps: int, backend: Backend = backend) -> None:
                    # copies: the backend may not touch the originals through them
                    own = tree.map_(torch.clone, downlink), tree.map_(torch.clone, states)
                    backend(algorithm, *own, runs[steps], ctx)

                def best(steps: int, name: str = name) -> float:
                    return min(self.timer(name, lambda: work(steps)) for _ in range(2))

                try:
                    work(PROBE_STEPS[0])  # warm-up: first calls allocate what later ones reuse
                    one, two = (best(steps) for steps in PROBE_STEPS)
                except Exception as exc:  # noqa: BLE001  (a backend that fails is not chosen)
                    self.failed[name] = f"{type(exc).__name__}: {exc}"[:200]
                    continue
                self.timings[name] = {
                    "steps_1": one,
                    "steps_2": two,
                    "predicted_round": predicted_round(name, one, two, cohort),
                }
        self.probe_seconds = time.perf_counter() - start
        if not self.timings:
            return self.names[0]
        return min(self.timings, key=lambda n: self.timings[n]["predicted_round"])

    @property
    def report_for_group(self) -> tuple[str | None, dict[str, dict[str, float]], bool]:
        """What :meth:`agree` needs of this process: its choice, its timings, whether it probed
        (a process whose every probe failed probed, with no timings)."""
        return self.chosen, self.timings, bool(self.timings or self.failed)

    def agree(
        self, reports: Sequence[tuple[str | None, dict[str, dict[str, float]], bool]]
    ) -> bool:
        """Adopt the choice of a group of processes from each one's :attr:`report_for_group`
        (this one's among them); ``False`` while none has chosen yet (none trained)."""
        chosen = [name for name, _, _ in reports if name is not None]
        if not chosen:
            return False
        measured = [timings for _, timings, probed in reports if probed]
        self.group_predictions = slowest_rounds(measured)
        # no timings anywhere: the rule's or the checkpoint's choice (or every probe failed)
        name = agreed_choice(self.group_predictions) or chosen[0]
        if name != self.chosen:
            self.fix(name, "agreed by the processes")
        return True

    def summary(self) -> str:
        """One line for the run's log: the choice and each candidate's predicted round."""
        timed = ", ".join(
            f"{n} {t['predicted_round']:.3g} s"
            for n, t in sorted(self.timings.items(), key=lambda item: item[1]["predicted_round"])
        )
        if not timed:
            why = "every probe failed" if self.failed else self.reason
            return f"backend auto is {self.chosen} ({why})"
        return (
            f"backend auto chose {self.chosen} (predicted round: {timed}; the probe took "
            f"{self.probe_seconds:.2g} s)"
        )

    def report(self) -> dict[str, Any]:
        """What ``profile.json`` says of the choice: the backend, the probe's timings (rounded
        to microseconds) and its cost."""
        rounded = {n: {k: round(v, 6) for k, v in t.items()} for n, t in self.timings.items()}
        out: dict[str, Any] = {"chosen": self.chosen, "candidates": self.names}
        out |= {"timings": rounded, "probe_seconds": round(self.probe_seconds, 4)}
        if self.group_predictions:  # None: a process could not run that backend
            slow = {
                n: round(v, 6) if math.isfinite(v) else None
                for n, v in self.group_predictions.items()
            }
            out["predicted_round_of_the_slowest_process"] = slow
        if not self.timings and self.reason:
            out["not_probed"] = self.reason
        return out | ({"failed": self.failed} if self.failed else {})


def slowest_rounds(measured: Sequence[dict[str, dict[str, float]]]) -> dict[str, float]:
    """Each backend's predicted round on the slowest of the processes' probe timings (infinite
    where one of them could not run it)."""
    names = dict.fromkeys(n for timings in measured for n in timings)
    return {
        n: max(t[n]["predicted_round"] if n in t else math.inf for t in measured) for n in names
    }


def agreed_choice(slowest: dict[str, float]) -> str | None:
    """The backend of the shortest slowest round (``None`` when none ran on every process)."""
    best = min(slowest, key=slowest.__getitem__, default=None)
    return best if best is not None and math.isfinite(slowest[best]) else None


#: Why ``auto`` does not probe when the rule is sure of ``fused``.
FUSED_FOR_SURE = "every local step fuses and clients are large: fused steps beat autograd"


def auto_backend(
    algorithm: Algorithm, device: torch.device, chunk_size: int | None, fuses: bool
) -> AutoBackend:
    """The ``auto`` backend of ``algorithm`` on ``device``: ``fused`` without a probe when
    ``fuses`` (the rule's fusion check passed on CPU), else measured on the first round."""
    names = candidates(algorithm, device)
    sure = fuses and names[0] == "fused"
    return AutoBackend(
        names,
        lambda name: make_backend(name, algorithm, chunk_size),
        timer=partial(wall_clock, device=device),
        settled=FUSED_FOR_SURE if sure else None,
    )
