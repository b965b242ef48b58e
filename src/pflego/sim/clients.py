"""Per-round client inputs (data and minibatch schedules) and the client state store.

The round loop never builds per-sample Python objects. Every client's data is placed on the target
device once (:class:`ClientPool`, rows of one concatenated tensor), and a round gathers its cohort
as padded, stacked :class:`~pflego.types.ClientData` (:class:`Cohort`) with a handful of indexing
operations. Private client state lives in a stacked host-side :class:`ClientStore`; only the cohort
is copied to the device. A generated population's pools (:class:`GeneratedPool`) make small
``ClientPool``\\ s of just the clients asked (the population itself: :mod:`pflego.data.stream`).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from pflego.config import MAX_COUNT
from pflego.data import FederatedData
from pflego.data.stream import GeneratedClients
from pflego.errors import ConfigError
from pflego.types import ClientData, ClientState, Schedule

RngFor = Callable[[int, int], np.random.Generator]


def schedule(
    n: int,
    inner_steps: int,
    batch_size: int | None,
    local_epochs: float | None,
    rng: np.random.Generator,
) -> tuple[Tensor, Tensor]:
    """Minibatch indices ``[S, B]`` and mask for one client's local steps.

    Full batch (``batch_size`` unset): every step sees all ``n`` samples. Minibatches: the samples
    are reshuffled each epoch and cut into batches of ``batch_size`` (the last one smaller). The
    number of steps is ``inner_steps``, or ``ceil(local_epochs * n / batch_size)`` when
    ``local_epochs`` is set.
    """
    width = n if batch_size is None or batch_size >= n else batch_size
    per_epoch = math.ceil(n / width) if width < n else 1
    steps = inner_steps if local_epochs is None else max(1, math.ceil(local_epochs * per_epoch))
    if steps * width > MAX_COUNT:
        raise ConfigError(
            f"local_epochs={local_epochs} (or join_epochs) gives {float(steps):.3g} local steps "
            f"of {width} samples (at most {MAX_COUNT} in all); lower it"
        )
    if width == n:
        return torch.arange(n).repeat(steps, 1), torch.ones(steps, n)
    epochs = math.ceil(steps / per_epoch)
    slots = np.full((epochs, per_epoch * width), -1, np.int64)
    for e in range(epochs):  # one permutation per epoch, drawn in order
        slots[e, :n] = rng.permutation(n)
    slots = slots.reshape(epochs * per_epoch, width)[:steps]
    mask = slots >= 0
    return torch.from_numpy(np.where(mask, slots, 0)), torch.from_numpy(mask.astype(np.float32))


def client_schedules(
    n: int, run: Schedule, extra: dict[str, Schedule], rng_for: Callable[[int], np.random.Generator]
) -> tuple[tuple[Tensor, Tensor], dict[str, tuple[Tensor, Tensor]]]:
    """One client's run schedule and extra named schedules; ``rng_for(stream)`` shuffles each."""
    main = schedule(n, *run, rng_for(0))
    named = {
        name: schedule(n, *extra[name], rng_for(k + 1)) for k, name in enumerate(sorted(extra))
    }
    return main, named


def client_data(
    data: FederatedData,
    client: int,
    label_space: str,
    batches: tuple[Tensor, Tensor],
    dtype: torch.dtype,
    schedules: dict[str, tuple[Tensor, Tensor]] | None = None,
    validation: bool = False,
) -> ClientData:
    """One client's training data for a round, as the algorithm sees it (unpadded).

    With ``validation``, ``ClientData.validation`` holds the client's validation split (its
    training split when the partition has none, see :func:`validation_split`).
    """
    one = data.subset(np.array([client]))
    pool = lambda split: ClientPool.build(one, split, label_space, dtype)  # noqa: E731
    with_dtype = lambda plan: [(plan[0], plan[1].to(dtype))]  # noqa: E731
    named = {k: with_dtype(plan) for k, plan in (schedules or {}).items()}
    held_out = pool(validation_split(data)) if validation else None
    return Cohort(
        np.zeros(1, np.int64), pool("train"), with_dtype(batches), named, held_out
    ).client(0)


