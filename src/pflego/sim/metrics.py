"""Evaluation of every client's personalized model: L(psi), accuracy statistics, before/after adapt.

Clients are evaluated in chunks grouped by size (so that a chunk pads little) and sized by the
memory their activations take (:data:`EVAL_BYTES`): for each chunk, the algorithm's ``adapt``
(or ``join``, for clients that never trained) runs under ``torch.func.vmap`` on their training
splits, then ``predict`` (and each of the algorithm's extra ``predictions``) runs on every split
of a :class:`~pflego.sim.clients.ClientPool` that already lives on the device. When the body
comes from the shared downlink (``Algorithm.features_from_downlink``), it runs once over the
chunk's real samples as one large batch, and only the heads run per client. On a CPU, chunks of
large clients (:data:`LOOP_ROWS`) are personalized and evaluated one client at a time on its own
rows instead (``adapt``'s steps fused where they fuse, except on the ``loop`` backend).
Adapted states are used for that evaluation only and never stored.

Metric names: ``<split>_<loss|acc>`` for the personalized model (after ``adapt`` when the
algorithm has one), ``<split>_<loss|acc>_before_adapt`` for the same clients without it, and
``<split>_<loss|acc>_<name>`` for an extra prediction ``predict_<name>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
from pflego.sim.clients import ClientPool, take
from pflego.sim.generated import generated_pools
from pflego.tree import Params
from pflego.types import ClientData, ClientState, RoundContext

#: Bytes an evaluation chunk's inputs and activations may take: large products, yet each
#: intermediate small enough to be served from freed heap memory rather than fresh pages.
EVAL_BYTES = 2**26
SPLITS = ("train", "val", "test")
#: On a CPU, chunks whose clients hold this many samples on average are evaluated client by
#: client, reading their rows and states in place (no padded copies).
LOOP_ROWS = 64
#: The key of the downlink model's logits among the shared computations of an evaluation.
LOGITS = "logits of the downlink's model"

DownlinkFor = Callable[[np.ndarray], Params]
AdaptInputs = Callable[[np.ndarray], ClientData]
AdaptClients = Callable[[np.ndarray], list[ClientData]]


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
    inputs: AdaptInputs
    ctx: RoundContext
    clients: AdaptClients
    fused: bool = False


def _client_metrics(
    predict: Callable[..., Tensor],
    downlink: Params,
    state: ClientState,
    x: Tensor,
    y: Tensor,
    mask: Tensor,
    lmask: Tensor,
) -> tuple[Tensor, Tensor]:
    """Mean loss and accuracy of one client over its real samples (NaN without samples).

    A sample whose class the client's head lacks (local label -1: a class absent from the
    client's training split) counts as an error in the accuracy and is left out of the loss,
    whose value for it would be infinite (the head gives its class probability 0); the loss is
    the mean over the samples of classes the head has (NaN when there are none).
    """
    return logit_metrics(predict(downlink, state, x), y, mask, lmask)


def logit_metrics(logits: Tensor, y: Tensor, mask: Tensor, lmask: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_client_metrics` of given logits ``[..., n, K]`` (labels and mask ``[..., n]``,
    label mask ``[..., K]``): one client's, or each of a batch of clients'."""
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
    downlink: Params,
    per_client_downlink: bool,
    states: list[ClientState],
    inputs: Tensor,
    starts: Tensor,
    pool: ClientPool,
    ids: np.ndarray,
    lmask: Tensor,
) -> tuple[Tensor, Tensor]:
    """:func:`_client_metrics` of each client ``ids[j]`` in turn, with its state ``states[j]``,
    on its rows of ``inputs`` from ``starts[j]`` (the pool's inputs, or features laid out alike),
    read in place: on a CPU, for clients of many samples, faster than one vmapped call on padded
    copies of them."""
    losses, accuracies = [], []
    ones = pool.x.new_ones(int(pool.sizes[ids].max(initial=0)))
    firsts = pool.offsets[torch.as_tensor(ids, device=pool.offsets.device)].tolist()
    rows = zip(pool.sizes[ids].tolist(), firsts, starts.tolist(), strict=True)
    for j, (n, first, start) in enumerate(rows):
        loss, acc = _client_metrics(
            predict, own_downlink(downlink, per_client_downlink, j), states[j],
            inputs[start : start + n], pool.y[first : first + n], ones[:n], lmask[j],
        )  # fmt: skip
        losses.append(loss)
        accuracies.append(acc)
    return torch.stack(losses), torch.stack(accuracies)


def own_downlink(downlink: Params, per_client_downlink: bool, j: int) -> Params:
    """The downlink of the ``j``-th client of a chunk."""
    return {k: v[j] for k, v in downlink.items()} if per_client_downlink else downlink


