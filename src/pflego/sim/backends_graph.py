"""``--backend graph``: the cohort's client updates as one vmapped call over static shapes, captured
once per shape as a CUDA graph and replayed every round (on a CPU, the same call runs eagerly).

A vmapped round waits on Python and on kernel launches, not on arithmetic (issue 37: one step of
the PGFed CNN at batch 128 runs at 6% of an H200's float32 peak eager, 24% replayed). A CUDA graph
replays every kernel of the round with one launch, but only on tensors of the shapes it was
captured with, and only if nothing between its first step and its last waits for the host.

Static shapes: each size-bucket of the cohort (:func:`~pflego.sim.backends.size_buckets`) is padded
(:func:`static_inputs`) to a few fixed sizes (:func:`bucket`: 1, 2, 3, 4, 6, 8, 12, ...): clients
(copies of the bucket's first client with all-zero batch masks, so they train nothing, and their
results are dropped), samples, local steps (padding steps first, as
:func:`~pflego.sim.clients.pad_schedules` pads, so they do nothing) and a full batch's width. The
minibatch indices of every step are the cohort's schedules (drawn up front from the run's
generators, seeded by seed, round, client and stream, as every backend draws them), copied into
the graph's input tensors with the rest of the round's inputs; one graph serves every round of the
same shape. The round context enters the graph as the values it was captured with: a method whose
local training reads the round index (``ctx.round``) would need a new graph every round.

No host synchronization: :class:`no_host_sync` makes ``.item()``, ``bool(tensor)``, ``int``,
``float``, ``.tolist()``, ``.numpy()``, ``.cpu()`` and tensors built from host data (an upload to
the device) raise inside the captured call. The first call of each shape runs eagerly (on CUDA on a
side stream, the warm-up capture needs), then the capture runs under that guard, on the CPU the
same check on a second eager call. A method that fails it, or reads ``ctx.round``, falls back to
the plain :class:`~pflego.sim.backends.VmapBackend` for the run, with the reason in
:attr:`GraphExecutor.fallbacks` (docs/gpu.md lists the registered methods that do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pflego.algorithms import Algorithm
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext

Update = Callable[[Params, ClientState, ClientData], tuple[ClientOut, ClientState]]


def bucket(n: int) -> int:
    """The least of 0, 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5 times them) not
    below ``n``: padding to it costs at most half again, and a run meets few of them."""
    if n <= 2:
        return n
    power = 1 << (n - 1).bit_length()
    return 3 * power // 4 if 3 * power // 4 >= n else power


class HostSyncError(RuntimeError):
    """A captured region waited for the device (or uploaded host data to it)."""


#: What :class:`no_host_sync` refuses, by operator, and why it blocks a CUDA graph.
SYNCING_OPS = {
    torch.ops.aten._local_scalar_dense.default: "reads a tensor's value on the host "
    "(.item(), bool(tensor), int(), float(), a Python branch on a tensor)",
    torch.ops.aten.lift_fresh.default: "builds a tensor from host data (torch.tensor, "
    "torch.as_tensor): an upload to the device",
}
#: Tensor methods :class:`no_host_sync` refuses (they read the data without an operator).
SYNCING_METHODS = ("tolist", "numpy", "__array__", "cpu")


class no_host_sync(TorchDispatchMode):  # noqa: N801  (used as a context manager)
    """Within the block, any operation that would wait for the device raises
    :class:`HostSyncError` (see :data:`SYNCING_OPS`, :data:`SYNCING_METHODS`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in SYNCING_OPS:
            raise HostSyncError(f"{func.name()}: {SYNCING_OPS[func]}")
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> no_host_sync:
        self.saved = {name: getattr(Tensor, name) for name in SYNCING_METHODS}
        for name in SYNCING_METHODS:
            setattr(Tensor, name, _refuse(name))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for name, method in self.saved.items():
            setattr(Tensor, name, method)


def _refuse(name: str) -> Callable[..., Any]:
    def refused(*args: object, **kwargs: object) -> Any:
        raise HostSyncError(f"Tensor.{name}: reads a tensor's data on the host")

    return refused


class WatchedContext(RoundContext):
    """A round context that notes whether the round index was read (``round_read``)."""

    def __getattribute__(self, name: str) -> Any:
        if name == "round":
            object.__setattr__(self, "round_read", True)
        return super().__getattribute__(name)


def watched(ctx: RoundContext) -> WatchedContext:
    """``ctx`` as a :class:`WatchedContext` (``round_read`` false)."""
    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(RoundContext)}
    out = WatchedContext(**fields)
    object.__setattr__(out, "round_read", False)
    return out


