"""The round engine: one function runs a round for every transport.

A round is always the same sequence: draw the cohort (:class:`Sampling`), obtain the cohort's
client updates from a :class:`Transport` (it sends the downlink and has the clients train: the
in-process backend, the shards of a torch.distributed group gathered in cohort order, or Flower
messages, plain or through SecAgg+), leave out the updates that are not finite, scale the context
to the realized cohort, run the server step (with central noise under differential privacy) and
``mix``, check that the server parameters are finite, and commit the new server state and client
states together (:func:`run_round`). What happens around rounds (evaluation, checkpoints, the
divergence check, progress, trackers) are :class:`Callback`\\ s of one training loop (:func:`train`);
pfl-research's ``TrainingProcessCallback`` is the model: each hook does nothing unless a callback
overrides it. When a run evaluates, which clients, and the record it logs are the same for every
transport too (:func:`evaluation_due`, :func:`evaluation_sample`, :func:`evaluation_record`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import numpy as np
import torch
from tqdm.auto import tqdm

from pflego.config import Config
from pflego.history import History, RunDir
from pflego.rng import seed_for
from pflego.sim.backends_auto import AutoBackend
from pflego.sim.guards import (
    Updates,
    check_finite_server,
    deferred_interrupts,
    divergence_threshold,
    every_update_non_finite,
    finite_rows,
    loss_diverged,
    loss_exploded,
)
from pflego.sim.privacy import Privacy, server_round
from pflego.trackers import ARTIFACTS, Tracker, metrics_of, open_trackers
from pflego.types import ClientState, RoundContext, ServerState

if TYPE_CHECKING:
    from pflego.algorithms import Algorithm


class Population(Protocol):
    """What sampling reads of a population: its client count I and training samples N."""

    @property
    def num_clients(self) -> int: ...

    @property
    def total_train(self) -> int: ...


class Sampling:
    """Each round's cohort and context over a population (the simulator's data, or the clients a
    Flower server knows, read anew every round so that late joiners count)."""

    def __init__(self, config: Config, algorithm: Algorithm, population: Population) -> None:
        self.cfg, self.algorithm, self.population = config, algorithm, population

    def context(self, t: int) -> RoundContext:
        """Round t's context; its cohort size r sets PFLEGO's scaling I/r.

        ``fixed``: r = round(p I), and Pr(i in S_t) = r / I. ``bernoulli``: r = p I, the
        expected size, and Pr(i in S_t) = p = r / I. Either way I/r is the inverse inclusion
        probability and (I/r) sum_{i in S_t} alpha_i g_i is unbiased for sum_i alpha_i g_i.

        ``uniform-count``: r_t is drawn uniformly from {min_cohort, ..., max_cohort}, then r_t
        clients without replacement; the context carries that round's own r_t (drawn by
        :meth:`cohort_count` from the generator :meth:`cohort` uses, so the two agree). Given r_t,
        Pr(i in S_t | r_t) = r_t / I, so for any client quantities a_i
        E[(I/r_t) sum_{i in S_t} a_i] = sum_r P(r) (I/r) sum_i (r/I) a_i = sum_i a_i:
        the body step is unbiased given every r_t, and a head W_i, stepped only when i is
        sampled, moves in expectation by sum_r P(r) (r/I)(I/r) rho alpha_i g_W = rho alpha_i g_W.
        (Scaling by I / E[r] would be unbiased too, but adds the variance of r_t to the step.)
        """
        cfg, population = self.cfg, self.population
        if cfg.sampling == "uniform-count":
            size = float(self.cohort_count(t))
        else:
            size = cfg.participation * population.num_clients  # the dataset may fix the count
            if cfg.sampling == "fixed":
                size = max(1, round(size))
        client_lr, server_lr = (
            getattr(self.algorithm, f"default_{k}") if getattr(cfg, k) is None else getattr(cfg, k)
            for k in ("client_lr", "server_lr")
        )
        return RoundContext(
            t,
            population.num_clients,
            size,
            population.total_train,
            client_lr,
            server_lr,
            cfg.seed,
        )

    def sampler(self, t: int) -> np.random.Generator:
        """The generator of round t's cohort, seeded by (seed, 1, t)."""
        return np.random.default_rng(seed_for(self.cfg.seed, 1, t))

    def cohort_count(self, t: int, rng: np.random.Generator | None = None) -> int:
        """``uniform-count``'s r_t: the first draw of round t's sampler, uniform on [min, max]."""
        rng = self.sampler(t) if rng is None else rng
        return int(rng.integers(self.cfg.min_cohort, self.cfg.max_cohort + 1))

    def cohort(self, t: int) -> np.ndarray:
        """Clients of round t (``int64``): exactly r without replacement, each with probability
        p, or (``uniform-count``) r_t uniform on [min_cohort, max_cohort], then r_t without
        replacement. Nobody while the population is empty."""
        num = self.population.num_clients
        if num == 0:
            return np.zeros(0, np.int64)
        rng = self.sampler(t)
        if self.cfg.sampling == "uniform-count":
            chosen = np.sort(rng.choice(num, self.cohort_count(t, rng), replace=False))
        elif self.cfg.sampling == "fixed":
            chosen = np.sort(rng.choice(num, int(self.context(t).cohort_size), replace=False))
        else:
            chosen = np.flatnonzero(rng.random(num) < self.cfg.participation)
        return np.asarray(chosen, dtype=np.int64)


