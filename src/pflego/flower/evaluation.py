"""A Flower server's evaluation rounds and the run's records they add to ``metrics.jsonl``.

On the simulator's schedule every client's node (or that of each client in the simulator's fixed
sample ``eval_clients``) evaluates its personalized model and answers one row; the server
summarizes the rows as the simulator does and adds what the Flower run knows besides: the clients
evaluated, the SecAgg+ step and largest error bound of the period, the privacy spent, and the
non-finite updates dropped since the last evaluation.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pflego.flower.status import log_event
from pflego.flower.training import TrainingRounds
from pflego.history import RunDir
from pflego.sim import evaluation_due, evaluation_record, evaluation_sample
from pflego.sim.summary import summarize

log = logging.getLogger("pflego.flower")


class EvaluationRounds(TrainingRounds):
    """The evaluation rounds of a Flower server and the records they make.

    Attributes:
        run_dir: Where the run directory is written, or ``None``.
        records: The run's evaluation records so far.
        seconds: Wall seconds spent in training rounds so far.
        next_round: The next training round to run (rounds completed so far).
    """

    run_dir: RunDir | None
    records: list[dict[str, Any]]
    seconds: float
    next_round: int

    def evaluate(self, completed: int, events: list | None = None) -> dict[str, Any] | None:
        """Every client's node (or that of each client in the simulator's fixed sample
        ``eval_clients``) evaluates its personalized model; the server summarizes.

        Its ``flower.jsonl`` event is written at once, or appended to ``events`` when given.
        """
        ctx = self.population.context(self.cfg, self.algorithm, completed)
        self.online()
        sample = evaluation_sample(self.cfg, self.population.num_clients).tolist()
        clients = sorted(set(self.nodes) & set(sample))
        contents = self.contents(clients, ctx, evaluation=True)
        replies, missing = self.exchange(contents, "evaluate", f"evaluate-{completed}")
        for client in sample:
            if client not in replies and client not in missing:
                missing[client] = "its node is offline"
        self.note_missing(completed, "evaluate", missing)
        event = {
            "round": completed,
            "phase": "evaluate",
            "answered": sorted(replies),
            "missing": {str(c): w for c, w in sorted(missing.items())},
        }
        if events is None:
            log_event(self.run_dir, event)
        else:
            events.append(event)
        if not replies:
            log.warning("evaluation after round %d: no node answered", completed)
            return None
        rows = [json.loads(replies[c].content["pflego"]["row"]) for c in sorted(replies)]
        for row, client in zip(rows, sorted(replies)):
            row["client"] = client
        record = evaluation_record(self.cfg, completed, summarize(rows), self.seconds)
        if self.algorithm.adapts:
            record["adapted"] = True
        if len(sample) < self.population.num_clients:
            record["eval_clients"] = len(sample)
        if self.secure is not None:
            record["secagg_step"] = self.secure.step
            record["secagg_error_bound"] = max(self.secure_errors, default=0.0)
            self.secure_errors = []
        if self.privacy is not None:
            record |= self.privacy.record(completed)
        record["dropped"], self.dropped = self.dropped, []
        self.records.append(record)
        if self.run_dir:
            self.run_dir.log(record, rows)
        log.info(
            "round %d: train_loss %.6f test_acc %.4f",
            completed,
            record["train_loss"],
            record["test_acc"],
        )
        return record

    def should_evaluate(self, completed: int) -> bool:
        """Whether the schedule evaluates after ``completed`` rounds (as in the simulator)."""
        return evaluation_due(self.cfg, completed)
