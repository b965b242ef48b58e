"""What happens around the engine's rounds, as callbacks of one training loop (:func:`train`):
evaluation on schedule, the divergence check, checkpoints, progress. pfl-research's
``TrainingProcessCallback`` is the model: each hook does nothing unless a callback overrides it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tqdm.auto import tqdm

from pflego.sim.guards import divergence_threshold, loss_diverged, loss_exploded
from pflego.types import RoundContext

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


def train(
    first: int, last: int, step: Callable[[int], None], callbacks: Sequence[Callback]
) -> None:
    """Run rounds ``first..last-1`` with ``step`` (the engine's round and its bookkeeping), calling
    the ``callbacks`` in their order around them."""
    for callback in callbacks:
        callback.on_train_begin(first)
    for t in range(first, last):
        step(t)
        for callback in callbacks:
            callback.on_round_end(t + 1)
    for callback in callbacks:
        callback.on_train_end(last)


class Evaluate(Callback):
    """Evaluate when due, with the run's evaluation entry point, and hand the record to ``then``
    (which see no ``on_round_end`` from here)."""

    def __init__(
        self,
        due: Callable[[int], bool],
        evaluate: Callable[[int], Record],
        then: Sequence[Callback] = (),
    ) -> None:
        self.due, self.evaluate, self.then = due, evaluate, then

    def on_round_end(self, completed: int) -> None:
        if self.due(completed):
            record = self.evaluate(completed)
            for callback in self.then:
                callback.on_evaluation(completed, record)


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
                f"{loss:.4g} by round {completed}; the step sizes may be too large"
            )
        losses = [r["train_loss"] for r in self.run.records]
        if self.stop and loss_diverged(losses, divergence_threshold(first, self.classes)):
            raise loss_exploded(first, losses[-1], completed, self.run.context(completed - 1))


class Checkpoints(Callback):
    """``save`` every ``every`` rounds and after the last of ``rounds``."""

    def __init__(self, save: Callable[[], None], every: int, rounds: int) -> None:
        self.save, self.every, self.rounds = save, every, rounds

    def on_round_end(self, completed: int) -> None:
        if completed % self.every == 0 or completed == self.rounds:
            self.save()
