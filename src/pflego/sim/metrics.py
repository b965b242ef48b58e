"""Evaluation of every client's personalized model: L(psi), accuracy statistics, before/after adapt.

Clients are evaluated in chunks (:class:`Evaluator`): the algorithm's ``adapt`` (or ``join``, for
clients that never trained) runs first, then ``predict`` and each of the algorithm's extra
``predictions`` on every split. Adapted states are used for that evaluation only and never stored.

Metric names: ``<split>_<loss|acc>`` for the personalized model (after ``adapt`` when the
algorithm has one), ``<split>_<loss|acc>_before_adapt`` for the same clients without it, and
``<split>_<loss|acc>_<name>`` for an extra prediction ``predict_<name>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from weakref import WeakKeyDictionary

import numpy as np
import torch
from torch import Tensor
from torch.func import vmap

from pflego import tree
from pflego.algorithms import Algorithm
from pflego.data import FederatedData
from pflego.data.stream import GeneratedClients
from pflego.local import fused_steps
from pflego.models import SplitModel, apply_layers
from pflego.sim.clients import ClientPool, SharedFeatures, generated_pools
from pflego.sim.summary import summarize
from pflego.tree import Params
from pflego.types import ClientData, ClientState, Downlink, RoundContext

#: Bytes an evaluation chunk's inputs and activations may take on a CPU: large products, yet
#: each intermediate small enough to be served from freed heap memory rather than fresh pages.
EVAL_BYTES = 2**26
#: The same on a GPU: chunks of many clients, so that an evaluation is a few large batched calls
#: (at 64 MB a CNN's chunk held about one CIFAR-10 client).
DEVICE_EVAL_BYTES = 2**30
SPLITS = ("train", "val", "test")
#: On a CPU, chunks whose clients hold this many samples on average are evaluated client by
#: client, reading their rows and states in place (no padded copies).
LOOP_ROWS = 64
#: The key of the downlink model's logits among the shared computations of an evaluation.
LOGITS = "logits of the downlink's model"

#: The downlink of given client ids (a :class:`~pflego.types.Downlink`, or its payload).
DownlinkFor = Callable[[np.ndarray], Downlink | Params]
Metrics = tuple[Tensor, Tensor]
#: A strategy: an :class:`Evaluator`'s losses and accuracies ``[C]`` of one view of a chunk's
#: clients on one split (unbound: an evaluator holding its own bound methods would be a
#: reference cycle, its features and logits kept until the cyclic garbage collector runs).
Strategy = Callable[["Evaluator", "Chunk", str, str], Metrics]


@dataclass(frozen=True)
class Personalization:
    """How a chunk of clients personalizes before it is evaluated.

    Attributes:
        method: ``adapt`` (clients that trained) or ``join`` (clients that never trained).
        inputs: The padded training data and ``adapt_schedule`` batches of given client ids.
        ctx: The round context handed to the method.
        clients: The same, each client's on its own rows (no padding), for personalizing them
            one by one.
        fused: Whether those one-by-one personalizations run fused steps where they fuse (the
            simulator's runs do, except on the ``loop`` backend, the autograd reference).
    """

    method: str
    inputs: Callable[[np.ndarray], ClientData]
    ctx: RoundContext
    clients: Callable[[np.ndarray], list[ClientData]]
    fused: bool = False


@dataclass
class Chunk:
    """Clients evaluated together: their ids (and as a tensor), downlink (shared, or one a
    client), and states before and after personalization (one dict a client when evaluated
    :func:`one_by_one`, else stacked); ``features``: the shared body's features of their rows, by
    split, once computed."""

    ids: np.ndarray
    index: Tensor
    downlink: Downlink
    before: ClientState | list[ClientState]
    after: ClientState | list[ClientState]
    one_by_one: bool
    features: dict[str, Tensor | tuple[Tensor, Tensor]] = field(default_factory=dict)

    def states(self, view: str) -> ClientState | list[ClientState]:
        """The states ``view`` predicts with."""
        return self.before if view == "before_adapt" else self.after

    def keys(self, view: str) -> list[str]:
        """The keys of one client's state for ``view``."""
        states = self.states(view)
        return list(states[0] if self.one_by_one else states)

    @property
    def payload(self) -> Params:
        """The downlink's payload (shared, or stacked over the chunk's clients)."""
        return self.downlink.payload

    @property
    def in_dim(self) -> int | None:
        """The payload's axis of clients for ``vmap`` (``None``: shared)."""
        return 0 if self.downlink.per_client else None


def one_by_one(device: torch.device, sizes: np.ndarray) -> bool:
    """Whether a chunk of clients of these sizes (their largest split's) personalizes and is
    evaluated client by client: on a CPU, when they hold :data:`LOOP_ROWS` samples or more on
    average (each one's rows and state read in place cost less than padded copies of them);
    never on another device (vmapped)."""
    return device.type == "cpu" and bool(sizes.mean() >= LOOP_ROWS)


def _client_metrics(
    predict: Callable[..., Tensor],
    downlink: Params,
    state: ClientState,
    x: Tensor,
    y: Tensor,
    mask: Tensor,
    lmask: Tensor,
) -> Metrics:
    """:func:`logit_metrics` of one client's ``predict`` on inputs ``x``."""
    return logit_metrics(predict(downlink, state, x), y, mask, lmask)


def logit_metrics(logits: Tensor, y: Tensor, mask: Tensor, lmask: Tensor) -> Metrics:
    """Mean loss and accuracy over the real samples (NaN without samples) of given logits
    ``[..., n, K]`` (labels and mask ``[..., n]``, label mask ``[..., K]``): one client's, or
    each of a batch of clients'.

    A sample whose class the client's head lacks (local label -1: a class absent from the
    client's training split) counts as an error in the accuracy and is left out of the loss,
    whose value for it would be infinite (the head gives its class probability 0); the loss is
    the mean over the samples of classes the head has (NaN when there are none).
    """
    logits = torch.where(lmask.unsqueeze(-2) > 0, logits, torch.finfo(logits.dtype).min)
    known = mask * (y >= 0).to(mask.dtype)
    # log_softmax's value at y, without log_softmax over a last dimension of a few classes (on
    # a CPU several times slower than logsumexp over it)
    picked = logits.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    log_p = picked - torch.logsumexp(logits, -1)
    correct = (logits.argmax(-1) == y).to(mask.dtype)  # never true for the label -1
    return -(log_p * known).sum(-1) / known.sum(-1), (correct * mask).sum(-1) / mask.sum(-1)


def looped_metrics(
    predict: Callable[..., Tensor],
    chunk: Chunk,
    states: list[ClientState],
    inputs: Tensor,
    starts: Tensor,
    pool: ClientPool,
) -> Metrics:
    """:func:`_client_metrics` of each of the chunk's clients in turn, with its state, on its
    rows of ``inputs`` from its start in ``starts`` (the pool's inputs, or features laid out
    alike), read in place: on a CPU, for clients of many samples, faster than one vmapped call
    on padded copies of them."""
    sizes, lmask = pool.sizes[chunk.ids], pool.label_masks[chunk.index]
    ones = pool.x.new_ones(int(sizes.max(initial=0)))
    rows = zip(sizes.tolist(), pool.offsets[chunk.index].tolist(), starts.tolist(), strict=True)
    metrics = []
    for j, (n, first, start) in enumerate(rows):
        x, y = inputs[start : start + n], pool.y[first : first + n]
        downlink = chunk.downlink.of(j)
        metrics.append(_client_metrics(predict, downlink, states[j], x, y, ones[:n], lmask[j]))
    return torch.stack([m[0] for m in metrics]), torch.stack([m[1] for m in metrics])


def personalized(
    algorithm: Algorithm, personalization: Personalization, chunk: Chunk
) -> list[ClientState]:
    """Each of the chunk's clients' ``adapt`` (or ``join``) on its own rows, one after another
    (no padding; fused steps where they fuse and ``personalization.fused`` says so)."""
    method, ctx = getattr(algorithm, personalization.method), personalization.ctx
    own_rows = personalization.clients(chunk.ids)
    with torch.enable_grad(), fused_steps(personalization.fused):
        return [
            tree.detach(method(chunk.downlink.of(j), state, own_rows[j], ctx))
            for j, state in enumerate(chunk.before)
        ]


def sample_elements(model: SplitModel, sample_shape: tuple[int, ...]) -> int:
    """Elements one sample allocates in a forward pass: every layer's output (not the input, nor
    outputs that are views of their input) and the logits."""
    cache = _sample_elements.setdefault(model.body, {})
    if sample_shape not in cache:
        counts = []
        params = {f"body.{k}": v for k, v in model.body.named_parameters()}
        x = torch.zeros((1, *sample_shape))
        with torch.no_grad():
            if model.layers is not None:
                for layer in model.layers:
                    x = apply_layers((layer,), params, x)
                    if layer.kind not in ("flatten", "identity"):
                        counts.append(x.numel())
            else:  # count what every leaf module returns
                leaves = [m for m in model.body.modules() if not list(m.children())]
                hooks = [
                    m.register_forward_hook(lambda m, i, out: counts.append(_numel(out)))
                    for m in leaves
                ]
                try:
                    counts.append(model.features(params, x).numel())
                finally:
                    for hook in hooks:
                        hook.remove()
        cache[sample_shape] = sum(counts) + model.num_classes
    return cache[sample_shape]


_sample_elements: WeakKeyDictionary = WeakKeyDictionary()


def _numel(out: object) -> int:
    items = out if isinstance(out, tuple | list) else (out,)
    return sum(t.numel() for t in items if isinstance(t, Tensor))


def size_groups(
    sizes: np.ndarray, per_sample: int, budget: int, limit: int | None = None
) -> list[np.ndarray]:
    """Positions of clients grouped by size, largest first, each group's padded samples
    (``len(group) * max size * per_sample`` elements) within ``budget`` (and ``limit`` clients)."""
    order = np.argsort(-np.asarray(sizes), kind="stable")
    groups, start = [], 0
    while start < len(order):
        largest = max(1, int(sizes[order[start]]))
        fit = max(1, budget // (largest * per_sample))
        if limit:
            fit = min(fit, limit)
        groups.append(np.sort(order[start : start + fit]))
        start += fit
    return groups


class Evaluator:
    """One evaluation: its chunks of clients and the strategy of each view.

    Each view (the personalized model, the same before ``adapt``, each extra prediction) is
    evaluated by a strategy chosen once for the run (:meth:`choose`): pooled logits, whole models,
    or heads on the shared body's features, the last two vmapped on padded chunks or, chunk by
    chunk as :func:`one_by_one` says, client by client. A chunk evaluated one by one personalizes
    one by one too (:func:`personalized`); other chunks personalize vmapped on padded training data.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        pools: dict[str, ClientPool],
        clients: np.ndarray,
        personalization: Personalization | None,
        chunk_size: int | None = None,
    ) -> None:
        first = next(iter(pools.values()))
        self.algorithm, self.pools, self.clients = algorithm, pools, clients
        self.personalization = personalization
        self.device, self.dtype = first.device, first.x.dtype
        self.views = {"": algorithm.predict}
        if personalization is not None and personalization.method == "adapt":
            self.views["before_adapt"] = algorithm.predict
        self.views |= {n: getattr(algorithm, f"predict_{n}") for n in algorithm.predictions}
        self.once: set[str] = set()  # downlink-only views of a shared downlink (first chunk)
        model = algorithm.model
        # whether a row's logits depend on that row alone (no batch norm by the batch's
        # statistics), so that a model shared by every client may run over slices of the pool
        self.rowwise = model.layers is not None and all(
            layer.kind != "batchnorm" for layer in model.layers
        )
        self.bodies: dict[tuple[str, str], SharedFeatures] = {}
        self.choices: dict[str, tuple[Strategy, Strategy]] = {}
        self.sizes, self.batch_rows, self.groups = self.chunking(chunk_size)

    def chunking(self, chunk_size: int | None) -> tuple[np.ndarray, int, list[np.ndarray]]:
        """Each client's size (its largest split's), the rows of a shared body's pass, and the
        chunks: positions of clients grouped by size, each one's inputs and activations within
        :data:`EVAL_BYTES` (on a GPU :data:`DEVICE_EVAL_BYTES`) and ``chunk_size`` clients."""
        pools, model = self.pools.values(), self.algorithm.model
        budget = EVAL_BYTES if self.device.type == "cpu" else DEVICE_EVAL_BYTES
        body = max(sample_elements(model, tuple(p.x.shape[1:])) for p in pools)
        element = torch.finfo(self.dtype).bits // 8
        batch_rows = max(1, budget // (body * element))
        heads = {"", "before_adapt"} if self.algorithm.features_from_downlink else set()
        if self.personalization is not None or set(self.views) - heads:  # whole models
            per_sample = body + max(int(np.prod(p.x.shape[1:])) for p in pools)
        else:  # heads per client, on features
            per_sample = model.feature_dim + model.num_classes
        sizes = np.max([p.sizes[self.clients] for p in pools], axis=0)
        return sizes, batch_rows, size_groups(sizes, per_sample * element, budget, chunk_size)

    def choose(self, view: str, chunk: Chunk) -> tuple[Strategy, Strategy]:
        """The strategy of ``view`` for the chunk's downlink and states (vectorized, and one by
        one).

        Pooled logits for a downlink-only prediction of a shared downlink, for the personalized
        model with an empty state (a shared downlink, a body without batch norm by batch
        statistics), and for the default head on a shared body (``features_from_downlink``)
        with neither head nor body in the state; the heads on shared features where the body
        is shared and the state holds none of it; whole models otherwise.
        """
        algorithm, keys, shared = self.algorithm, chunk.keys(view), not chunk.downlink.per_client
        personal = view in ("", "before_adapt")
        heads = personal and algorithm.features_from_downlink and not _has(keys, "body.")
        downlink_head = heads and type(algorithm).predict_head is Algorithm.predict_head
        empty = personal and not keys and self.rowwise and shared
        if view in self.once or empty or (downlink_head and not _has(keys, "head.")):
            return Evaluator.pooled_logits, Evaluator.pooled_logits
        if heads:
            return Evaluator.vmapped_heads, Evaluator.heads_client_by_client
        return Evaluator.vmapped_models, Evaluator.client_by_client

    def columns(self, downlink_for: DownlinkFor, states: ClientState) -> dict[str, np.ndarray]:
        """Per-client losses and accuracies of every view on every split, chunk by chunk (on
        the device, read back in one transfer at the end)."""
        parts: dict[str, list[Tensor]] = {}
        for group in self.groups:
            chunk = self.chunk(group, downlink_for, states)
            if not self.choices:  # every chunk's downlink and states have the same form
                if not chunk.downlink.per_client:
                    self.once = set(self.algorithm.downlink_predictions)
                self.choices = {view: self.choose(view, chunk) for view in self.views}
            for split in self.pools:
                for view in self.views:
                    loss, acc = self.choices[view][chunk.one_by_one](self, chunk, split, view)
                    suffix = f"_{view}" if view else ""
                    for name, value in ((f"loss{suffix}", loss), (f"acc{suffix}", acc)):
                        parts.setdefault(f"{split}_{name}", []).append(value)
        return host_columns(parts, self.groups, len(self.clients))

    def chunk(self, group: np.ndarray, downlink_for: DownlinkFor, states: ClientState) -> Chunk:
        """The clients at ``group``, their states read and personalized (one by one on their
        own rows, or vmapped on their padded training data)."""
        ids, device = self.clients[group], self.device
        looped = one_by_one(device, self.sizes[group])
        if looped:  # each client's state read in place (a view where on the device)
            own = [{k: v[p].to(device) for k, v in states.items()} for p in group.tolist()]
        else:
            own = {
                k: v[torch.as_tensor(group, device=v.device)].to(device) for k, v in states.items()
            }
        index = torch.as_tensor(ids, device=device)
        sent = downlink_for(ids)
        downlink = sent if isinstance(sent, Downlink) else self.algorithm.received(sent)
        chunk = Chunk(ids, index, downlink, own, own, looped)
        how = self.personalization
        if how is not None and looped:
            chunk.after = personalized(self.algorithm, how, chunk)
        elif how is not None:
            method, dims = getattr(self.algorithm, how.method), (chunk.in_dim, 0, 0)
            adapt = vmap(
                lambda d, s, data: method(d, s, data, how.ctx), dims, randomness="different"
            )
            with torch.enable_grad():
                chunk.after = tree.detach(adapt(chunk.payload, own, how.inputs(ids)))
        return chunk

    def labels(self, chunk: Chunk, split: str) -> tuple[Tensor, Tensor, Tensor]:
        """The chunk's padded labels and sample mask ``[C, n_max]`` on ``split``, and their
        label masks."""
        pool = self.pools[split]
        rows, valid = pool.rows(chunk.ids)
        return pool.y[rows], valid.to(self.dtype), pool.label_masks[chunk.index]

    def shared(self, split: str, view: str, downlink: Params) -> SharedFeatures:
        """The shared body's features (``view`` ""), the downlink model's logits
        (:data:`LOGITS`) or a downlink-only view's logits over ``split``, computed once."""
        if (split, view) not in self.bodies:
            if view == "":
                apply = partial(self.algorithm.model.features, downlink)
            elif view == LOGITS:
                apply = partial(self.algorithm.predict, downlink, {})
            else:
                apply = partial(self.views[view], downlink, None)
            pool = self.pools[split]
            self.bodies[split, view] = SharedFeatures(apply, pool, self.clients, self.batch_rows)
        return self.bodies[split, view]

    def features(self, chunk: Chunk, split: str, form: str) -> Tensor | tuple[Tensor, Tensor]:
        """The shared body's features of the chunk's rows on ``split`` (``form``: ``flat`` or
        ``padded``, see :class:`~pflego.sim.clients.SharedFeatures`), computed once a chunk."""
        if split not in chunk.features:
            shared = self.shared(split, "", chunk.payload)
            chunk.features[split] = getattr(shared, form)(chunk.ids)
        return chunk.features[split]

    def pooled_logits(self, chunk: Chunk, split: str, view: str) -> Metrics:
        """Strategy: the logits of the downlink's model (or of a downlink-only prediction),
        computed once over the pool, read for the chunk's clients."""
        shared = self.shared(split, view if view in self.once else LOGITS, chunk.payload)
        return logit_metrics(shared.padded(chunk.ids), *self.labels(chunk, split))

    def vmapped_models(self, chunk: Chunk, split: str, view: str) -> Metrics:
        """Strategy: the chunk's whole models vmapped over its padded rows."""
        pool, dims = self.pools[split], (chunk.in_dim, 0, 0, 0, 0, 0)
        metrics = vmap(partial(_client_metrics, self.views[view]), dims, randomness="different")
        x, y, mask = pool.padded(chunk.ids)
        lmask = pool.label_masks[chunk.index]
        return metrics(chunk.payload, chunk.states(view), x, y, mask, lmask)

    def client_by_client(self, chunk: Chunk, split: str, view: str) -> Metrics:
        """Strategy: each client's whole model on its own rows of the pool, one after another."""
        pool = self.pools[split]
        starts = pool.offsets[chunk.index]
        states = chunk.states(view)
        return looped_metrics(self.views[view], chunk, states, pool.x, starts, pool)

    def vmapped_heads(self, chunk: Chunk, split: str, view: str) -> Metrics:
        """Strategy: the chunk's heads vmapped over the shared body's padded features."""
        metrics = vmap(partial(_client_metrics, self.algorithm.predict_head), (None, 0, 0, 0, 0, 0))
        features = self.features(chunk, split, "padded")
        return metrics(chunk.payload, chunk.states(view), features, *self.labels(chunk, split))

    def heads_client_by_client(self, chunk: Chunk, split: str, view: str) -> Metrics:
        """Strategy: each client's head on its rows of the shared body's features, one after
        another."""
        features, starts = self.features(chunk, split, "flat")
        head, states, pool = self.algorithm.predict_head, chunk.states(view), self.pools[split]
        return looped_metrics(head, chunk, states, features, starts, pool)


