"""A run's progress on stderr: a redrawn bar on a terminal (or in a notebook), else one plain line
per evaluation, so that a log file, CI or ``| tee`` gets readable lines instead of bar frames."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm.auto import tqdm

from pflego.sim.engine import Callback


def is_live(stream: TextIO) -> bool:
    """Whether ``stream`` redraws a bar in place: a terminal, or a notebook's output."""
    return "ipykernel" in sys.modules or (hasattr(stream, "isatty") and stream.isatty())


class RoundProgress(Callback):
    """Progress of rounds ``start..total``: a callback of the training loop, or call
    :meth:`advance` after each round and :meth:`evaluated` after each evaluation.

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
