"""What a Flower server reports on each round: its cost, its status line and its event log.

A :class:`MeteredGrid` counts the payload bytes a round sends and receives, :func:`timed` adds up
the wall seconds of each phase (query, downlink, train, aggregate, evaluate, checkpoint), and
:func:`status_line` turns a round's event into the line the server prints and logs (an operator
sees a stuck or slow site). Every event (a round's training and evaluation, a resume, a
divergence) is also appended to ``flower.jsonl`` in the run directory by :func:`log_event`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from pflego.flower.records import payload_bytes
from pflego.history import RunDir

EVENTS = "flower.jsonl"  # the run directory's event log


class MeteredGrid:
    """A grid that counts the payload bytes it sends and receives (for the round status).

    The server's messages, SecAgg+'s included, only go through ``send_and_receive``.
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.down = self.up = 0

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        messages = list(messages)
        self.down += sum(payload_bytes(m.content) for m in messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.up += sum(payload_bytes(r.content) for r in replies if not r.has_error())
        return replies

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()


@contextlib.contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall seconds to ``phases[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = round(phases.get(name, 0.0) + time.perf_counter() - start, 4)


def status_line(event: dict[str, Any]) -> str:
    """``round 3: sampled 4, answered 3, failed 1 (client 2: ...); down 1.2 MB, up ...; ...``."""
    missing = event.get("missing", {})
    failed = "; ".join(f"client {c}: {why}" for c, why in missing.items())
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in event.get("phases", {}).items())
    return (
        f"round {event['round']}: sampled {len(event['sampled'])} of "
        f"{event.get('population', '?')}, answered {len(event.get('answered', []))}, "
        f"failed {len(missing)}"
        + (f" ({failed})" if failed else "")
        + f"; down {event.get('bytes_down', 0) / 1e6:.3f} MB, up "
        f"{event.get('bytes_up', 0) / 1e6:.3f} MB; {phases}"
    )


def log_event(run_dir: RunDir | None, event: dict[str, Any]) -> None:
    """Append ``event`` as one JSON line to the run directory's ``flower.jsonl`` (if any)."""
    if run_dir:
        with (run_dir.path / EVENTS).open("a") as f:
            f.write(json.dumps(event) + "\n")