class Transport(Protocol):
    """How a round's client updates are obtained, and where its result is committed."""

    def updates(self, t: int, ctx: RoundContext, cohort: np.ndarray) -> Updates | None:
        """The updates of the cohort members that answered (``None``: nobody did)."""

    def commit(self, server: ServerState, clients: np.ndarray, states: ClientState) -> None:
        """Keep the new server state and the new states of ``clients`` (stacked in order)."""


@dataclass(frozen=True)
class Round:
    """What a round did.

    Attributes:
        t: The round.
        sampled: The cohort drawn.
        ctx: The context of the server step (its cohort size scaled to the realized cohort).
        kept: The clients whose updates the server step used (none: the state is unchanged).
        dropped: The clients whose updates were left out as non-finite.
    """

    t: int
    sampled: np.ndarray
    ctx: RoundContext
    kept: np.ndarray
    dropped: np.ndarray


def run_round(
    t: int,
    sampling: Sampling,
    transport: Transport,
    server: ServerState,
    privacy: Privacy | None,
) -> Round:
    """Run round ``t``: cohort, client updates (by ``transport``), drop the non-finite ones,
    realized cohort, server step (with central privacy), ``mix``, finite check, commit.

    A client whose upload or new state is not finite is left out, with the cohort size scaled
    as for a missing one; a round in which nobody answered commits nothing; one whose every
    answer is non-finite, or whose server parameters become non-finite, stops the run
    (``DivergedError``) and commits nothing. The new server state and client states are
    committed together, never half (Ctrl-C is held meanwhile).
    """
    algorithm = sampling.algorithm
    ctx, cohort = sampling.context(t), np.asarray(sampling.cohort(t), np.int64)
    nothing = np.zeros(0, np.int64)
    updates = transport.updates(t, ctx, cohort) if len(cohort) else None
    if updates is None:  # nobody sampled (Bernoulli) or nobody answered: no step
        return Round(t, cohort, ctx, nothing, nothing)
    weights = {"w": updates.out.weight.reshape(len(updates.clients), -1)}
    keep = (finite_rows(updates.out.upload, weights) & updates.finite).numpy()
    if not keep.any():
        raise every_update_non_finite(t, ctx)
    dropped = updates.clients[~keep]
    if len(dropped):
        updates = updates.kept(keep)
    real = ctx.realized(len(cohort), len(updates.clients))
    clients = torch.as_tensor(updates.clients)
    new = server_round(algorithm, privacy, server, updates.out, real, clients)
    if algorithm.mixes and len(updates.held) != len(updates.clients):
        raise RuntimeError("mix needs the new states of the whole cohort")
    new, states = algorithm.mix(new, updates.states, real, clients)
    check_finite_server(new, t, real)
    with deferred_interrupts():
        transport.commit(new, updates.clients[updates.held], states)
    return Round(t, cohort, real, updates.clients, dropped)


# --- the training loop and its callbacks ----------------------------------------------------

Record = dict[str, Any]


class Callback:
    """A hook of the training loop; every method does nothing by default."""

    def on_train_begin(self, completed: int) -> None:
        """Before the loop's first round (``completed`` rounds are already done)."""

    def on_round_end(self, completed: int) -> None:
        """After a round (``completed`` rounds are done)."""

    def on_evaluation(self, completed: int, record: Record) -> None:
        """After the evaluation made when ``completed`` rounds were done."""

    def on_train_end(self, completed: int) -> None:
        """After the loop's last round."""

    def on_train_failed(self, error: BaseException) -> None:
        """When the loop stops with ``error`` (Ctrl-C included) instead of ending."""


