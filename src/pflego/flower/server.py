"""The generic server loop on a Flower ``Grid``: one loop for every registered algorithm.

:class:`FlowerServer` waits for the nodes and learns the population from them
(:mod:`.membership`), or loads it from a checkpoint to resume; then it runs
every training round (:mod:`.training`), evaluates on the simulator's schedule
(:mod:`.evaluation`), checkpoints its state atomically after each round (``checkpoint.pt``, so a
restarted ServerApp continues with ``resume``; nodes keep their clients' states on their disks),
and prints and logs a status line (sampled / answered / failed clients, bytes down and up, seconds
per phase, :mod:`.status`). Its messages to the nodes go through :mod:`.membership`; a run that
Flower cannot do is refused first (:mod:`.unsupported`). Missing nodes never stop the run; a round
that diverges (``DivergedError``) stops it and is logged in ``flower.jsonl`` as phase
``diverged`` (``pflego flower local`` then exits with code 3).

The server is built in layers, each a module of one concern and a base of the next:
:class:`~.membership.Membership` (the population, its nodes, the messages) →
:class:`~.training.TrainingRounds` (the engine's round with Flower transports) →
:class:`~.evaluation.EvaluationRounds` → :class:`FlowerServer` (the run, its checkpoint).

After every round the server saves its state atomically in the run directory: the next round, the
algorithm's server state, the population, the records, the dropped updates, the seconds spent, the
run key and the config. A restarted ServerApp given ``resume`` loads it, rebuilds the algorithm,
rewinds the run directory to the checkpoint and continues (the nodes keep their clients' states on
their disks under the same run key). A simulator checkpoint is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from flwr.serverapp import Grid

from pflego.config import Config, to_dict
from pflego.environment import CHECKPOINT_FORMAT, environment, pflego_version
from pflego.errors import ConfigError, DivergedError
from pflego.flower.evaluation import EvaluationRounds
from pflego.flower.population import Population
from pflego.flower.secure import SecureAggregation
from pflego.flower.status import EVENTS, MeteredGrid, log_event, status_line, timed
from pflego.flower.unsupported import refuse_unsupported
from pflego.history import History, RunDir
from pflego.sim.engine import Callback, Checkpoints, Curves, Evaluate, Tracking, train

log = logging.getLogger("pflego.flower")
CHECKPOINT_KIND = "flower-server"


class FlowerServer(EvaluationRounds):
    """A run's server: the population, the shared state, and the round loop.

    Args:
        config: The run's experiment config (its ``clients`` is how many nodes to wait for).
        grid: Flower's grid (or the in-process grid of tests/flower_inprocess.py).
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
        self.events = []  # the events of the round that ran last

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
        """Form the population, then run every round; evaluate, log and checkpoint on schedule
        (callbacks of the training loop, with the curves and trackers)."""
        self.start()
        cfg, records = self.cfg, self.records
        title = f"{cfg.algorithm} on {cfg.dataset} (Flower)"
        checkpoints = Checkpoints(lambda: self.timed("checkpoint", self.checkpoint), 1, cfg.rounds)
        tracking = [Tracking(self.run_dir, to_dict(cfg), records)] if self.run_dir else []
        curves = [Curves(self.run_dir, records, cfg.algorithm, title)] if self.run_dir else []
        evaluate = Evaluate(
            self.should_evaluate, self.evaluation, [*tracking, checkpoints], records
        )
        callbacks = [*curves, *tracking, evaluate, checkpoints, RoundEvents(self)]
        train(self.next_round, cfg.rounds, self.step, callbacks)
        return History(records, self.run_dir.path if self.run_dir else None)

    def timed(self, phase: str, work: Callable[[], Any]) -> Any:
        """``work()``, timed as ``phase`` into the event of the round that ran last (if any)."""
        with timed(self.events[0].setdefault("phases", {}) if self.events else {}, phase):
            return work()

    def evaluation(self, completed: int) -> dict[str, Any] | None:
        """The evaluation after ``completed`` rounds, timed; its event joins the round's events
        (before the first round, it is logged at once)."""
        return self.timed("evaluate", lambda: self.evaluate(completed, self.events or None))

    def step(self, t: int) -> None:
        """Training round ``t``, timed; its event starts the round's ``events``."""
        start = time.perf_counter()
        try:
            self.events = [self.run_round(t)]
        except DivergedError as exc:  # `pflego flower local` reads it back: exit code 3
            log_event(self.run_dir, {"round": t, "phase": "diverged", "error": str(exc)})
            raise
        self.seconds += time.perf_counter() - start
        self.next_round = t + 1

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed server needs (what ``checkpoint.pt`` holds)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "pflego": pflego_version(),
            "kind": CHECKPOINT_KIND,
            "next_round": self.next_round,
            "server": self.server,
            "population": self.population.state_dict(),
            "records": self.records,
            "dropped": self.dropped,
            "seconds": self.seconds,
            "run_key": self.run_key,
            "config": to_dict(self.cfg),
        }

    def checkpoint(self) -> None:
        """Save the state to the run directory's ``checkpoint.pt`` (if any)."""
        if self.run_dir:
            self.run_dir.save_checkpoint(self.state_dict())

    def load(self) -> None:
        """Continue from the run directory's checkpoint (written by a Flower server)."""
        state = self.run_dir.load_checkpoint()
        if state.get("kind") != CHECKPOINT_KIND:
            raise ConfigError(
                f"{self.run_dir.path} holds a simulator checkpoint; continue it with "
                "`pflego run --resume`"
            )
        self.population = Population.from_state_dict(state["population"])
        self.build()
        self.server = state["server"]
        self.next_round, self.records = state["next_round"], state["records"]
        self.dropped, self.seconds = state["dropped"], state["seconds"]
        self.run_key = state["run_key"]
        if self.cfg.rounds < self.next_round:
            raise ConfigError(
                f"rounds={self.cfg.rounds} is fewer than the {self.next_round} rounds "
                f"{self.run_dir.path} has already run"
            )
        self.run_dir.write_config(to_dict(self.cfg))  # a resumed run may extend its rounds
        self.run_dir.rewind(self.records, self.next_round)
        self.run_dir.record_environment(environment(self.cfg.device, []))
        log_event(self.run_dir, {"round": self.next_round, "phase": "resume"})
        log.info("resuming at round %d of %d", self.next_round, self.cfg.rounds)

    def status(self, event: dict[str, Any]) -> None:
        """Print and log the round's status line (an operator sees a stuck or slow site)."""
        line = status_line(event)
        print(f"pflego: {line}", flush=True)
        log.info("%s", line)


class RoundEvents(Callback):
    """After each round (its evaluation and checkpoint timed into its event): log the round's
    events and print its status line."""

    def __init__(self, server: FlowerServer) -> None:
        self.server = server

    def on_round_end(self, completed: int) -> None:
        for logged in self.server.events:
            log_event(self.server.run_dir, logged)
        self.server.status(self.server.events[0])


__all__ = ["FlowerServer"]