ROUND_READ = "its local training reads the round index (ctx.round): a new graph every round"


def checked_run(update: Update, inputs: tuple, ctx: WatchedContext) -> tuple[str | None, Any]:
    """``update(*inputs)`` (run under ``ctx``) as the captured region of a CUDA graph would run:
    once eagerly (a warm-up, which may build what later calls reuse), then again under
    :class:`no_host_sync`. Returns why it cannot be captured (``None`` if it can) and the
    outputs of the second run (``None`` if it failed)."""
    update(*inputs)
    if ctx.round_read:
        return ROUND_READ, None
    try:
        with no_host_sync():
            return None, update(*inputs)
    except HostSyncError as exc:
        return f"host synchronization: {exc}", None


def _pad(v: Tensor, dim: int, size: int, front: bool = False) -> Tensor:
    """``v`` padded with zeros along ``dim`` to ``size`` (at the front with ``front``)."""
    extra = size - v.shape[dim]
    if extra <= 0:
        return v
    zeros = v.new_zeros((*v.shape[:dim], extra, *v.shape[dim + 1 :]))
    return torch.cat([zeros, v] if front else [v, zeros], dim)


def _schedule(plan: tuple[Tensor, Tensor], samples: int, width: int, real: Tensor):
    """A schedule ``[C, S, B]`` padded to static steps (in front) and width (a full batch's to
    the padded samples ``width``), its mask zero for the padding clients (``real`` false)."""
    idx, mask = plan
    steps, b = bucket(idx.shape[1]), width if idx.shape[2] == samples else idx.shape[2]
    mask = mask * real.to(mask.dtype).reshape(-1, 1, 1)
    return tuple(_pad(_pad(v, 1, steps, front=True), 2, b) for v in (idx, mask))


def static_inputs(
    downlink: Params, states: ClientState, data: ClientData, per_client: bool
) -> tuple[Params, ClientState, ClientData]:
    """A bucket's inputs padded to static shapes (see the module's docstring): ``bucket(C)``
    clients, the later ones copies of the first with all-zero batch masks."""
    count = data.x.shape[0]
    positions = torch.arange(bucket(count), device=data.x.device)
    real = positions < count
    index = torch.where(real, positions, 0)
    rows = lambda tree: {k: v[index.to(v.device)] for k, v in tree.items()}  # noqa: E731
    samples = data.x.shape[1]
    width = bucket(samples)
    x, y, mask = (_pad(v[index], 1, width) for v in (data.x, data.y, data.mask))
    plan = (data.batches[index], data.batch_mask[index])
    batches, batch_mask = _schedule(plan, samples, width, real)
    schedules = {
        k: _schedule((i[index], m[index]), samples, width, real)
        for k, (i, m) in data.schedules.items()
    }
    held = data.validation
    if held:
        n = bucket(held["x"].shape[1])
        held = {k: _pad(v[index], 1, n) for k, v in held.items()}
    padded = ClientData(
        x=x,
        y=y,
        mask=mask,
        batches=batches,
        batch_mask=batch_mask,
        label_mask=data.label_mask[index],
        num_samples=data.num_samples[index],
        schedules=schedules,
        validation=held,
    )
    return (rows(downlink) if per_client else downlink), rows(states), padded


def shape_key(inputs: tuple, ctx: RoundContext) -> tuple:
    """What a captured graph is valid for: the inputs' structure, shapes and dtypes and the
    round context but its index (a graph closes over the context's values)."""
    leaves, spec = pytree.tree_flatten(inputs)
    shapes = tuple((tuple(v.shape), v.dtype, v.device) for v in leaves)
    return str(spec), shapes, dataclasses.replace(ctx, round=0)