def train(
    first: int, last: int, step: Callable[[int], None], callbacks: Sequence[Callback]
) -> None:
    """Run rounds ``first..last-1`` with ``step`` (the engine's round and its bookkeeping), calling
    the ``callbacks`` in their order around them; if anything raises, each callback's
    ``on_train_failed`` is called before the error goes on."""
    try:
        for callback in callbacks:
            callback.on_train_begin(first)
        for t in range(first, last):
            step(t)
            for callback in callbacks:
                callback.on_round_end(t + 1)
        for callback in callbacks:
            callback.on_train_end(last)
    except BaseException as error:
        for callback in callbacks:
            callback.on_train_failed(error)
        raise


class Evaluate(Callback):
    """Evaluate when due, with the run's evaluation entry point, and hand the record (if any: a
    Flower evaluation that no node answered has none) to ``then`` (which see no ``on_round_end``
    from here). The evaluation due when the loop begins is made then, unless the run's
    ``records`` end with it (a resumed run's)."""

    def __init__(
        self,
        due: Callable[[int], bool],
        evaluate: Callable[[int], Record | None],
        then: Sequence[Callback] = (),
        records: Sequence[Record] = (),
    ) -> None:
        self.due, self.evaluate, self.then, self.records = due, evaluate, then, records

    def on_train_begin(self, completed: int) -> None:
        if not self.records or self.records[-1]["round"] != completed:
            self.on_round_end(completed)

    def on_round_end(self, completed: int) -> None:
        if self.due(completed) and (record := self.evaluate(completed)) is not None:
            for callback in self.then:
                callback.on_evaluation(completed, record)


def evaluation_due(config: Config, completed: int) -> bool:
    """Evaluate every ``eval_every`` rounds, at each of the last ``average_last`` and at the end."""
    return (
        completed % config.eval_every == 0
        or completed > config.rounds - config.average_last
        or completed == config.rounds
    )


def evaluation_sample(config: Config, num_clients: int) -> np.ndarray:
    """The clients every evaluation covers: all, or ``eval_clients`` of them drawn once."""
    count = config.eval_clients
    if count is None or count >= num_clients:
        return np.arange(num_clients)
    rng = np.random.default_rng(seed_for(config.seed, 9))
    return np.sort(rng.choice(num_clients, count, replace=False))


def evaluation_record(
    config: Config, completed: int, summary: dict[str, float], seconds: float
) -> dict[str, Any]:
    """One line of ``metrics.jsonl``."""
    return {
        "round": completed,
        "algorithm": config.algorithm,
        "dataset": config.dataset,
        **summary,
        "seconds": round(seconds, 3),
    }


class Run(Protocol):
    """What the divergence check reads of a run."""

    records: list[Record]
    speaks: bool

    def context(self, t: int) -> RoundContext: ...


class DivergenceCheck(Callback):
    """Warn once when the training loss grew past 100 times its first value, and stop the run
    (``DivergedError``) when its loss has stayed past ``threshold``
    (:func:`~pflego.sim.guards.divergence_threshold`) for ``DIVERGENCE_EVALUATIONS`` evaluations,
    unless ``divergence=warn``. Every process of a distributed run holds the same records, so all
    stop together.

    Args:
        run: The run (its records, whether it prints warnings, its round contexts).
        classes: The head's width (the chance level of the threshold).
        stop: Whether a diverged run stops (``divergence=stop``).
    """

    def __init__(self, run: Run, classes: int, stop: bool) -> None:
        self.run, self.classes, self.stop = run, classes, stop
        self.warned = False

    def on_evaluation(self, completed: int, record: Record) -> None:
        loss, first = record["train_loss"], self.run.records[0]["train_loss"]
        if self.run.speaks and not self.warned and first and loss > 100 * first:
            self.warned = True
            tqdm.write(
                f"pflego: warning: the training loss grew from {first:.4g} to "
                f"{loss:.4g} by round {completed}; the step sizes may be too large",
                file=sys.stderr,
            )
        losses = [r["train_loss"] for r in self.run.records]
        if self.stop and loss_diverged(losses, divergence_threshold(first, self.classes)):
            raise loss_exploded(first, losses[-1], completed, self.run.context(completed - 1))


class Checkpoints(Callback):
    """``save`` every ``every`` rounds, after the last of ``rounds``, and after the evaluation made
    when the loop begins, so that every interrupted run can be resumed: that one reaches this
    callback (among :class:`Evaluate`'s ``then``, listed after it) before its ``on_train_begin``."""

    def __init__(self, save: Callable[[], None], every: int, rounds: int) -> None:
        self.save, self.every, self.rounds = save, every, rounds
        self.begun = False

    def on_train_begin(self, completed: int) -> None:
        self.begun = True

    def on_evaluation(self, completed: int, record: Record) -> None:
        if not self.begun:
            self.save()

    def on_round_end(self, completed: int) -> None:
        if completed % self.every == 0 or completed == self.rounds:
            self.save()