def client_states(states: ClientState, places: np.ndarray, device: torch.device) -> list:
    """The states at ``places`` of stacked ``states``, one dict each (views where on ``device``)."""
    return [{k: v[p].to(device) for k, v in states.items()} for p in places.tolist()]


def personalized(
    algorithm: Algorithm,
    personalization: Personalization,
    downlink: Params,
    states: list[ClientState],
    ids: np.ndarray,
) -> list[ClientState]:
    """Each client's ``adapt`` (or ``join``) on its own rows, one after another (no padding;
    fused steps where they fuse and ``personalization.fused`` says so)."""
    method = getattr(algorithm, personalization.method)
    own_rows = personalization.clients(ids)
    with torch.enable_grad(), fused_steps(personalization.fused):
        return [
            tree.detach(
                method(
                    own_downlink(downlink, algorithm.per_client_downlink, j),
                    state,
                    own_rows[j],
                    personalization.ctx,
                )
            )
            for j, state in enumerate(states)
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


def evaluate_clients(
    algorithm: Algorithm,
    downlink_for: DownlinkFor,
    states: ClientState,
    pools: dict[str, ClientPool],
    personalization: Personalization | None = None,
    chunk_size: int | None = None,
    clients: np.ndarray | None = None,
    budget: int = EVAL_BYTES,
) -> dict[str, np.ndarray]:
    """Per-client losses and accuracies of every view on every split, chunk by chunk.

    Args:
        algorithm: Supplies ``predict`` (and ``adapt`` / ``join``, ``predict_<name>``).
        downlink_for: The downlink of given client ids, on the pools' device (a shared payload,
            or one stacked per client for ``per_client_downlink`` algorithms).
        states: The private states of the evaluated clients, stacked in their order (any
            device): ``[len(clients), ...]``, or ``[I, ...]`` when ``clients`` is ``None``.
        pools: The splits to evaluate on (``train``, ``test``, optionally ``val``).
        personalization: Run ``adapt`` or ``join`` first; ``None`` evaluates the states as they are.
        chunk_size: At most this many clients per chunk (default: as many as fit ``budget``).
        clients: Which clients to evaluate (default all), in the order of the returned columns.
        budget: Bytes a chunk's inputs and activations may take.

    Returns:
        Columns ``[len(clients)]`` (float64) named ``<split>_<loss|acc>[_<view>]``.
    """
    first = next(iter(pools.values()))
    device, dtype = first.device, first.x.dtype
    ids_all = np.arange(len(first.sizes)) if clients is None else np.asarray(clients, np.int64)
    dl_dim = 0 if algorithm.per_client_downlink else None
    personalize = None
    if personalization is not None:
        method = getattr(algorithm, personalization.method)
        ctx = personalization.ctx
        personalize = vmap(
            lambda d, s, data: method(d, s, data, ctx),
            in_dims=(dl_dim, 0, 0),
            randomness="different",
        )
    views = {"": algorithm.predict}
    if personalization is not None and personalization.method == "adapt":
        views["before_adapt"] = algorithm.predict
    views |= {name: getattr(algorithm, f"predict_{name}") for name in algorithm.predictions}
    metric_fns = {
        view: vmap(
            lambda d, s, x, y, m, lm, fn=fn: _client_metrics(fn, d, s, x, y, m, lm),
            in_dims=(dl_dim, 0, 0, 0, 0, 0),
            randomness="different",
        )
        for view, fn in views.items()
    }
    head_views = set()
    # the default head on a shared body: a state without head or body entries predicts with
    # the downlink's model, whose logits are computed once over the pool's rows
    shared_head = (
        algorithm.features_from_downlink and type(algorithm).predict_head is Algorithm.predict_head
    )
    if algorithm.features_from_downlink:
        head_views = {"", "before_adapt"}
        head_metrics = vmap(
            lambda d, s, f, y, m, lm: _client_metrics(algorithm.predict_head, d, s, f, y, m, lm),
            in_dims=(None, 0, 0, 0, 0, 0),
        )
    model = algorithm.model
    body = max(sample_elements(model, tuple(p.x.shape[1:])) for p in pools.values())
    element = torch.finfo(dtype).bits // 8
    batch_rows = max(1, budget // (body * element))  # rows per pass of a shared body
    if personalization is not None or set(views) - head_views:  # whole models per client
        per_sample = body + max(int(np.prod(p.x.shape[1:])) for p in pools.values())
    else:  # heads per client, on features
        per_sample = model.feature_dim + model.num_classes
    sizes = np.max([p.sizes[ids_all] for p in pools.values()], axis=0)
    groups = size_groups(sizes, per_sample * element, budget, chunk_size)
    columns: dict[str, np.ndarray] = {}
    # the downlink is shared whenever these are used: per split, the body's features ("") and
    # each downlink-only view's logits
    bodies: dict[tuple[str, str], SharedFeatures] = {}
    once = set() if algorithm.per_client_downlink else set(algorithm.downlink_predictions)
    # whether a row's logits depend on that row alone (no batch norm by the batch's statistics),
    # so that a model shared by every client may run over slices of the whole pool
    rowwise = model.layers is not None and all(layer.kind != "batchnorm" for layer in model.layers)

    def shared(split: str, view: str, downlink: Params) -> SharedFeatures:
        if (split, view) not in bodies:
            if view == "":
                apply = partial(model.features, downlink)
            elif view == LOGITS:
                apply = partial(algorithm.predict, downlink, {})
            else:
                apply = partial(views[view], downlink, None)
            bodies[split, view] = SharedFeatures(apply, pools[split], ids_all, batch_rows)
        return bodies[split, view]

    for group in groups:
        ids = ids_all[group]
        index = torch.as_tensor(ids, device=device)
        downlink = downlink_for(ids)
        looped = device.type == "cpu" and sizes[group].mean() >= LOOP_ROWS
        if looped:  # each client's state read in place, personalized on its own rows
            raw = client_states(states, group, device)
            adapted = raw
            if personalize is not None:
                adapted = personalized(algorithm, personalization, downlink, raw, ids)
        else:
            raw = {
                k: v[torch.as_tensor(group, device=v.device)].to(device) for k, v in states.items()
            }
            adapted = raw
            if personalize is not None:
                with torch.enable_grad():
                    adapted = tree.detach(personalize(downlink, raw, personalization.inputs(ids)))
        for split, pool in pools.items():
            features = None
            rows, valid = pool.rows(ids)
            labels = (pool.y[rows], valid.to(dtype))
            lmask = pool.label_masks[index]
            for view in views:
                chunk_states = raw if view == "before_adapt" else adapted
                keys = chunk_states[0] if looped else chunk_states  # one client's state's keys
                whole = view not in head_views or any(k.startswith("body.") for k in keys)
                # the personalized model with an empty state, or a head fixed by the downlink
                downlink_model = view in ("", "before_adapt") and (
                    (not keys and rowwise and not algorithm.per_client_downlink)
                    or (shared_head and not whole and not any(k.startswith("head.") for k in keys))
                )
                if view in once or downlink_model:
                    logits = shared(split, view if view in once else LOGITS, downlink).padded(ids)
                    loss, acc = logit_metrics(logits, *labels, lmask)
                elif looped:
                    if whole:
                        fn, inputs, starts = views[view], pool.x, pool.offsets[index]
                    else:
                        if features is None:  # (each client's rows, where they start)
                            features = shared(split, "", downlink).flat(ids)
                        fn, (inputs, starts) = algorithm.predict_head, features
                    loss, acc = looped_metrics(
                        fn, downlink, dl_dim is not None, chunk_states, inputs, starts, pool, ids,
                        lmask,
                    )  # fmt: skip
                elif whole:
                    x, y, mask = pool.padded(ids)
                    loss, acc = metric_fns[view](downlink, chunk_states, x, y, mask, lmask)
                else:
                    if features is None:
                        features = shared(split, "", downlink).padded(ids)
                    loss, acc = head_metrics(downlink, chunk_states, features, *labels, lmask)
                suffix = f"_{view}" if view else ""
                for name, value in ((f"{split}_loss{suffix}", loss), (f"{split}_acc{suffix}", acc)):
                    column = columns.setdefault(name, np.full(len(ids_all), np.nan))
                    column[group] = value.double().cpu().numpy()
    return columns


@torch.no_grad()
def client_rows(
    algorithm: Algorithm,
    downlink_for: DownlinkFor | Params,
    states: ClientState,
    pools: dict[str, ClientPool],
    personalization: Personalization | None = None,
    chunk_size: int | None = None,
    clients: np.ndarray | None = None,
    counts: dict[str, np.ndarray] | None = None,
) -> list[dict[str, float]]:
    """One row per evaluated client: its id, sample counts and metrics (see
    :func:`evaluate_clients`). ``counts`` replaces a pool's own sizes in the ``n_<split>``
    columns (a training split evaluated on a subsample still weighs clients by N_i)."""
    if isinstance(downlink_for, dict):
        shared = downlink_for
        downlink_for = lambda ids: shared  # noqa: E731
    ids = np.arange(len(pools["train"].sizes)) if clients is None else np.asarray(clients)
    values = evaluate_clients(
        algorithm, downlink_for, states, pools, personalization, chunk_size, ids
    )
    sizes = {split: pool.sizes for split, pool in pools.items()} | (counts or {})
    columns = {
        "client": ids,
        **{f"n_{s}": sizes[s][ids] for s in pools},
        **{f"n_{s}_known": pool.known[ids] for s, pool in pools.items() if s != "train"},
        **values,
    }
    lists = {k: v.tolist() for k, v in columns.items()}
    return [dict(zip(lists, values)) for values in zip(*lists.values())]


def evaluate_pools(
    algorithm: Algorithm,
    downlink_for: DownlinkFor | Params,
    states: ClientState,
    pools: dict[str, ClientPool],
    personalization: Personalization | None = None,
    chunk_size: int | None = None,
    counts: dict[str, np.ndarray] | None = None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Evaluate every client's personalized model on each of its splits.

    ``downlink_for`` may be a shared downlink (a parameter dict) or a function of client ids.

    Returns:
        Summary metrics (see :func:`summarize`) and one row per client.
    """
    rows = client_rows(
        algorithm, downlink_for, states, pools, personalization, chunk_size, counts=counts
    )
    return summarize(rows), rows


def evaluate(
    algorithm: Algorithm,
    downlink: Params,
    client_state: Callable[[int], ClientState],
    data: FederatedData,
    dtype: torch.dtype,
    personalization: Personalization | None = None,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Evaluate from a per-client state function (convenience form of :func:`evaluate_pools`).

    ``downlink`` is shared, or stacked per client for ``per_client_downlink`` algorithms.
    """
    states = tree.stack(client_state(i) for i in range(data.num_clients))
    device = next(iter(downlink.values())).device
    pools = build_pools(data, algorithm.label_space, dtype, device)

    def downlink_for(ids: np.ndarray) -> Params:
        if not algorithm.per_client_downlink:
            return downlink
        return {k: v[torch.as_tensor(ids)] for k, v in downlink.items()}

    return evaluate_pools(algorithm, downlink_for, states, pools, personalization)


def build_pools(
    data: FederatedData, label_space: str, dtype: torch.dtype, device: torch.device | str
) -> dict[str, ClientPool]:
    """The train, validation (when the partition has one) and test pools of ``data``."""
    if isinstance(data, GeneratedClients):
        return generated_pools(data, label_space, dtype, device)
    splits = [s for s in SPLITS if s != "val" or data.val_offsets is not None]
    return {s: ClientPool.build(data, s, label_space, dtype, device) for s in splits}


def summarize(rows: list[dict[str, float]], prefix: str = "") -> dict[str, float]:
    """Population metrics from per-client rows, for the personalized model and every view.

    ``train_loss`` is L(psi) = sum_i alpha_i l_i with alpha_i = N_i / N over ALL clients,
    ``train_acc`` likewise weighted; ``test_acc`` is the unweighted mean over clients with test
    data, ``test_acc_weighted`` the mean weighted by test samples, ``test_acc_p10`` the bottom
    decile of client accuracies; ``test_loss`` the mean over the test samples whose class the
    client trained on (``n_test_known``; the others count only as errors); ``val_*`` as
    ``test_*``. NaN (a diverged client) propagates
    into every mean it enters: no metric skips it. ``prefix`` names the population (``unseen_``).
    """
    col = lambda key: np.array([r[key] for r in rows], dtype=np.float64)  # noqa: E731
    n_train = col("n_train")
    alpha = n_train / n_train.sum()
    views = [k[len("test_acc") :] for k in rows[0] if k.startswith("test_acc")]
    out: dict[str, float] = {}
    for view in views:
        out[f"train_loss{view}"] = float(np.sum(alpha * col(f"train_loss{view}")))
        out[f"train_acc{view}"] = float(np.sum(alpha * col(f"train_acc{view}")))
        for split in ("val", "test"):
            if f"{split}_acc{view}" not in rows[0]:
                continue
            n = col(f"n_{split}")
            known = col(f"n_{split}_known") if f"n_{split}_known" in rows[0] else n
            has, scored = n > 0, known > 0
            acc, loss = col(f"{split}_acc{view}")[has], col(f"{split}_loss{view}")[scored]
            out[f"{split}_loss{view}"] = float(np.sum(known[scored] * loss) / known.sum())
            out[f"{split}_acc{view}"] = float(acc.mean())
            out[f"{split}_acc_weighted{view}"] = float(np.sum(n[has] * acc) / n.sum())
            out[f"{split}_acc_p10{view}"] = float(np.percentile(acc, 10))
    return {f"{prefix}{k}": v for k, v in out.items()}