def validation_split(data: FederatedData) -> str:
    """The split an algorithm with ``uses_validation`` validates on: ``val``, else ``train``."""
    return "val" if data.val_offsets is not None else "train"


@dataclass(frozen=True)
class Cohort:
    """The sampled clients' round inputs.

    :meth:`client` is one client's own data, unpadded: views of the pool's rows and its own
    schedules (what the loop and fused backends run on, with no copy). :attr:`data` stacks and
    pads them all, built on first use (the vmap backend): ``x [C, n_max, ...]``,
    ``batches [C, S_max, B_max]``; client ``c`` really has ``sizes[c]`` samples and runs
    ``steps[c]`` steps, its padding steps first (they do nothing).

    Attributes:
        clients: The sampled client ids.
        pool: The training pool the rows come from.
        run: Each client's ``(batches [s, b], batch_mask [s, b])`` of the run's schedule.
        named: The same for each of the algorithm's extra named schedules.
        validation: The pool of ``data.validation`` rows, if the algorithm validates.
    """

    clients: np.ndarray
    pool: ClientPool
    run: list[tuple[Tensor, Tensor]]
    named: dict[str, list[tuple[Tensor, Tensor]]] = dataclasses.field(default_factory=dict)
    validation: ClientPool | None = None

    def __len__(self) -> int:
        return len(self.clients)

    @property
    def sizes(self) -> np.ndarray:
        return self.pool.sizes[self.clients]

    @property
    def steps(self) -> np.ndarray:
        return np.array([idx.shape[0] for idx, _ in self.run], np.int64)

    def client(self, c: int) -> ClientData:
        """Client ``c``'s data with no padding (views of the pool's rows)."""
        i = int(self.clients[c])
        x, y = self.pool.own(i)
        batches, batch_mask = self.run[c]
        held_out = {}
        if self.validation is not None:
            vx, vy = self.validation.own(i)
            held_out = {"x": vx, "y": vy, "mask": vx.new_ones(len(vy))}
        return ClientData(
            x=x,
            y=y,
            mask=torch.ones(len(y), dtype=x.dtype, device=x.device),
            batches=batches,
            batch_mask=batch_mask,
            label_mask=self.pool.label_masks[i],
            num_samples=torch.tensor(float(len(y)), dtype=x.dtype, device=x.device),
            schedules={name: plans[c] for name, plans in self.named.items()},
            validation=held_out,
        )

    def subset(self, positions: np.ndarray) -> Cohort:
        """The cohort of the clients at ``positions`` (in that order)."""
        return Cohort(
            self.clients[positions],
            self.pool,
            [self.run[c] for c in positions],
            {k: [v[c] for c in positions] for k, v in self.named.items()},
            self.validation,
        )

    @cached_property
    def data(self) -> ClientData:
        """Every client's data stacked and padded on a leading cohort axis."""
        x, y, mask = self.pool.padded(self.clients)
        ids = torch.as_tensor(self.clients, device=self.pool.device)
        held_out = {}
        if self.validation is not None:
            vx, vy, vmask = self.validation.padded(self.clients)
            held_out = {"x": vx, "y": vy, "mask": vmask}
        batches, batch_mask = pad_schedules(self.run, x.dtype)
        return ClientData(
            x=x,
            y=y,
            mask=mask,
            batches=batches,
            batch_mask=batch_mask,
            label_mask=self.pool.label_masks[ids],
            num_samples=torch.as_tensor(self.sizes, dtype=x.dtype, device=self.pool.device),
            schedules={k: pad_schedules(v, x.dtype) for k, v in self.named.items()},
            validation=held_out,
        )