class Replay:
    """``update`` captured as a CUDA graph on static copies of ``inputs``; a call copies new
    inputs of the same shapes into them, replays the graph and returns clones of its outputs.

    Args:
        update: The vmapped client update.
        inputs: The first inputs (their shapes are the graph's).
        pool: A memory pool the backend's graphs share (outputs are cloned at once, and graphs
            replay one at a time, so none reads another's memory).
    """

    def __init__(self, update: Update, inputs: tuple, pool: Any) -> None:
        self.inputs = pytree.tree_map(torch.clone, inputs)
        self.graph = torch.cuda.CUDAGraph()
        with no_host_sync(), torch.cuda.graph(self.graph, pool=pool):
            self.outputs = update(*self.inputs)

    def __call__(self, inputs: tuple) -> tuple[ClientOut, ClientState]:
        for static, new in zip(pytree.tree_leaves(self.inputs), pytree.tree_leaves(inputs)):
            static.copy_(new)
        self.graph.replay()
        return pytree.tree_map(torch.clone, self.outputs)


def warmed_up(update: Update, inputs: tuple) -> None:
    """Run ``update`` eagerly on a side stream, as a capture needs before it (lazy
    initializations, autograd's streams)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        update(*inputs)
    torch.cuda.current_stream().wait_stream(side)


class GraphExecutor:
    """Runs vmapped client updates over static shapes, replayed as CUDA graphs (the ``graph``
    backend: a :class:`~pflego.sim.backends.VmapBackend` that hands it each of its calls).

    Each call's inputs are padded to static shapes (:func:`static_inputs`); on CUDA the update of
    each shape is captured once (:class:`Replay`) and replayed; elsewhere it runs eagerly, its
    first call checked as a capture would be (:func:`checked_run`). A method whose update cannot
    be captured runs as plain ``vmap`` for the run.

    Attributes:
        fallbacks: Why a method runs as plain ``vmap`` here (by its registered name).
        graphs: The captured CUDA graphs, by :func:`shape_key`.
        checked: The methods whose update passed :func:`checked_run` (off CUDA).
        pool: The CUDA memory pool the graphs share (created with the first).
    """

    def __init__(self) -> None:
        self.fallbacks: dict[str, str] = {}
        self.graphs: dict[tuple, Replay] = {}
        self.checked: set[str] = set()
        self.pool: Any = None

    def __call__(
        self,
        algorithm: Algorithm,
        update_for: Callable[[RoundContext], Update],
        inputs: tuple[Params, ClientState, ClientData],
        ctx: RoundContext,
        per_client: bool,
    ) -> tuple[ClientOut, ClientState]:
        """``update_for(ctx)(*inputs)``: the vmapped update of ``algorithm`` under ``ctx``
        (``per_client``: the downlink payload is stacked per client)."""
        name = getattr(type(algorithm), "name", type(algorithm).__name__)
        if name in self.fallbacks:
            return update_for(ctx)(*inputs)
        count = inputs[2].x.shape[0]
        static = static_inputs(*inputs, per_client)
        key = shape_key(static, ctx)
        if key in self.graphs:
            out, new_states = self.graphs[key](static)
        elif static[2].x.device.type == "cuda":
            reason = self.capture(update_for, static, ctx, key)
            if reason is not None:
                self.fallbacks[name] = reason
                return update_for(ctx)(*inputs)
            out, new_states = self.graphs[key](static)
        elif name in self.checked:  # off CUDA: eager, on the same static shapes
            out, new_states = update_for(ctx)(*static)
        else:
            seen = watched(ctx)
            reason, result = checked_run(update_for(seen), static, seen)
            if reason is not None:
                self.fallbacks[name] = reason
                return update_for(ctx)(*inputs)
            self.checked.add(name)
            out, new_states = result
        return pytree.tree_map(lambda v: v[:count], (out, new_states))

    def capture(
        self,
        update_for: Callable[[RoundContext], Update],
        inputs: tuple,
        ctx: RoundContext,
        key: tuple,
    ) -> str | None:
        """Capture the update of a new shape into :attr:`graphs` after an eager warm-up: why it
        cannot be, or ``None``."""
        seen = watched(ctx)
        warmed_up(update_for(seen), inputs)
        if seen.round_read:
            return ROUND_READ
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            self.graphs[key] = Replay(update_for(ctx), inputs, self.pool)
        except HostSyncError as exc:
            return f"host synchronization: {exc}"
        except RuntimeError as exc:  # a capture CUDA refuses
            return f"capture failed: {type(exc).__name__}: {str(exc)[:200]}"
        return None
