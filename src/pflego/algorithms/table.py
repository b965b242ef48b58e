"""The server's table of every client's latest model, for the methods whose server keeps one.

Not a method of its own: the piece of state that these papers share, written once. In their
symbols, the server holds ``{theta_j}_{j=1..I}`` (or ``w_j``), each client's model as it last
uploaded it, and builds client i's payload from that table by the method's own rule:
- FedAMP: Huang et al., "Personalized Cross-Silo Federated Learning on Non-IID Data", AAAI 2021,
  arXiv:2007.03797 (cloud model ``u_i = sum_j xi_ij w_j``);
- FedFomo: Zhang et al., "Personalized Federated Learning with First Order Model Optimization",
  ICLR 2021, arXiv:2012.08565 (client i downloads M other clients' ``theta_j``);
- FedAP: Lu et al., "Personalized Federated Learning with Adaptive Batchnorm for Healthcare",
  IEEE TBD 2022, arXiv:2112.00734 (``w_i = sum_j lambda_ij w_j`` from batch-norm statistics);
- MetaFed: Chen et al., "MetaFed: Federated Learning among Federations with Cyclic Knowledge
  Distillation for Personalized Healthcare", IEEE TNNLS 2023, arXiv:2206.08516 (the teacher
  ``theta_{i-1}``);
- pFedSim: Tan et al., "pFedSim: Similarity-Aware Model Aggregation Towards Personalized Federated
  Learning", arXiv:2305.15706 (feature extractors mixed by classifier similarity);
- FedMTL: PFLlib's federated multi-task learning after Smith et al., "Federated Multi-Task
  Learning", NeurIPS 2017, arXiv:1705.10467 (the sum of the other cohort members' models).
Each method's file gives its rule in full; this module only stores and reads the table.
"""

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
