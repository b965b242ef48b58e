"""The generic server loop on a Flower ``Grid``: one loop for every registered algorithm.

:class:`FlowerServer` waits for the nodes and learns the population from them
(:mod:`.membership`), or loads it from a checkpoint to resume (:mod:`.checkpoints`); then it runs
every training round (:mod:`.training`), evaluates on the simulator's schedule
(:mod:`.evaluation`), checkpoints its state atomically after each round (``checkpoint.pt``, so a
restarted ServerApp continues with ``resume``; nodes keep their clients' states on their disks),
and prints and logs a status line (sampled / answered / failed clients, bytes down and up, seconds
per phase, :mod:`.status`). Its messages to the nodes go through :mod:`.messaging`; a run that
Flower cannot do is refused first (:mod:`.unsupported`). Missing nodes never stop the run; a round
that diverges (``DivergedError``) stops it and is logged in ``flower.jsonl`` as phase
``diverged`` (``pflego flower local`` then exits with code 3).

The server is built in layers, each a module of one concern and a base of the next:
:class:`~.messaging.NodeMessaging` → :class:`~.membership.Membership` →
:class:`~.training.TrainingRounds` → :class:`~.evaluation.EvaluationRounds` →
:class:`~.checkpoints.ServerCheckpoints` → :class:`FlowerServer` (the run itself).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flwr.serverapp import Grid

from pflego.config import Config, to_dict
from pflego.environment import environment
from pflego.errors import ConfigError, DivergedError
from pflego.flower.checkpoints import ServerCheckpoints
from pflego.flower.secure import SecureAggregation
from pflego.flower.status import EVENTS, MeteredGrid, log_event, status_line, timed
from pflego.flower.unsupported import refuse_unsupported
from pflego.history import History, RunDir
from pflego.trackers import tracking

log = logging.getLogger("pflego.flower")


class FlowerServer(ServerCheckpoints):
    """A run's server: the population, the shared state, and the round loop.

    Args:
        config: The run's experiment config (its ``clients`` is how many nodes to wait for).
        grid: Flower's grid (or the in-process grid of :mod:`pflego.flower.inprocess`).
        run_dir: Where to write the run directory, or ``None``.
        round_timeout: Seconds to wait for the replies of one round.
        join_timeout: Seconds to wait at the start for ``config.clients`` nodes.
        input_shape: The model's input shape (``"1,28,28"``), or ``""`` to take it from the nodes.
        label_names: The run's label names (``"cat,dog"``), or ``""`` to take them from the nodes.
        secure: SecAgg+ settings to sum the uploads securely, or ``None``.
        resume: Continue from the run directory's checkpoint.
        run_key: Names this run on the nodes' disks (their state files); a resumed run keeps the
            key of the run it continues.
    """

    def __init__(
        self,
        config: Config,
        grid: Grid,
        run_dir: RunDir | None = None,
        round_timeout: float = 120.0,
        join_timeout: float = 120.0,
        input_shape: str = "",
        label_names: str = "",
        secure: SecureAggregation | None = None,
        resume: bool = False,
        run_key: str = "1",
    ) -> None:
        refuse_unsupported(config, secure is not None)
        if resume and run_dir is None:
            raise ConfigError("resume needs the run directory (out=...) holding checkpoint.pt")
        self.cfg = config
        self.grid = MeteredGrid(grid)
        self.run_dir = run_dir
        self.round_timeout = round_timeout
        self.join_timeout = join_timeout
        self.declared = {"input_shape": input_shape, "labels": label_names}
        self.secure = secure.check() if secure is not None else None
        self.resume = resume
        self.run_key = run_key
        self.population = None
        self.algorithm = None
        self.privacy = None
        self.server = {}
        self.nodes = {}  # client id -> node id
        self.records = []
        self.dropped = []  # [round, client] of non-finite updates left out
        self.secure_errors = []  # this evaluation period's SecAgg+ error bounds
        self.next_round = 0
        self.seconds = 0.0

    def start(self) -> None:
        """Form the population (or load it with the rest of a checkpoint) and map the nodes."""
        self.wait_for_nodes()
        if self.resume and self.run_dir.checkpoint.is_file():
            self.load()
            self.discover(self.next_round)
            return
        if self.resume:  # stopped before its first checkpoint: nothing was trained
            log.info("%s has no checkpoint yet: starting from round 0", self.run_dir.path)
        self.form_population()
        if self.run_dir:
            self.run_dir.start(
                to_dict(self.cfg), self.population.summary(), environment(self.cfg.device, [])
            )
            (self.run_dir.path / EVENTS).write_text("")  # a fresh run's own events

    def run(self) -> History:
        """Form the population, then run every round; evaluate, log and checkpoint on schedule."""
        self.start()
        with tracking(self.run_dir, to_dict(self.cfg), self.records):
            if self.evaluation_missing():
                self.evaluate(self.next_round)
                self.checkpoint()
            for t in range(self.next_round, self.cfg.rounds):
                start = time.perf_counter()
                try:
                    event = self.run_round(t)
                except DivergedError as exc:  # `pflego flower local` reads it back: exit code 3
                    log_event(self.run_dir, {"round": t, "phase": "diverged", "error": str(exc)})
                    raise
                self.seconds += time.perf_counter() - start
                self.next_round = t + 1
                phases, events = event.setdefault("phases", {}), [event]
                if self.should_evaluate(t + 1):
                    with timed(phases, "evaluate"):
                        self.evaluate(t + 1, events)
                with timed(phases, "checkpoint"):
                    self.checkpoint()
                for logged in events:
                    log_event(self.run_dir, logged)
                self.status(event)
            history = History(self.records, self.run_dir.path if self.run_dir else None)
            if self.run_dir and self.records:
                from pflego.plots import plot_histories

                plot_histories(
                    {self.cfg.algorithm: history},
                    self.run_dir.path / "curves.png",
                    f"{self.cfg.algorithm} on {self.cfg.dataset} (Flower)",
                )
        return history

    def status(self, event: dict[str, Any]) -> None:
        """Print and log the round's status line (an operator sees a stuck or slow site)."""
        line = status_line(event)
        print(f"pflego: {line}", flush=True)
        log.info("%s", line)


__all__ = ["FlowerServer"]
