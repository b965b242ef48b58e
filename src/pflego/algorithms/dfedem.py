"""D-FedEM: FedEM without a server, clients averaging components with their neighbours.

Marfoq, Neglia, Bellet, Kameni, Vidal. "Federated Multi-Task Learning under a Mixture of
Distributions". NeurIPS 2021; arXiv:2108.10252 (Section 3.3, Alg. 4, App. J.1).

Each client i keeps its own copy theta_{m,i} of the M components and its weights pi_i. A round:
every active client runs FedEM's local round on its own copy (E-step, weight update, one epoch on
the responsibility-weighted losses), then sets ``theta_{m,i} <- sum_j W_ij theta_{m,j}`` over its
neighbours with a symmetric doubly stochastic mixing matrix W (the ``mix`` step of the contract;
nothing is uploaded and there is no server step).

Options: ``graph`` (``erdos-renyi`` with ``edge_probability``, the paper's p = 0.5; ``ring``;
``complete``), ``mixing`` (``fast``: fastest-mixing weights as the paper, ``metropolis``:
Metropolis–Hastings), ``new_graph_every_round`` (a fresh draw each round; default one graph),
``graph_seed``. With partial participation only the cohort gossips, with weights computed on the
links among its members. On a complete graph Metropolis–Hastings weights are uniform, and with
full participation and equal N_i D-FedEM is FedEM.

Symbols to code: theta_{m,i} -> the client state's ``body.*`` / ``head.*`` (leading axis M),
pi_i -> ``mixture.weights``, W -> :func:`pflego.graphs.mixing_matrix`. The logged
``consensus_distance`` is ``(1/I) sum_i ||theta_i - mean_j theta_j||^2`` over all components.
There is no server step, so a run that sets a server optimizer or ``server_lr`` is refused, and
``join_epochs`` too (a new client runs ``join_em_steps`` E-steps, as in FedEM).

Bookkeeping that is not part of the method: after every mix the simulator stores the average of
the active clients' components as the server state. Clients use it only at their first visit (the
initial components at round 0, identical for every client as in the authors' code) and a new
client (``join``) starts from it: the components the network agrees on.

Differences from the authors' code: their fast-mixing weights come from an SDP solver (cvxpy) and
are then multiplied by the adjacency matrix, which sets every client's self-weight to 0 before
renormalizing; here the paper's fastest-mixing problem is solved by projected subgradient (see
:func:`pflego.graphs.fastest_mixing`) and self-weights are kept, so W stays the paper's. The code
allows full participation only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pflego import graphs, tree
from pflego.algorithms.base import register
from pflego.algorithms.fedem import WEIGHTS, FedEM
from pflego.fields import between, one_of, setting
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext


@register("d-fedem")
@dataclass(frozen=True)
class DFedEM(FedEM):
    graph: str = setting("erdos-renyi", "the clients' communication graph", one_of(*graphs.GRAPHS))
    edge_probability: float = setting(
        0.5, "the probability of each edge of the erdos-renyi graph", between(0, 1, "(]")
    )
    mixing: str = setting(
        "fast",
        "the mixing weights: fast (fastest-mixing, as the paper) or metropolis",
        one_of(*graphs.MIXINGS),
    )
    new_graph_every_round: bool = setting(
        False, "draw a fresh graph every round (default: one for the run)"
    )
    graph_seed: int = setting(0, "the seed of the graph's draw")

    #: every client keeps its own copy of the components beside its weights
    personal: ClassVar[tuple[str, ...]] = ("body", "head", "mixture")
    server_step: ClassVar[str] = "own"  # no server: the clients mix with their neighbours

    @staticmethod
    def own_components(state: ClientState) -> Params:
        return {k: v for k, v in state.items() if k != WEIGHTS}

    def init_client(self, downlink, generator, ctx: RoundContext) -> ClientState:
        return {**tree.map_(torch.clone, downlink), **super().init_client(downlink, generator, ctx)}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        components = self.own_components(state)
        trained, weights, mean_loss = self.em_round(components, state[WEIGHTS], data, ctx)
        return ClientOut({}, data.num_samples, {"loss": mean_loss}), {**trained, WEIGHTS: weights}

    def server_round(self, server, out, ctx, clients):
        return server  # no server: the clients mix with each other

    def mixing_weights(self, ctx: RoundContext, clients: torch.Tensor) -> torch.Tensor:
        """W among the active ``clients`` this round (float64, host)."""
        seed = (self.graph_seed, ctx.round) if self.new_graph_every_round else (self.graph_seed,)
        members = tuple(int(c) for c in clients.tolist())
        matrix = graphs.mixing_matrix(
            self.graph, self.mixing, ctx.num_clients, self.edge_probability, seed, members
        )
        return torch.from_numpy(matrix)

    def mix(self, server, states, ctx: RoundContext, clients):
        weights = self.mixing_weights(ctx, clients)
        mixed = {
            k: torch.tensordot(weights.to(v.device, v.dtype), v, dims=1)
            for k, v in self.own_components(states).items()
        }
        average = {k: v.mean(0) for k, v in mixed.items()}
        return {**server, "params": average}, {**states, **mixed}

    def population_metrics(self, server, states):
        return {"consensus_distance": graphs.consensus_distance(self.own_components(states))}

    def predict(self, downlink, state, x):
        return self.mixture_log_probs(self.own_components(state), state[WEIGHTS], x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A new client: FedEM's E-steps from uniform weights on the network's average components."""
        components = self.own_components(state)
        return {**state, **super().join(components, state, data, ctx)}
