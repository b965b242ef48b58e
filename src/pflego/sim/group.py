"""This process's place in a torch.distributed group, and the few collectives a distributed run
uses: rows of tensors gathered in cohort order, Python objects gathered, broadcast or scattered,
and errors agreed on so that every process stops with the same one line.

Tensors travel on the device they live on (gloo on CPU, NCCL on CUDA); Python objects (evaluation
rows, checkpoint parts) travel through gloo on the host. The group is set up from torch's
environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), which ``torchrun`` and torch's elastic launcher set.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from pflego.errors import ConfigError, PflegoError

T = TypeVar("T")

#: The variables torch.distributed's ``env://`` initialization reads.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a group that ``torchrun`` (or another launcher that
    sets torch's environment variables) started."""
    return all(name in os.environ for name in RANK_VARIABLES)


def check_nproc(nproc: int | None) -> None:
    """Refuse a process count below 1, or one given to a process that torchrun started."""
    if nproc is None:
        return
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be a whole number of processes, at least 1")
    if nproc > 1 and launched_by_torchrun():
        raise ConfigError(
            f"--nproc {nproc} inside a process torchrun started: give torchrun the process "
            "count (--nproc-per-node) and leave out --nproc"
        )


@dataclass(frozen=True)
class Group:
    """This process's rank among ``world`` processes (``local_rank`` on its machine).

    A client's state lives in the process ``client % world`` (:meth:`owner`).
    """

    rank: int
    world: int
    local_rank: int
    backend: str

    @classmethod
    def start(cls, device_type: str = "cpu") -> Group:
        """Join the process group that torch's environment variables describe: gloo for runs on
        the CPU; on CUDA, NCCL for tensors beside gloo for host objects."""
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        return cls(rank, world, int(os.environ.get("LOCAL_RANK", rank)), backend)

    @staticmethod
    def close() -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def first(self) -> bool:
        """Whether this is rank 0, the process that writes the run directory."""
        return self.rank == 0

    def owner(self, clients: np.ndarray) -> np.ndarray:
        """The rank that holds each client's state."""
        return np.asarray(clients, np.int64) % self.world

    def owned(self, clients: np.ndarray) -> np.ndarray:
        """Those of ``clients`` whose states this process holds, in their order."""
        clients = np.asarray(clients, np.int64)
        return clients[self.owner(clients) == self.rank]

    # --- Python objects (through the host) -------------------------------------------------------

    def all_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def to_first(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0 (in rank order); ``None`` elsewhere."""
        values: list[Any] | None = [None] * self.world if self.first else None
        dist.gather_object(value, values, dst=0)
        return values

    def from_first(self, values: list[Any] | None) -> Any:
        """Rank 0's ``values[r]`` on each rank ``r``."""
        box: list[Any] = [None]
        dist.scatter_object_list(box, values if self.first else None, src=0)
        return box[0]

    def together(self, work: Callable[[], T]) -> T:
        """``work()`` on every rank; a ``PflegoError`` on any rank is raised on all of them (the
        lowest rank's), so that every process stops with the same line instead of waiting."""
        try:
            value, error = work(), None
        except PflegoError as exc:
            value, error = None, exc
        raised = [e for e in self.all_objects(error) if e is not None]
        if raised:
            raise raised[0]
        return value  # type: ignore[return-value]

    def decided(self, work: Callable[[], T]) -> T:
        """``work()`` on rank 0 alone, its result (or its ``PflegoError``) on every rank."""
        value, error = None, None
        if self.first:
            try:
                value = work()
            except PflegoError as exc:
                error = exc
        box = [(value, error)]
        dist.broadcast_object_list(box, src=0)
        value, error = box[0]
        if error is not None:
            raise error
        return value

    # --- tensors (on their device) ---------------------------------------------------------------

    def rows(
        self,
        part: dict[str, Tensor],
        owners: np.ndarray,
        device: torch.device,
        error: PflegoError | None = None,
    ) -> dict[str, Tensor]:
        """Stacked rows held across the ranks, joined in their order on every rank.

        Row ``c`` of the result comes from rank ``owners[c]``, whose ``part`` stacks its rows in
        their order. All rows travel as one tensor of their raw bytes; values are copied
        exactly. A rank that could not make its part passes the ``error`` instead, which every
        rank then raises.
        """
        if len(owners) == 0:
            return {}
        counts = np.bincount(owners, minlength=self.world)
        layouts = self.all_objects(error or (layout(part) if counts[self.rank] else None))
        raised = [e for e in layouts if isinstance(e, PflegoError)]
        if raised:
            raise raised[0]
        spec = next(s for s in layouts if s is not None)
        positions = np.concatenate([np.flatnonzero(owners == r) for r in range(self.world)])
        order = torch.from_numpy(np.argsort(positions, kind="stable")).to(device)
        mine, most = int(counts[self.rank]), int(counts.max())
        keys = sorted(spec)
        widths = [int(np.prod(spec[k][0], dtype=np.int64)) * spec[k][1].itemsize for k in keys]
        buffer = torch.zeros(most, sum(widths), dtype=torch.uint8, device=device)
        if mine and keys:  # every row's tensors as raw bytes, side by side
            flat = [part[k].to(device).contiguous().reshape(mine, -1) for k in keys]
            buffer[:mine] = torch.cat([v.view(torch.uint8) for v in flat], 1)
        received = [torch.empty_like(buffer) for _ in range(self.world)]
        dist.all_gather(received, buffer)
        table = torch.cat([received[r][: counts[r]] for r in range(self.world)])[order]
        return {
            k: fresh(block).view(spec[k][1]).reshape(len(owners), *spec[k][0])
            for k, block in zip(keys, table.split(widths, 1), strict=True)
        }


def fresh(block: Tensor) -> Tensor:
    """A contiguous copy at the start of its own memory (bytes viewed as a wider dtype must be
    aligned to it)."""
    return block.clone(memory_format=torch.contiguous_format)


def layout(part: dict[str, Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each stacked tensor's row shape and dtype."""
    return {k: (tuple(v.shape[1:]), v.dtype) for k, v in part.items()}