def host_columns(
    parts: dict[str, list[Tensor]], groups: list[np.ndarray], count: int
) -> dict[str, np.ndarray]:
    """Columns ``[count]`` (float64) from each column's values chunk by chunk (``parts``, of the
    clients at ``groups``), copied to the host at once: one wait for the device, not one a
    chunk, split and view."""
    if not parts:
        return {}
    names = list(parts)
    values = torch.stack([torch.cat([v.double() for v in parts[n]]) for n in names])
    host, order = values.cpu().numpy(), np.concatenate(groups)
    columns = {}
    for name, row in zip(names, host, strict=True):
        columns[name] = np.full(count, np.nan)
        columns[name][order] = row
    return columns


def _has(keys: list[str], prefix: str) -> bool:
    return any(k.startswith(prefix) for k in keys)


def evaluate_clients(
    algorithm: Algorithm,
    downlink_for: DownlinkFor,
    states: ClientState,
    pools: dict[str, ClientPool],
    personalization: Personalization | None = None,
    chunk_size: int | None = None,
    clients: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Per-client losses and accuracies of every view on every split, chunk by chunk
    (strategies: :class:`Evaluator`).

    Args:
        algorithm: Supplies ``predict`` (and ``adapt`` / ``join``, ``predict_<name>``).
        downlink_for: The downlink of given client ids, on the pools' device (a
            :class:`~pflego.types.Downlink`, or the payload the algorithm sends them).
        states: The private states of the evaluated clients, stacked in their order (any
            device): ``[len(clients), ...]``, or ``[I, ...]`` when ``clients`` is ``None``.
        pools: The splits to evaluate on (``train``, ``test``, optionally ``val``).
        personalization: Run ``adapt`` or ``join`` first; ``None`` evaluates the states as they are.
        chunk_size: At most this many clients per chunk (default: as many as fit
            :data:`EVAL_BYTES` on a CPU, :data:`DEVICE_EVAL_BYTES` on another device).
        clients: Which clients to evaluate (default all), in the order of the returned columns.

    Returns:
        Columns ``[len(clients)]`` (float64) named ``<split>_<loss|acc>[_<view>]``.
    """
    first = next(iter(pools.values()))
    ids = np.arange(len(first.sizes)) if clients is None else np.asarray(clients, np.int64)
    evaluator = Evaluator(algorithm, pools, ids, personalization, chunk_size)
    return evaluator.columns(downlink_for, states)


@torch.no_grad()
def client_rows(
    algorithm: Algorithm,
    downlink_for: DownlinkFor,
    states: ClientState,
    pools: dict[str, ClientPool],
    personalization: Personalization | None = None,
    chunk_size: int | None = None,
    ids: np.ndarray | None = None,
    counts: dict[str, np.ndarray] | None = None,
) -> list[dict[str, float]]:
    """One row per client of the pools: its id (``ids``, default its position), sample counts and
    metrics (see :func:`evaluate_clients`). ``counts`` replaces a pool's own sizes in the
    ``n_<split>`` columns (a training split evaluated on a subsample still weighs clients by N_i)."""
    values = evaluate_clients(algorithm, downlink_for, states, pools, personalization, chunk_size)
    sizes = {split: pool.sizes for split, pool in pools.items()} | (counts or {})
    columns = {
        "client": np.arange(len(sizes["train"])) if ids is None else np.asarray(ids),
        **{f"n_{s}": sizes[s] for s in pools},
        **{f"n_{s}_known": pool.known for s, pool in pools.items() if s != "train"},
        **values,
    }
    lists = {k: v.tolist() for k, v in columns.items()}
    return [dict(zip(lists, values)) for values in zip(*lists.values())]


def evaluate(
    algorithm: Algorithm,
    downlink: Downlink | Params,
    client_state: Callable[[int], ClientState],
    data: FederatedData,
    dtype: torch.dtype,
    personalization: Personalization | None = None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Evaluate every client's personalized model on each of its splits, from a per-client state
    function.

    ``downlink``: every client's (the payload the algorithm sends all of them, or its
    :class:`~pflego.types.Downlink`).

    Returns:
        Summary metrics (see :func:`summarize`) and one row per client.
    """
    states = tree.stack(client_state(i) for i in range(data.num_clients))
    sent = downlink if isinstance(downlink, Downlink) else algorithm.received(downlink)
    device = next(iter(sent.payload.values())).device
    pools = build_pools(data, algorithm.label_space, dtype, device)
    rows = client_rows(algorithm, sent.select, states, pools, personalization)
    return summarize(rows), rows


def build_pools(
    data: FederatedData, label_space: str, dtype: torch.dtype, device: torch.device | str
) -> dict[str, ClientPool]:
    """The train, validation (when the partition has one) and test pools of ``data``."""
    if isinstance(data, GeneratedClients):
        return generated_pools(data, label_space, dtype, device)
    splits = [s for s in SPLITS if s != "val" or data.val_offsets is not None]
    return {s: ClientPool.build(data, s, label_space, dtype, device) for s in splits}
