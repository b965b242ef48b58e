"""The algorithm contract: pure functions over parameter dicts, and the registry of algorithms.

An algorithm never loops over clients, aggregates in place, logs, does I/O, calls ``.item()`` or
branches in Python on tensor values. That is what lets the same methods run in the loop backend,
under ``torch.func.vmap`` and inside a Flower client.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.config import Config
from pflego.errors import ConfigError
from pflego.fields import check_fields, check_value, rule_of
from pflego.local import LossFn, train_steps
from pflego.loss import Objective, masked_cross_entropy
from pflego.models import SplitModel, head_logits, init_head
from pflego.optim import SGD, Optimizer, Proximal
from pflego.rng import first_visit_generator
from pflego.tree import Params
from pflego.types import (
    ClientData,
    ClientOut,
    ClientState,
    Downlink,
    RoundContext,
    Schedule,
    ServerState,
)


@dataclass(frozen=True)
class Algorithm:
    """Base class of every algorithm; subclasses add their hyperparameters as dataclass fields.

    Roles are declared, never inferred from names inside the maths: ``shared`` lists the parameter
    groups the server holds (``body``, ``head``), ``personal`` those that live on the client.
    ``label_space`` is ``global`` for a C-way head or ``local`` for a head over the client's own
    K_i classes. ``vmappable`` says whether the vectorized backend can run ``client_update``.
    """

    model: SplitModel
    client_optimizer: Optimizer = field(default_factory=SGD)
    server_optimizer: Optimizer = field(default_factory=SGD)
    head_init: str = "linear"

    shared: ClassVar[tuple[str, ...]] = ("body", "head")
    personal: ClassVar[tuple[str, ...]] = ()
    label_space: ClassVar[str] = "global"
    #: Step sizes used when the config leaves ``client_lr`` / ``server_lr`` unset (with the default
    #: SGD optimizers), so ``pflego run`` and ``pflego compare`` agree; presets may override them.
    #: Chosen across settings by benchmarks/defaults_study.py (docs/defaults.md): 0.3 had the
    #: least worst-case regret for most methods; those it did not suit set their own.
    default_client_lr: ClassVar[float] = 0.3
    default_server_lr: ClassVar[float] = 1.0
    #: False for an algorithm whose ``client_update`` cannot run under ``torch.func.vmap``; the
    #: simulator then uses the loop backend for it.
    vmappable: ClassVar[bool] = True
    #: True when ``downlink`` sends each client its own payload (stacked over the clients asked).
    per_client_downlink: ClassVar[bool] = False
    #: True when ``aggregate`` is a weighted sum of the uploads, so that clipping, noise and
    #: secure aggregation can wrap it; False for aggregates that are not sums.
    sum_aggregate: ClassVar[bool] = True
    #: True when ``client_update`` reads ``data.validation``: the client's validation split
    #: (``val_fraction``), or its training split when the run has none (with a warning).
    uses_validation: ClassVar[bool] = False
    #: Extra evaluations of the same run: for each name ``v``, a method ``predict_v`` whose
    #: metrics are logged with the suffix ``_v`` (pFedMe's global model: ``("global",)``).
    predictions: ClassVar[tuple[str, ...]] = ()
    #: The views of ``predictions`` whose ``predict_v`` reads the downlink only (never the
    #: client's state, which it receives as ``None``): evaluation computes their logits once
    #: over each split, not once per client (pFedMe's global model, FedRoD's generic one).
    downlink_predictions: ClassVar[tuple[str, ...]] = ()
    #: How ``server_round`` moves the server's parameters: ``"optimizer"``, a step of the server
    #: optimizer of size ``server_lr`` (the default); ``"sgd"``, plain steps of size ``server_lr``
    #: and no other optimizer; ``"own"``, a rule of the method's own that uses neither setting.
    #: :func:`check_settings` refuses the settings a method would ignore.
    server_step: ClassVar[str] = "optimizer"
    #: Whether ``join`` trains on ``adapt_schedule``'s batches, so that the run's ``join_epochs``
    #: sets how long a new client personalizes (False where ``join`` trains nothing, or counts its
    #: own steps).
    join_trains: ClassVar[bool] = True
    #: How the local steps move the client's parameters: ``"optimizer"``, steps of the client
    #: optimizer of size ``client_lr`` (the default); ``"sgd"``, plain gradient steps of size
    #: ``client_lr`` (with the optimizer's ``weight_decay``) and no other optimizer; ``"own"``,
    #: steps of the method's own that use neither the optimizer nor its weight decay (nor
    #: ``client_lr``, which is not refused: one step size is often given to every method).
    client_step: ClassVar[str] = "optimizer"
    #: How many public (proxy) inputs the run holds for the algorithm (FedMD's public data set),
    #: 0 for none: ``build_experiment`` draws them from the dataset's training pool and the server
    #: state starts with them as ``server["public"]["x"]`` ``[P, ...]`` (an algorithm may declare it as
    #: an option of its own, a dataclass field of the same name).
    public_size: ClassVar[int] = 0

    def __post_init__(self) -> None:
        """Check every option against the rule declared on its field (``fields.setting``)."""
        check_fields(self, f"{getattr(type(self), 'name', type(self).__name__)} ")

    # --- server side --------------------------------------------------------------------------

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """The shared model at round 0 (body, plus a C-way head when the head is shared)."""
        params = self.model.init_body(seed, dtype)
        if "head" in self.shared:
            gen = torch.Generator().manual_seed(seed + 1)
            params |= init_head(
                self.model.num_classes, self.model.feature_dim, gen, self.head_init, dtype
            )
        return params

    def init_server(self, params: Params) -> ServerState:
        """Server state: the shared parameters and the server optimizer's state."""
        return {"params": params, "opt": self.server_optimizer.init(params)}

    def initial_server(
        self, seed: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> ServerState:
        """``init_server`` of the round-0 parameters on ``device``, every floating-point leaf in
        the run's ``dtype`` (empty parameters, of a model without body ones, do not carry it)."""
        server = self.init_server(tree.to(self.init_params(seed, dtype), device))
        return {k: tree.cast(v, dtype) for k, v in server.items()}

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """What the server sends the clients.

        Shared payload by default. An algorithm with ``per_client_downlink`` returns the payloads
        of ``clients`` (int ids) stacked on axis 0, for training (and, unless
        :meth:`evaluation_downlink` says otherwise, for evaluation).
        """
        return server["params"]

    def evaluation_downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """The downlink evaluation predicts with (``predict``, ``adapt``, ``join``): the round's
        :meth:`downlink` by default. An algorithm whose downlink also carries what only local
        training reads may leave that out, which spares computing it for every evaluated client."""
        return self.downlink(server, ctx, clients)

    def send(
        self, server: ServerState, ctx: RoundContext, clients: Tensor, evaluation: bool = False
    ) -> Downlink:
        """The :class:`Downlink` of ``clients`` (int ids; ``evaluation``: the one evaluation
        predicts with), shared or per client as the algorithm declares
        (``per_client_downlink``); the round loops read one client's part with ``of``."""
        payload = self.evaluation_downlink if evaluation else self.downlink
        ids = (clients,) if self.per_client_downlink else ()
        return self.received(payload(server, ctx, *ids))

    def received(self, payload: Params) -> Downlink:
        """A payload of :meth:`downlink` as the :class:`Downlink` it is."""
        return Downlink(payload, self.per_client_downlink)

    def aggregate(self, out: ClientOut, ctx: RoundContext) -> Params:
        """Combine the cohort's uploads (stacked on axis 0); default: mean weighted by ``out.weight``."""
        return tree.weighted_sum(out.upload, out.weight / out.weight.sum())

    def server_update(
        self, server: ServerState, aggregated: Params, ctx: RoundContext
    ) -> ServerState:
        """One server-optimizer step along the aggregated pseudo-gradient (lr 1 SGD = averaging)."""
        params, opt = self.server_optimizer.update(
            server["params"], aggregated, server["opt"], ctx.server_lr
        )
        return {**server, "params": params, "opt": opt}

    def server_round(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """The server's work after the cohort ``clients`` (int ids) answered with ``out``.

        Default: ``server_update(aggregate(out))``. Algorithms that keep per-client quantities on
        the server (PGFed's A, Clustered FL's clusters) override this to see which clients spoke.
        """
        return self.server_update(server, self.aggregate(out, ctx), ctx)

    def mix(
        self, server: ServerState, states: ClientState, ctx: RoundContext, clients: Tensor
    ) -> tuple[ServerState, ClientState]:
        """Peer-to-peer step after ``server_round``: the cohort's new states, stacked in the
        order of ``clients`` (int ids), may be combined with each other before they are stored.

        Decentralized methods (D-FedEM) average with their neighbours here, and may keep in the
        server state what a newcomer would download. Default: nothing changes.
        """
        return server, states

    @property
    def mixes(self) -> bool:
        """Whether clients exchange states with each other (``mix`` is overridden)."""
        return type(self).mix is not Algorithm.mix

    def population_metrics(self, server: ServerState, states: ClientState) -> dict[str, Tensor]:
        """Scalars about all clients' stored states (stacked ``[I, ...]``), logged at every
        evaluation: D-FedEM's consensus distance. Default: none."""
        return {}

    def statistics(self, downlink: Params, data: ClientData, ctx: RoundContext) -> Params:
        """A training client's summable statistics of its training split under the evaluation
        downlink (CCVR's class-wise feature moments), which :meth:`calibrate` reads summed over
        every training client. Default: none."""
        return {}

    def calibrate(self, server: ServerState, statistics: Params, ctx: RoundContext) -> ServerState:
        """The server state an evaluation predicts with, from :meth:`statistics` summed over every
        training client (CCVR's classifier retrained on virtual features); used for that
        evaluation only and never stored. Default: the server state as it is."""
        return server

    @property
    def calibrates(self) -> bool:
        """Whether evaluation calibrates the server state first (``calibrate`` is overridden)."""
        return type(self).calibrate is not Algorithm.calibrate

    # --- client side --------------------------------------------------------------------------

    @property
    def head_width(self) -> int:
        return (
            self.model.max_local_classes if self.label_space == "local" else self.model.num_classes
        )

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        """Private state at a client's first visit (a personal head when the head is personal)."""
        if "head" not in self.personal:
            return {}
        dtype = next(iter(downlink.values())).dtype if downlink else torch.get_default_dtype()
        return init_head(self.head_width, self.model.feature_dim, generator, self.head_init, dtype)

    def first_visit_state(
        self, downlink: Params, seed: int, client: int, ctx: RoundContext, dtype: torch.dtype
    ) -> ClientState:
        """``init_client`` seeded by the client id (the same in every backend and on Flower),
        every floating-point leaf in the run's ``dtype`` (which an empty downlink lacks)."""
        state = self.init_client(downlink, first_visit_generator(seed, client), ctx)
        return tree.cast(state, dtype)

    def client_update(
        self, downlink: Params, state: ClientState, data: ClientData, ctx: RoundContext
    ) -> tuple[ClientOut, ClientState]:
        """One round of local work: returns the upload and the client's new private state."""
        raise NotImplementedError

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        """Extra named local schedules ``client_update`` needs beside the run's (``data.using``).

        For example FedRep's head and body epochs; each is drawn with its own seed per
        (round, client), so every backend and Flower node sees the same batches.
        """
        return {}

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """Logits of the client's personalized model."""
        return self.model.forward({**downlink, **state}, x)

    @property
    def features_from_downlink(self) -> bool:
        """Whether ``predict(d, s, x) == predict_head(d, s, model.features(d, x))``.

        True for the default ``predict`` when the body is shared, not personal, and the same for
        every client: evaluation then runs the body once over all clients' samples in large
        batches and only the heads per client (a state that holds ``body.*`` entries, as an
        adapted one may, is evaluated whole).
        """
        return (
            not self._own_predict
            and "body" in self.shared
            and "body" not in self.personal
            and not self.per_client_downlink
        )

    def predict_head(self, downlink: Params, state: ClientState, features: Tensor) -> Tensor:
        """``predict``'s logits from the body's features (see ``features_from_downlink``)."""
        return head_logits({**downlink, **state}, features)

    # --- evaluation-time personalization ------------------------------------------------------

    def adapt(
        self, downlink: Params, state: ClientState, data: ClientData, ctx: RoundContext
    ) -> ClientState:
        """Personalize before evaluation on the client's training split (fine-tuning, a step).

        Runs vectorized like ``client_update`` on ``adapt_schedule``'s batches; the result is used
        for that evaluation only and never stored. Default: the state unchanged.
        """
        return state

    def join(
        self, downlink: Params, state: ClientState, data: ClientData, ctx: RoundContext
    ) -> ClientState:
        """How a client that never trained personalizes from its first-visit state (``adapt``)."""
        return self.adapt(downlink, state, data, ctx)

    def fit_head(
        self, downlink: Params, head: ClientState, data: ClientData, ctx: RoundContext
    ) -> ClientState:
        """``head`` trained on the frozen features of ``downlink``'s body.

        How a new client of a personal-head method personalizes (``join``): the body stays fixed
        and the head takes ``adapt_schedule``'s steps with the client optimizer and step size.
        """
        return self.train_head(downlink, head, data, ctx)

    def adapt_schedule(self, run: Schedule) -> Schedule:
        """The local schedule ``adapt`` and ``join`` run on (default: the run's own)."""
        return run

    @property
    def adapts(self) -> bool:
        """Whether evaluation personalizes first (``adapt`` is overridden)."""
        return type(self).adapt is not Algorithm.adapt

    # --- helpers shared by the weight-averaging methods -----------------------------------------

    # A subclass that writes its own ``loss`` / ``head_loss`` declares no objective: its steps
    # differentiate that function. One that writes its own ``predict`` may not read the shared
    # body's features (``features_from_downlink``).
    _own_loss = _own_head_loss = _own_predict = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._own_loss = cls._own_loss or "loss" in vars(cls)
        cls._own_head_loss = cls._own_head_loss or "head_loss" in vars(cls)
        cls._own_predict = cls._own_predict or "predict" in vars(cls)

    def loss(
        self, params: Params, x: Tensor, y: Tensor, mask: Tensor, label_mask: Tensor
    ) -> Tensor:
        """Masked cross-entropy of the whole model on a batch."""
        return masked_cross_entropy(self.model.forward(params, x), y, mask, label_mask)

    def head_loss(
        self, head: Params, features: Tensor, y: Tensor, mask: Tensor, label_mask: Tensor
    ) -> Tensor:
        """Masked cross-entropy of a head on precomputed features."""
        return masked_cross_entropy(head_logits(head, features), y, mask, label_mask)

    def model_objective(self, label_mask: Tensor, fixed: Params | None = None) -> LossFn:
        """``loss`` on a client's minibatch with ``fixed`` parameters held, as its declared
        :class:`~pflego.loss.Objective` (the model's cross-entropy, whose steps may run fused),
        or, where a subclass writes its own ``loss``, as a function of that."""
        held = fixed or {}
        if not self._own_loss:
            return Objective(self.model, label_mask, held)
        return lambda p, x, y, m: self.loss({**held, **p}, x, y, m, label_mask)

    def head_objective(self, label_mask: Tensor) -> LossFn:
        """``head_loss`` as a loss of the head on precomputed features (see
        :meth:`model_objective`)."""
        if not self._own_head_loss:
            return Objective(None, label_mask)
        return lambda h, f, y, m: self.head_loss(h, f, y, m, label_mask)

    def train(
        self,
        params: Params,
        data: ClientData,
        ctx: RoundContext,
        fixed: Params | None = None,
        anchor: Params | None = None,
        strength: float = 0.0,
        linear: Params | None = None,
    ) -> tuple[Params, Tensor]:
        """Local steps on the model's loss from ``params``, with ``fixed`` parameters held.

        The optimizer state starts fresh. With ``anchor``, the steps descend the loss plus the
        proximal term ``strength / 2 * ||params - anchor||^2`` (FedProx, Ditto) and, with
        ``linear``, minus ``<linear, params>`` (FedDyn), whose gradients the optimizer adds in
        closed form (:class:`~pflego.optim.Proximal`). Returns the trained parameters and the
        mean loss over the real steps; the terms' values are left out of it, so a fused step
        does not compute ``||params - anchor||^2`` at every step.
        """
        loss = self.model_objective(data.label_mask, fixed)
        opt = self.client_optimizer
        if anchor is not None and (strength != 0 or linear is not None):
            opt = Proximal(opt, strength, anchor, linear=linear)
        trained, _, mean_loss = train_steps(
            loss, params, data, opt, opt.init(params), ctx.client_lr
        )
        return trained, mean_loss

    def train_head(self, body: Params, head: Params, data: ClientData, ctx: RoundContext) -> Params:
        """Head-only local steps with the body fixed: its features are computed once and reused
        (``body`` may hold more than the body's entries)."""
        features = self.model.features(body, data.x).detach()
        loss = self.head_objective(data.label_mask)
        opt = self.client_optimizer
        trained, _, _ = train_steps(
            loss, head, data._replace(x=features), opt, opt.init(head), ctx.client_lr
        )
        return trained


@dataclass(frozen=True)
class FixedHead(Algorithm):
    """An algorithm whose server also holds a head that no step changes (FedBABU's shared head,
    FedRecon's initial head W0).

    ``init_params`` returns the body and that head; the server keeps the head in ``server["head"]``,
    beside the shared parameters and outside the server optimizer, and sends it with them.
    """

    shared: ClassVar[tuple[str, ...]] = ("body",)

    def init_server(self, params: Params) -> ServerState:
        body = tree.select(params, self.shared)
        return {
            "params": body,
            "head": tree.select(params, ["head"]),
            "opt": self.server_optimizer.init(body),
        }

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        return {**server["params"], **server["head"]}


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(name: str):
    """Class decorator that adds an algorithm to the registry."""

    def wrap(cls: type[Algorithm]) -> type[Algorithm]:
        if name in ALGORITHMS and ALGORITHMS[name].__module__ != cls.__module__:
            raise ValueError(f"algorithm {name!r} is registered twice")
        cls.name = name
        ALGORITHMS[name] = cls
        return cls

    return wrap


def hyperparameters(cls: type[Algorithm]) -> dict[str, Any]:
    """An algorithm's own options and their defaults (the fields beyond the base class)."""
    base = {f.name for f in dataclasses.fields(Algorithm)}
    return {
        f.name: f.default
        for f in dataclasses.fields(cls)
        if f.name not in base and f.default is not dataclasses.MISSING
    }


def check_options(name: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """An algorithm's options checked against their fields' types and declared rules (ints
    widened to floats where needed).

    Needs no model, so a whole experiment's configs can be checked before anything is built.
    """
    if name not in ALGORITHMS:
        raise ConfigError(
            f"unknown algorithm {name!r}; choose one of {', '.join(sorted(ALGORITHMS))}"
        )
    cls = ALGORITHMS[name]
    known = hyperparameters(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name in known}
    hints = typing.get_type_hints(cls)
    checked = {}
    for key, value in (options or {}).items():
        if key not in known:
            valid = ", ".join(sorted(known)) or "none"
            raise ConfigError(f"{name} has no option {key!r}; its options are: {valid}")
        checked[key] = option_value(name, fields[key], hints[key], value)
    return checked


def option_value(name: str, field: dataclasses.Field, hint: Any, value: Any) -> Any:
    """``value`` of the option ``field`` of algorithm ``name``, checked against its type
    ``hint`` (an int widened to a float where a float is due) and its declared rule."""
    if value is None and field.default is None:
        return None
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = tuple(k for k in typing.get_args(hint) if k is not type(None)) if union else (hint,)
    if all(isinstance(k, type) for k in kinds):  # (isinstance cannot check Literal, generics)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"option {field.name}={value!r} of {name} must be a {names}")
    check_value(field.name, value, rule_of(field), f"{name} ")
    return value


def check_settings(config: Config) -> None:
    """Refuse, with a one-line ``ConfigError``, a run setting that ``config.algorithm`` would
    accept and then ignore: a client optimizer its local steps do not take, a server optimizer or
    ``server_lr`` its own server rule does not use, ``join_epochs`` where new clients do not train.

    Needs no model or data, so a whole experiment's configs can be checked before anything runs.
    """
    name = config.algorithm
    check_options(name, {})  # an unknown algorithm is an error of its own
    cls = ALGORITHMS[name]
    if cls.client_step != "optimizer" and config.client_optimizer != "sgd":
        steps = "plain gradient steps" if cls.client_step == "sgd" else "local steps of its own"
        raise ConfigError(
            f"{name} takes {steps}, so client_optimizer={config.client_optimizer} would be "
            "ignored; remove it (or set sgd)"
        )
    if cls.client_step == "own" and config.weight_decay:
        raise ConfigError(
            f"{name} takes local steps of its own, so weight_decay={config.weight_decay} would "
            "be ignored; remove it"
        )
    if cls.server_step != "optimizer" and config.server_optimizer != "sgd":
        uses = (
            "plain steps of server_lr" if cls.server_step == "sgd" else "a server rule of its own"
        )
        raise ConfigError(
            f"{name} moves its server models by {uses}, so server_optimizer="
            f"{config.server_optimizer} would be ignored; remove it (or set sgd)"
        )
    lr = config.server_lr
    if cls.server_step == "own" and lr is not None and lr != cls.default_server_lr:
        raise ConfigError(
            f"{name} moves its server state by a rule of its own, so server_lr={lr} would be "
            f"ignored; remove it (or set {cls.default_server_lr})"
        )
    if config.join_epochs is not None and not cls.join_trains:
        raise ConfigError(
            f"{name}'s new clients take no local steps whose length join_epochs could set, so "
            f"join_epochs={config.join_epochs} would be ignored; remove it"
        )


def build_algorithm(
    name: str, model: SplitModel, options: dict[str, Any] | None = None, **common: Any
) -> Algorithm:
    """Instantiate a registered algorithm, checking its options."""
    options = check_options(name, options)
    return ALGORITHMS[name](model=model, **common, **options)