def pad_schedules(plans: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-client schedules stacked as ``[C, S_max, B_max]``, padding steps first."""
    s_max = max(idx.shape[0] for idx, _ in plans)
    b_max = max(idx.shape[1] for idx, _ in plans)
    device = plans[0][0].device
    idx = torch.zeros((len(plans), s_max, b_max), dtype=torch.int64, device=device)
    mask = torch.zeros((len(plans), s_max, b_max), dtype=dtype, device=device)
    for c, (i, m) in enumerate(plans):
        s, b = i.shape
        idx[c, s_max - s :, :b], mask[c, s_max - s :, :b] = i, m
    return idx, mask


@dataclass(frozen=True)
class ClientPool:
    """Every client's samples of one split, on the target device, as rows of one tensor.

    Client ``i`` owns rows ``offsets[i]:offsets[i] + sizes[i]``.

    Attributes:
        x: Model inputs ``[N, ...]`` in the run's dtype.
        y: Labels ``[N]`` in the algorithm's label space.
        offsets: First row of each client ``[I]`` (device).
        sizes: Samples per client ``[I]`` (host, for shapes).
        label_masks: ``[I, K]``, which logits each client's head has.
        known: Samples per client whose class its head has (label >= 0) ``[I]`` (host).
    """

    x: Tensor
    y: Tensor
    offsets: Tensor
    sizes: np.ndarray
    label_masks: Tensor
    known: np.ndarray

    @classmethod
    def build(
        cls,
        data: FederatedData,
        split: str,
        label_space: str,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> ClientPool:
        """Convert and move a split (``train`` or ``test``) to ``device`` once."""
        local = label_space == "local"
        x = getattr(data, f"x_{split}")
        y = getattr(data, f"y_{split}_local" if local else f"y_{split}")
        if local:
            masks = (data.client_classes >= 0).to(dtype)
        else:
            masks = torch.ones(data.num_clients, data.num_classes, dtype=dtype)
        sizes = getattr(data, f"{split}_offsets").diff().numpy()
        return cls.of(data.inputs(x).to(device=device, dtype=dtype), y.to(device), sizes, masks)

    @classmethod
    def of(cls, x: Tensor, y: Tensor, sizes: np.ndarray, label_masks: Tensor) -> ClientPool:
        """The pool of clients whose rows of ``x`` and ``y`` follow one another, ``sizes[i]``
        rows each (label masks ``[I, K]``)."""
        sizes = np.asarray(sizes, np.int64)
        owner = np.repeat(np.arange(len(sizes)), sizes)
        return cls(
            x=x,
            y=y,
            offsets=torch.from_numpy(np.cumsum(sizes) - sizes).to(x.device),
            sizes=sizes,
            label_masks=label_masks.to(x.device),
            known=np.bincount(owner[(y >= 0).cpu().numpy()], minlength=len(sizes)),
        )

    @property
    def device(self) -> torch.device:
        return self.x.device

    @cached_property
    def starts(self) -> np.ndarray:
        """First row of each client, on the host."""
        return self.offsets.cpu().numpy()

    def rows(self, clients: np.ndarray) -> tuple[Tensor, Tensor]:
        """Row indices ``[C, n_max]`` of the clients' samples (padding points at row 0) and mask."""
        sizes = self.sizes[clients]
        n_max = int(sizes.max()) if len(sizes) else 0
        ids = torch.as_tensor(clients, device=self.device)
        positions = torch.arange(n_max, device=self.device)
        valid = positions < torch.as_tensor(sizes, device=self.device).unsqueeze(1)
        rows = torch.where(valid, self.offsets[ids].unsqueeze(1) + positions, 0)
        return rows, valid

    def padded(self, clients: np.ndarray) -> tuple[Tensor, Tensor, Tensor]:
        """The clients' inputs ``[C, n_max, ...]``, labels ``[C, n_max]`` and sample mask."""
        rows, valid = self.rows(clients)
        return take(self.x, rows), self.y[rows], valid.to(self.x.dtype)

    def select(self, clients: np.ndarray, keep: Callable[[int, int], np.ndarray] | None = None):
        """A pool of just ``clients`` (renumbered in that order; their rows copied).

        ``keep(i, n)``, if given, picks which of client ``i``'s ``n`` rows to keep.
        """
        clients = np.asarray(clients, np.int64)
        parts = []
        for i in clients:
            rows = np.arange(self.starts[i], self.starts[i] + self.sizes[i])
            parts.append(rows if keep is None else rows[keep(int(i), len(rows))])
        rows = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))
        rows = rows.to(self.device)
        sizes = np.array([len(part) for part in parts], np.int64)
        masks = self.label_masks[torch.as_tensor(clients, device=self.device)]
        return ClientPool.of(self.x[rows], self.y[rows], sizes, masks)

    def own(self, client: int) -> tuple[Tensor, Tensor]:
        """One client's inputs and labels (views, no copy)."""
        start = int(self.starts[client])
        rows = slice(start, start + int(self.sizes[client]))
        return self.x[rows], self.y[rows]

    def cohort(
        self,
        clients: np.ndarray,
        run: Schedule,
        rng_for: RngFor,
        extra: dict[str, Schedule] | None = None,
        validation: ClientPool | None = None,
    ) -> Cohort:
        """The cohort's round inputs (each client's own, padded and stacked on demand).

        Args:
            clients: Sampled client ids.
            run: The run's local schedule (``data.batches``).
            rng_for: ``rng_for(i, stream)`` shuffles client ``i``'s minibatches of the run's
                schedule (stream 0) and of the extra schedules (1, 2, ... by sorted name).
            extra: The algorithm's extra named schedules (``data.schedules``).
            validation: The pool whose rows become ``data.validation``.
        """
        clients = np.asarray(clients)
        runs, named = [], {name: [] for name in sorted(extra or {})}
        for i, n in zip(clients, self.sizes[clients]):
            rng = lambda stream, i=int(i): rng_for(i, stream)  # noqa: E731
            main, extras = client_schedules(int(n), run, extra or {}, rng)
            runs.append(self.on_device(main))
            for name, plan in extras.items():
                named[name].append(self.on_device(plan))
        return Cohort(clients, self, runs, named, validation)

    def on_device(self, plan: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """A schedule's batches and mask on the pool's device (the mask in its dtype)."""
        return plan[0].to(self.device), plan[1].to(self.device, self.x.dtype)


def take(x: Tensor, rows: Tensor) -> Tensor:
    """``x[rows]`` for an index tensor ``rows`` of any shape: one ``index_select`` of whole
    rows, about twice as fast as advanced indexing with a 2-D index on a CPU (kept for an empty
    or non-contiguous ``x``, which ``reshape`` would copy whole)."""
    if len(x) == 0 or not x.is_contiguous():
        return x[rows]
    flat = x.reshape(len(x), -1).index_select(0, rows.reshape(-1))
    return flat.view(*rows.shape, *x.shape[1:])


class GeneratedPool:
    """One split of a generated population; :meth:`select` makes a small ``ClientPool``.

    Client ids given to :meth:`cohort` are the population's; the selected pool numbers them
    ``0..len(ids)-1``.
    """

    def __init__(
        self,
        data: GeneratedClients,
        split: str,
        label_space: str,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.data, self.split, self.label_space = data, split, label_space
        self.dtype, self.device = dtype, torch.device(device)
        self.sizes = data.train_counts if split == "train" else data.test_counts

    def select(self, ids: np.ndarray, keep: Callable[[int, int], np.ndarray] | None = None):
        """A ``ClientPool`` of the clients ``ids`` (renumbered in that order); ``keep(i, n)``,
        if given, picks which of client ``i``'s ``n`` samples of the split to keep."""
        ids = np.asarray(ids, np.int64)
        xs, ys, masks = [], [], []
        width = self.data.num_classes
        for i, (x, y) in zip(ids, self.data.clients(ids)):
            n_train = int(self.data.train_counts[i])
            part = np.arange(n_train) if self.split == "train" else np.arange(n_train, len(y))
            if keep is not None:
                part = part[keep(int(i), len(part))]
            labels = y[part]
            mask = np.ones(width, np.float32)
            if self.label_space == "local":  # renumber within the client's training classes
                classes = np.unique(y[:n_train])
                at = np.minimum(np.searchsorted(classes, labels), len(classes) - 1)
                labels = np.where(classes[at] == labels, at, -1)  # -1: a class it never trained on
                mask[len(classes) :] = 0
            xs.append(x[part])
            ys.append(labels)
            masks.append(mask)
        dim = self.data.input_shape
        x = np.concatenate(xs) if xs else np.zeros((0, *dim), np.float32)
        y = np.concatenate(ys) if ys else np.zeros(0, np.int64)
        return ClientPool.of(
            torch.from_numpy(x).to(self.device, self.dtype),
            torch.from_numpy(y.astype(np.int64)).to(self.device),
            np.array([len(y) for y in ys], np.int64),
            torch.from_numpy(np.stack(masks)).to(self.device, self.dtype),
        )

    def cohort(self, clients, run, rng_for, extra=None, validation=None):
        """The round inputs of ``clients`` (population ids), from a pool of just them."""
        clients = np.asarray(clients, np.int64)
        if validation is not None:
            raise ConfigError(f"{self.data.name} has no validation split; set val_fraction=0")
        pool = self.select(clients)
        local = np.arange(len(clients))
        return pool.cohort(local, run, lambda c, stream: rng_for(int(clients[c]), stream), extra)


def generated_pools(
    data: GeneratedClients, label_space: str, dtype: torch.dtype, device: torch.device | str
) -> dict[str, GeneratedPool]:
    return {s: GeneratedPool(data, s, label_space, dtype, device) for s in ("train", "test")}


class SharedFeatures:
    """A function of the shared downlink over a split's rows (the shared body's features, or a
    downlink-only view's logits), computed once per evaluation (lazily).

    With most of the pool's clients evaluated, it runs over the whole pool in slices of
    ``batch_rows`` rows (no copy of the inputs); for a few clients (a sample, the clients whose
    state changed), over their own rows only.
    """

    def __init__(
        self, apply: Callable[[Tensor], Tensor], pool: ClientPool, clients: np.ndarray, rows: int
    ) -> None:
        self.apply, self.pool, self.batch_rows = apply, pool, rows
        self.whole = 2 * int(pool.sizes[clients].sum()) >= int(pool.sizes.sum())
        self.features: Tensor | None = None

    def _body(self, x: Tensor) -> Tensor:
        parts = [
            self.apply(x[start : start + self.batch_rows])
            for start in range(0, len(x), self.batch_rows)
        ]
        return torch.cat(parts) if len(parts) != 1 else parts[0]

    def whole_pool(self) -> Tensor:
        """The function over every row of the pool, computed once."""
        if self.features is None:
            self.features = self._body(self.pool.x)
        return self.features

    def flat(self, ids: np.ndarray) -> tuple[Tensor, Tensor]:
        """Features holding each client's rows one after the other, and where each one's start."""
        sizes = torch.as_tensor(self.pool.sizes[ids], device=self.pool.offsets.device)
        if self.whole:
            return self.whole_pool(), self.pool.offsets[torch.as_tensor(ids, device=sizes.device)]
        rows, valid = self.pool.rows(ids)
        return self._body(self.pool.x[rows[valid]]), torch.cumsum(sizes, 0) - sizes

    def padded(self, ids: np.ndarray) -> Tensor:
        """The clients' features ``[C, n_max, M]`` (padding rows hold any finite values)."""
        rows, valid = self.pool.rows(ids)
        if self.whole:
            return take(self.whole_pool(), rows)
        features = self._body(self.pool.x[rows[valid]])
        padded = features.new_zeros((*rows.shape, features.shape[-1]))
        padded[valid] = features
        return padded


#: Stores larger than this many bytes take memory page by page as rows are written.
LAZY_BYTES = 2**26


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Zeros whose memory is committed only where rows are written.

    Large tables map fresh anonymous memory (zero until touched) without transparent huge pages,
    so a store of a million clients takes memory for the clients that trained, a few kilobytes
    each, not for the whole table.
    """
    one = torch.empty((), dtype=dtype)
    nbytes = math.prod(shape) * one.element_size()
    if nbytes < LAZY_BYTES or dtype == torch.bfloat16:  # (NumPy has no bfloat16)
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)  # one written row must not commit 2 MB
    return torch.from_numpy(np.frombuffer(buffer, one.numpy().dtype).reshape(shape))


class ClientStore:
    """Every client's private state, stacked as ``[I, ...]`` host tensors.

    Rows exist for all clients from the first write but take memory only once written
    (:func:`lazy_zeros`), and are filled on demand: ``initialized`` says which rows hold a
    state, ``visited`` which clients have trained, ``changed`` which rows were written since
    the flags were last cleared (evaluation reuses the results of clients whose state did not
    change). Only a cohort's rows are copied to the compute device (:meth:`gather`) and written
    back (:meth:`scatter`).
    """

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.tensors: dict[str, Tensor] = {}
        self.initialized = torch.zeros(num_clients, dtype=torch.bool)
        self.visited = torch.zeros(num_clients, dtype=torch.bool)
        self.changed = torch.zeros(num_clients, dtype=torch.bool)

    def missing(self, clients: np.ndarray) -> np.ndarray:
        """The clients among ``clients`` whose rows hold no state yet."""
        return np.asarray(clients)[~self.initialized[torch.as_tensor(clients)].numpy()]

    def write(self, clients: Sequence[int] | np.ndarray, states: ClientState) -> None:
        """Store stacked states ``[C, ...]`` for ``clients`` (without marking them visited)."""
        ids = torch.as_tensor(np.asarray(clients, dtype=np.int64))
        for k, v in states.items():
            if k not in self.tensors:
                self.tensors[k] = lazy_zeros((self.num_clients, *v.shape[1:]), v.dtype)
            self.tensors[k][ids] = v.detach().to(self.tensors[k].device)
        self.initialized[ids] = True
        self.changed[ids] = True

    def gather(self, clients: np.ndarray, device: torch.device | str = "cpu") -> ClientState:
        """The stacked states ``[C, ...]`` of ``clients`` on ``device`` (all must be initialized)."""
        ids = torch.as_tensor(np.asarray(clients, dtype=np.int64))
        return {k: v[ids].to(device) for k, v in self.tensors.items()}

    def read(self, clients: np.ndarray) -> ClientState:
        """:meth:`gather` for reading only: the stored tensors themselves (no copy) when
        ``clients`` are all the store's clients in order."""
        if len(clients) == self.num_clients and np.array_equal(clients, np.arange(len(clients))):
            return dict(self.tensors)
        return self.gather(clients)

    def scatter(self, clients: np.ndarray, states: ClientState) -> None:
        """Write the cohort's new states back and mark the clients visited."""
        self.write(clients, states)
        self.visited[torch.as_tensor(np.asarray(clients, dtype=np.int64))] = True

    def get(self, client: int) -> ClientState:
        return {k: v[client] for k, v in self.tensors.items()}

    def nbytes(self) -> int:
        """Bytes of the rows that hold a state (what the store really occupies)."""
        rows = int(self.initialized.sum())
        return sum(v[0].numel() * v.element_size() * rows for v in self.tensors.values())

    def state_dict(self) -> dict[str, object]:
        """The initialized rows only (a checkpoint grows with the clients met, not with I)."""
        rows = torch.nonzero(self.initialized).flatten()
        return {
            "rows": rows,
            "tensors": {k: v[rows] for k, v in self.tensors.items()},
            "visited": self.visited,
            "initialized": self.initialized,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.visited = state["visited"].clone()
        self.initialized = state.get("initialized", state["visited"]).clone()
        self.changed = self.initialized.clone()
        if "rows" not in state:  # full tables (older checkpoints)
            self.tensors = dict(state["tensors"])
            return
        self.tensors = {}
        for k, v in state["tensors"].items():
            self.tensors[k] = lazy_zeros((self.num_clients, *v.shape[1:]), v.dtype)
            self.tensors[k][state["rows"]] = v