class Curves(Callback):
    """Draw the run's curves (``records`` under ``label``) into ``curves.png`` under ``title`` when
    the loop ends (listed before :class:`Tracking`, which logs the figure)."""

    def __init__(self, run_dir: RunDir, records: list[Record], label: str, title: str) -> None:
        self.run_dir, self.records, self.label, self.title = run_dir, records, label, title

    def on_train_end(self, completed: int) -> None:
        if self.records:
            from pflego.plots import plot_histories

            history = History(self.records, self.run_dir.path)
            plot_histories({self.label: history}, self.run_dir.path / "curves.png", self.title)


class Tracking(Callback):
    """The trackers of ``config``'s ``log`` (:mod:`pflego.trackers`): opened when the loop begins
    (a resumed run's, whose ``records`` they hold, continued), fed every evaluation, given the
    run's artifacts when it ends, closed however it stops. Listed before :class:`Evaluate`."""

    def __init__(self, run_dir: RunDir, config: dict[str, Any], records: list[Record]) -> None:
        self.run_dir, self.config, self.records = run_dir, config, records
        self.trackers: list[Tracker] = []

    def on_train_begin(self, completed: int) -> None:
        resumed_after = self.records[-1]["round"] if self.records else None
        self.trackers = open_trackers(self.run_dir, self.config, resumed_after)

    def on_evaluation(self, completed: int, record: Record) -> None:
        for tracker in self.trackers:
            tracker.log_metrics(metrics_of(record), completed)

    def on_train_end(self, completed: int) -> None:
        paths = [self.run_dir.path / name for name in ARTIFACTS]
        for tracker in self.trackers:
            tracker.log_artifacts([path for path in paths if path.is_file()])
        self.close()

    def on_train_failed(self, error: BaseException) -> None:
        self.close()

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []  # closed once
        for tracker in trackers:
            tracker.close()


def is_live(stream: TextIO) -> bool:
    """Whether ``stream`` redraws a bar in place: a terminal, or a notebook's output."""
    return "ipykernel" in sys.modules or (hasattr(stream, "isatty") and stream.isatty())


class RoundProgress(Callback):
    """Progress of rounds ``start..total``: a redrawn bar on a terminal (or in a notebook), else
    one plain line per evaluation, so that a log file, CI or ``| tee`` gets readable lines instead
    of bar frames. A callback of the training loop, or call :meth:`advance` after each round and
    :meth:`evaluated` after each evaluation.

    Args:
        desc: What runs, e.g. ``"pflego on mnist5k"``.
        start: Rounds already done (a resumed run).
        total: Rounds in all.
        enabled: Show anything at all.
        stream: Where progress goes (default: stderr).
    """

    def __init__(
        self, desc: str, start: int, total: int, enabled: bool, stream: TextIO | None = None
    ) -> None:
        self.desc, self.start, self.total, self.enabled = desc, start, total, enabled
        self.stream = stream or sys.stderr
        self.live = enabled and is_live(self.stream)
        self.bar = tqdm(
            desc=desc,
            unit="round",
            disable=not self.live,
            initial=start,
            total=total,
            file=self.stream,
        )

    def advance(self) -> None:
        """One more round done."""
        self.bar.update(1)

    def evaluated(self, completed: int, record: dict[str, Any]) -> None:
        """Show an evaluation's training loss and test accuracy."""
        loss, accuracy = f"{record['train_loss']:.4f}", f"{100 * record['test_acc']:.2f}%"
        if self.live:
            self.bar.set_postfix(train_loss=loss, test_acc=accuracy)
        elif self.enabled:
            print(
                f"{self.desc}: round {completed}/{self.total} train_loss {loss} test_acc {accuracy}",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()

    def on_round_end(self, completed: int) -> None:
        self.advance()

    def on_evaluation(self, completed: int, record: dict[str, Any]) -> None:
        if completed > self.start:  # the evaluation at the start: no round done to show it with
            self.evaluated(completed, record)

    def on_train_end(self, completed: int) -> None:
        self.close()


class BackendReport(Callback):
    """Print ``auto``'s choice of backend once its probe has made it."""

    def __init__(self, backend: AutoBackend, bar: RoundProgress) -> None:
        self.backend, self.bar = backend, bar
        self.done = False

    def on_round_end(self, completed: int) -> None:
        if not self.done and self.backend.chosen is not None:
            self.done = True
            tqdm.write(f"{self.bar.desc}: {self.backend.summary()}", file=self.bar.stream)
