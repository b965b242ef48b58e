"""The server's table of every client's latest model, for the methods whose server keeps one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm
from pflego.tree import Params
from pflego.types import ClientOut, RoundContext, ServerState

OWN = "model."  # the prefix of the model a client uploads


@dataclass(frozen=True)
class ModelTable(Algorithm):
    """An algorithm whose server keeps every client's latest model (FedMTL, MetaFed, FedAP,
    pFedSim, FedAMP, FedFomo).

    The table ``server["models"]`` ``[I, ...]`` holds the model each client last uploaded (its
    ``model.*`` entries); the initial model ``server["params"]`` stands in for a client that has
    not uploaded yet (the whole table before the first :meth:`store`). Each client is sent its
    own payload, the server's rule is the method's own and is no weighted sum of the uploads.
    """

    per_client_downlink: ClassVar[bool] = True
    sum_aggregate: ClassVar[bool] = False  # the server keeps every model
    server_step: ClassVar[str] = "own"

    def init_server(self, params: Params) -> ServerState:
        """The initial model; the table appears at the first :meth:`store`."""
        return {"params": params}

    def initial(self, server: ServerState, clients: Tensor | None = None) -> Params:
        """The initial model, stacked for ``clients`` (int ids); as it is without them."""
        params = server["params"]
        if clients is None:
            return params
        return {k: v.expand(len(clients), *v.shape) for k, v in params.items()}

    def stored(self, server: ServerState, ctx: RoundContext) -> Params:
        """Every client's latest model ``[I, ...]`` (the initial model for one never stored)."""
        if "models" in server:
            return server["models"]
        return {k: v.expand(ctx.num_clients, *v.shape) for k, v in server["params"].items()}

    def store(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """``server`` with the cohort's uploaded models written in their rows of the table."""
        uploads = tree.strip_prefix(OWN, out.upload)
        models = {k: v.clone() for k, v in self.stored(server, ctx).items()}
        for k, v in models.items():
            v[clients.to(v.device)] = uploads[k].to(v)
        return {**server, "models": models}

    def server_round(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """Store the cohort's models."""
        return self.store(server, out, ctx, clients)
