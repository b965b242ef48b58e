"""The population a Flower server learns from its nodes, and the task every node must fit.

The server never loads data. In a first ``query`` round every node reports its client (a stable
name, its sample counts, its label set and input shape; never a sample), from which the server
forms the **task** (input shape, label space, K_max; each from the run config where declared
there) and the **population** (client ids 0..I-1 in name order, each N_i, N = sum N_i). A late
joiner whose data fits the task is appended with the next id: from that round on every weight is
alpha_i = N_i / N' over the population known in that round, so each round's step estimates the
gradient of that population's objective L_t = sum_{i known at t} (N_i / N_t) l_i. The task never
changes. ``docs/flower.md`` ("A server without data") has the details.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Self

from pflego.errors import ConfigError, DataError


def natural_key(text: str) -> list[Any]:
    """Sort key that orders embedded numbers by value (``site2`` before ``site10``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def label_space(label_sets: Iterable[Iterable[str]]) -> tuple[str, ...]:
    """The run's label space from the labels the clients hold.

    Integer labels (``0``, ``7``) give ``0..max``, so a label's global id is its value; other
    names are sorted naturally.
    """
    names = set().union(*(set(s) for s in label_sets))
    if not names:
        return ()
    if all(n.isdigit() for n in names):
        return tuple(str(k) for k in range(max(int(n) for n in names) + 1))
    return tuple(sorted(names, key=natural_key))


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,28,28"`` as ``(1, 28, 28)``, with a one-line error naming the setting."""
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise ConfigError(f"input-shape={text!r} must be positive integers, e.g. 1,28,28")
    return shape


class Record:
    """A dataclass that travels as a Flower ``ConfigRecord`` and in checkpoints: its fields, with
    tuples as lists."""

    def to_record(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}

    @classmethod
    def from_record(cls, record: Any) -> Self:
        """Inverse of :meth:`to_record`; fields the record lacks keep their defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()}
        return cls(**{k: v for k, v in values.items() if k in names})


@dataclass(frozen=True)
class Task(Record):
    """What every client's data must fit: the model's input and the run's label space.

    Attributes:
        input_shape: Shape of one model input (without the batch axis).
        labels: The run's label space; a label's global id is its position.
        max_classes: K_max, the largest number of classes a client may hold (personal heads
            over local classes have this width).
    """

    input_shape: tuple[int, ...]
    labels: tuple[str, ...]
    max_classes: int

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def misfit(self, report: Report) -> str | None:
        """Why a client's data does not fit this task, or ``None`` when it does."""
        if tuple(report.input_shape) != self.input_shape:
            return (
                f"its inputs have shape {tuple(report.input_shape)} but the model takes "
                f"{self.input_shape}"
            )
        held = set(report.labels) | set(report.other_labels)
        unknown = sorted(held - set(self.labels), key=natural_key)
        if unknown:
            shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            return (
                f"its labels {shown} are not in the run's label space of {self.num_classes} labels"
            )
        if len(report.labels) > self.max_classes:
            return (
                f"it holds {len(report.labels)} classes but personal heads have "
                f"K_max = {self.max_classes}"
            )
        if report.n_train < 1:
            return "it has no training samples"
        return None

    def check(self, report: Report) -> None:
        """Raise a one-line ``DataError`` when ``report`` does not fit."""
        why = self.misfit(report)
        if why is not None:
            raise DataError(f"the data of {report.site} does not fit this run: {why}")


@dataclass(frozen=True)
class Report(Record):
    """What a node says about its client in the ``query`` round (counts and names, no samples).

    Attributes:
        site: The client's stable name (partition mode: ``partition-<i>``).
        n_train: N_i, its training samples.
        n_test: Its test samples.
        labels: The labels of its training split (names): its classes, the outputs of its
            personal head.
        input_shape: Shape of one of its inputs.
        num_classes: Partition mode: the dataset's label count C (0 for site data).
        max_classes: Partition mode: the partition's K_max (0 for site data).
        other_labels: Labels only its test or validation split holds (their samples count as
            errors, as in the simulator; they must still be in the run's label space).
    """

    site: str
    n_train: int
    n_test: int
    labels: tuple[str, ...]
    input_shape: tuple[int, ...]
    num_classes: int = 0
    max_classes: int = 0
    other_labels: tuple[str, ...] = ()


def form_task(
    reports: Sequence[Report], input_shape: str = "", labels: str = "", max_classes: int = 0
) -> Task:
    """The run's task from its declared parts (run config) and the nodes' first reports.

    Undeclared parts come from the reports: the input shape most nodes report (ties: the first
    in name order), the label space of every reported label (or the dataset's C labels in
    partition mode) and K_max, the largest label set (or the partition's).
    """
    if input_shape:
        shape = parse_shape(input_shape)
    else:
        shapes = [tuple(r.input_shape) for r in reports]
        shape = max(shapes, key=lambda s: (shapes.count(s), -shapes.index(s)))
    if labels:
        names = tuple(n.strip() for n in labels.split(",") if n.strip())
        if len(set(names)) != len(names):
            raise ConfigError(f"label-names={labels!r} names a label twice")
    fitting = [r for r in reports if tuple(r.input_shape) == shape]
    if not labels:
        declared = max((r.num_classes for r in fitting), default=0)
        names = label_space([r.labels for r in fitting] + [r.other_labels for r in fitting])
        if declared:
            names = label_space([names, [str(declared - 1)]])
    if not names:
        raise ConfigError("no node reported any label; give the run's labels (label-names=...)")
    width = max_classes or max([r.max_classes for r in fitting] + [len(r.labels) for r in fitting])
    return Task(shape, names, width)


@dataclass
class Member(Record):
    """A client of the population: its name, counts, labels and the round it joined."""

    site: str
    n_train: int
    n_test: int
    labels: tuple[str, ...]
    joined: int


class Population:
    """The clients a Flower server knows, their sample counts, and the round maths over them.

    ``num_clients`` (I) and ``total_train`` (N) are what the simulator's :class:`~pflego.sim.engine.
    Sampling` reads, so a round's context and cohort are the simulator's for the same population.
    """

    def __init__(self, task: Task) -> None:
        self.task = task
        self.members: list[Member] = []

    @property
    def num_clients(self) -> int:
        return len(self.members)

    @property
    def total_train(self) -> int:
        return sum(m.n_train for m in self.members)

    def client_of(self, site: str) -> int | None:
        """The client id of ``site``, or ``None`` when it is not a member."""
        return next((i for i, m in enumerate(self.members) if m.site == site), None)

    def add(self, reports: Iterable[Report], round_: int) -> dict[str, int | str]:
        """Add the reporting clients that fit the task (in name order) and are new.

        Returns, per reported site, its client id or why it was left out.
        """
        outcome: dict[str, int | str] = {}
        for report in sorted(reports, key=lambda r: natural_key(r.site)):
            known = self.client_of(report.site)
            why = self.task.misfit(report)
            if known is not None:
                outcome[report.site] = known
            elif why is not None:
                outcome[report.site] = why
            else:
                self.members.append(
                    Member(report.site, report.n_train, report.n_test, tuple(report.labels), round_)
                )
                outcome[report.site] = len(self.members) - 1
        return outcome

    def summary(self) -> list[dict[str, Any]]:
        """``partition.json`` rows: each client's name, classes (global ids) and counts."""
        ids = {name: k for k, name in enumerate(self.task.labels)}
        return [
            {
                "client": i,
                "site": m.site,
                "classes": sorted(ids[n] for n in m.labels),
                "train": m.n_train,
                "test": m.n_test,
                "joined": m.joined,
            }
            for i, m in enumerate(self.members)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"task": self.task.to_record(), "members": [m.to_record() for m in self.members]}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Population:
        population = cls(Task.from_record(state["task"]))
        population.members = [Member.from_record(m) for m in state["members"]]
        return population
