"""Backends run the cohort's client updates; the loop backend is the reference.

A backend takes the shared downlink, the cohort's private states stacked on a leading axis and the
cohort's padded round inputs (:class:`~pflego.sim.clients.Cohort`), and returns the stacked
:class:`~pflego.types.ClientOut` and new states.

- ``loop``: one client at a time on its unpadded data, autograd everywhere (the reference);
- ``vmap``: the padded cohort as one ``torch.func.vmap`` call (large batches, GPUs);
- ``graph``: ``vmap`` over static shapes (cohorts padded to a few sizes), captured once per
  shape as a CUDA graph and replayed every round on a GPU (:mod:`pflego.sim.backends_graph`);
- ``fused``: one client at a time on its unpadded data, clients spread over the torch threads,
  and plain SGD on declared losses run as fused steps (:mod:`pflego.fused`): on CPU, each
  client's model stays in its core's cache (vmap streams every client's model through memory at
  every step, and pads ragged clients);
- ``auto``: ``fused`` on CPU when the algorithm's local steps all fuse (one client's update is
  tried on one sample at the start of the run) and clients hold at least
  :data:`FUSED_MIN_SAMPLES` training samples on average, ``graph`` on CUDA, ``vmap`` otherwise
  (or measured: :mod:`pflego.sim.backends_auto`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch.func import vmap
from torch.utils import _pytree as pytree

from pflego import tree
from pflego.algorithms import Algorithm
from pflego.local import fused_steps
from pflego.sim.backends_graph import GraphExecutor
from pflego.sim.clients import Cohort
from pflego.sim.guards import rows
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, Downlink, RoundContext

Backend = Callable[
    [Algorithm, Params, ClientState, Cohort, RoundContext], tuple[ClientOut, ClientState]
]


@dataclass(frozen=True)
class FusedBackend:
    """Clients one at a time on their unpadded data, spread over threads, with fused SGD steps.

    Each client's update runs single-threaded (its model stays in the core's cache for all of its
    steps) inside :func:`~pflego.local.fused_steps`; ``threads`` clients run at once (default:
    ``torch.get_num_threads()``). A client's numbers do not depend on which thread runs it.

    Attributes:
        threads: Clients trained at once (``None``: one per torch thread).
        fused: Run fused steps where they fuse (``False``: autograd everywhere, :data:`loop_backend`).
    """

    threads: int | None = None
    fused: bool = True

    def __call__(
        self,
        algorithm: Algorithm,
        downlink: Params,
        states: ClientState,
        cohort: Cohort,
        ctx: RoundContext,
    ) -> tuple[ClientOut, ClientState]:
        def update(c: int) -> tuple[ClientOut, ClientState]:
            state = {k: v[c] for k, v in states.items()}
            with fused_steps(self.fused):
                own = algorithm.received(downlink).of(c)
                return algorithm.client_update(own, state, cohort.client(c), ctx)

        workers = min(self.threads or torch.get_num_threads(), len(cohort))
        if workers <= 1:
            results = [update(c) for c in range(len(cohort))]
        else:
            results = _in_threads(update, len(cohort), workers)
        return stack_outs([r[0] for r in results]), tree.stack(r[1] for r in results)


#: The reference: ``client_update`` one client at a time on its unpadded data, autograd everywhere.
loop_backend = FusedBackend(threads=1, fused=False)


_pools: dict[int, ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _in_threads(fn: Callable[[int], object], count: int, workers: int) -> list:
    """``[fn(0), ..., fn(count - 1)]`` on ``workers`` threads, each running torch single-threaded."""
    with _pool_lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, "pflego-client")
        pool = _pools[workers]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # process-wide: every worker's kernels run on its own core
        try:
            return list(pool.map(fn, range(count)))
        finally:
            torch.set_num_threads(threads)


@dataclass(frozen=True)
class VmapBackend:
    """The cohort's ``client_update`` as one ``torch.func.vmap`` call over the padded cohort.

    The downlink is shared (``in_dims=None``) or, where the algorithm sends one per client
    (:class:`~pflego.types.Downlink`), mapped like the states and data over their leading axis.
    Padding samples carry a zero mask and padding steps come first with an all-zero batch mask,
    so every client computes exactly what it computes alone. A large cohort of clients of very
    different sizes runs as a few vmap calls over clients of similar sizes (:func:`size_buckets`),
    so little is padded.

    The ``graph`` backend is this one with ``graphs``: each vmap call runs over static shapes
    and, on CUDA, as a replayed CUDA graph (:mod:`pflego.sim.backends_graph`).

    Attributes:
        chunk_size: Clients per vectorized chunk when memory is short (``None``: all at once).
        graphs: The executor of the ``graph`` backend (``None``: plain vmap calls).
    """

    chunk_size: int | None = None
    graphs: GraphExecutor | None = None

    def __call__(
        self,
        algorithm: Algorithm,
        downlink: Params,
        states: ClientState,
        cohort: Cohort,
        ctx: RoundContext,
    ) -> tuple[ClientOut, ClientState]:
        sent = algorithm.received(downlink)
        buckets = size_buckets(cohort.sizes)
        if len(buckets) == 1:
            out, new_states = self.vectorized(algorithm, sent, states, cohort.data, ctx)
            return out, tree.detach(new_states)
        parts = [
            self.vectorized(algorithm, sent.select(b), rows(states, b), cohort.subset(b).data, ctx)
            for b in buckets
        ]
        order = torch.as_tensor(np.argsort(np.concatenate(buckets)), device=cohort.pool.device)
        out, new_states = pytree.tree_map(lambda *bucketed: torch.cat(bucketed)[order], *parts)
        return out, tree.detach(new_states)

    def vectorized(
        self,
        algorithm: Algorithm,
        downlink: Downlink,
        states: ClientState,
        data: ClientData,
        ctx: RoundContext,
    ) -> tuple[ClientOut, ClientState]:
        """One ``vmap`` call of ``client_update`` over clients of similar sizes (and over their
        downlinks where each has its own)."""
        dims = (0 if downlink.per_client else None, 0, 0)

        def update_for(ctx: RoundContext) -> Callable[..., tuple[ClientOut, ClientState]]:
            def update(dl: Params, state: ClientState, data: ClientData):
                return algorithm.client_update(dl, state, data, ctx)

            return vmap(update, in_dims=dims, randomness="different", chunk_size=self.chunk_size)

        inputs = (downlink.payload, states, data)
        if self.graphs is not None:
            return self.graphs(algorithm, update_for, inputs, ctx, downlink.per_client)
        return update_for(ctx)(*inputs)


def size_buckets(sizes: np.ndarray, smallest: int = 64, spread: float = 1.5) -> list[np.ndarray]:
    """Positions of a cohort grouped by size: each group (of at least ``smallest`` clients, but
    the last) spans sizes within a factor ``spread``, so padding to its largest wastes little."""
    order = np.argsort(sizes, kind="stable")
    buckets, start = [], 0
    for end in range(1, len(order) + 1):
        last = end == len(order)
        if last or (
            end - start >= smallest and sizes[order[end]] > spread * max(1, sizes[order[start]])
        ):
            buckets.append(np.sort(order[start:end]))
            start = end
    return buckets


def stack_outs(outs: Sequence[ClientOut]) -> ClientOut:
    """Stack per-client outputs into one ``ClientOut`` with a leading cohort axis."""
    return ClientOut(
        upload=tree.stack(o.upload for o in outs),
        weight=torch.stack([torch.as_tensor(o.weight) for o in outs]),
        metrics=tree.stack(o.metrics for o in outs),
    )


def fuses(
    algorithm: Algorithm, downlink: Params, state: ClientState, data: ClientData, ctx: RoundContext
) -> bool:
    """Whether ``client_update`` runs every local step it takes as fused steps (and some)."""
    with fused_steps() as counts:
        algorithm.client_update(downlink, state, data, ctx)
    return counts.fused > 0 and counts.autograd == 0


#: Clients of fewer training samples than this on average train faster batched under vmap: a
#: separate update's fixed cost (a few milliseconds) outweighs its products.
FUSED_MIN_SAMPLES = 32


def resolve_backend(name: str, device: str | torch.device, fusable: Callable[[], bool]) -> str:
    """The backend ``name`` stands for: ``auto`` is ``graph`` on CUDA, ``fused`` on CPU when
    ``fusable()`` says the algorithm's local steps all fuse (see :func:`fuses`), and ``vmap``
    otherwise."""
    if name != "auto":
        return name
    kind = torch.device(device).type
    if kind == "cuda":
        return "graph"
    return "fused" if kind == "cpu" and fusable() else "vmap"


def make_backend(name: str, algorithm: Algorithm, chunk_size: int | None = None) -> Backend:
    """The named backend; an algorithm that declares itself unvmappable never runs under vmap."""
    vectorized = name in ("vmap", "graph")
    if name == "loop" or (vectorized and not getattr(algorithm, "vmappable", True)):
        return loop_backend
    if name == "fused":
        return FusedBackend()
    return VmapBackend(chunk_size, GraphExecutor() if name == "graph" else None)
