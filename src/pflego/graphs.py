"""Communication graphs and mixing matrices of decentralized (peer-to-peer) training.

A mixing matrix W is symmetric, doubly stochastic and nonnegative, with ``W_ij > 0`` only for
neighbours (and i itself): one gossip step sets every client's parameters to
``x_i <- sum_j W_ij x_j``. Its second largest eigenvalue modulus (SLEM) decides how fast the
clients reach consensus: the deviation from the average shrinks by at least that factor per step.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

GRAPHS = ("erdos-renyi", "ring", "complete")
MIXINGS = ("fast", "metropolis")


def adjacency(kind: str, n: int, edge_probability: float, rng: np.random.Generator) -> np.ndarray:
    """Boolean adjacency ``[n, n]`` (symmetric, no self-loops) of a graph over ``n`` clients.

    ``erdos-renyi``: each pair is linked with probability ``edge_probability`` (a binomial graph,
    as in FedEM's experiments); ``ring``: i is linked to i +- 1; ``complete``: every pair (the
    options that name them declare :data:`GRAPHS`).
    """
    if kind == "complete":
        adj = np.ones((n, n), dtype=bool)
    elif kind == "ring":
        adj = np.zeros((n, n), dtype=bool)
        i = np.arange(n)
        adj[i, (i + 1) % n] = adj[(i + 1) % n, i] = n > 1
    else:
        upper = np.triu(rng.random((n, n)) < edge_probability, 1)
        adj = upper | upper.T
    np.fill_diagonal(adj, False)
    return adj


def metropolis_hastings(adj: np.ndarray) -> np.ndarray:
    """``W_ij = 1 / (1 + max(d_i, d_j))`` on edges, the rest of each row on the diagonal."""
    degree = adj.sum(1)
    weights = np.where(adj, 1.0 / (1.0 + np.maximum(degree[:, None], degree[None, :])), 0.0)
    return weights + np.diag(1.0 - weights.sum(1))


def _cap_node_sums(w: np.ndarray, around: list[np.ndarray]) -> np.ndarray:
    """Make edge weights feasible: nonnegative, and at most 1 in total around every node.

    Node by node (``around[i]``: the edges at node i), the weights of an overfull node are
    projected onto ``{z >= 0, sum z = 1}``; this only lowers weights, so nodes already handled
    stay feasible.
    """
    w = np.maximum(w, 0.0)
    for edges in around:
        z = w[edges]
        if z.sum() <= 1.0:
            continue
        z = np.sort(z)[::-1]
        cumulative = np.cumsum(z) - 1.0
        k = np.flatnonzero(z - cumulative / np.arange(1, len(z) + 1) > 0)[-1]
        w[edges] = np.maximum(w[edges] - cumulative[k] / (k + 1), 0.0)
    return w


def fastest_mixing(adj: np.ndarray, iterations: int = 200) -> np.ndarray:
    """Fastest-mixing weights (Boyd, Diaconis, Xiao, "Fastest Mixing Markov Chain on a Graph",
    SIAM Review 2004): the symmetric W on the graph that minimizes the SLEM.

    FedEM's code solves this semidefinite program with cvxpy; here the paper's projected
    subgradient method on the edge weights runs from the Metropolis–Hastings weights and keeps
    the best iterate, so the result mixes at least as fast as Metropolis–Hastings.
    """
    n = len(adj)
    edges = np.argwhere(np.triu(adj, 1))
    i, j = edges[:, 0], edges[:, 1]
    around = [np.flatnonzero((i == node) | (j == node)) for node in range(n)]

    def matrix(w: np.ndarray) -> np.ndarray:
        out = np.zeros((n, n))
        out[i, j] = out[j, i] = w
        return out + np.diag(1.0 - out.sum(1))

    w = metropolis_hastings(adj)[i, j]
    best, best_slem = None, np.inf
    for k in range(1, iterations + 1):
        current = matrix(w)
        eig, vec = (t.numpy() for t in torch.linalg.eigh(torch.from_numpy(current)))
        value = max(abs(eig[0]), abs(eig[-2])) if n > 1 else 0.0
        if value < best_slem:
            best, best_slem = current, value
        if len(edges) == 0 or value < 1e-12:
            break
        if abs(eig[-2]) >= abs(eig[0]):  # lambda_2 is the SLEM: raising w_l lowers it
            u = vec[:, -2]
            g = -((u[i] - u[j]) ** 2)
        else:  # -lambda_n is the SLEM: raising w_l raises it
            u = vec[:, 0]
            g = (u[i] - u[j]) ** 2
        norm = np.linalg.norm(g)
        if norm == 0:
            break
        w = _cap_node_sums(w - 0.5 * g / (norm * np.sqrt(k)), around)
    return best


@lru_cache(maxsize=16)
def mixing_matrix(
    graph: str,
    mixing: str,
    n: int,
    edge_probability: float,
    seed: tuple[int, ...],
    members: tuple[int, ...],
) -> np.ndarray:
    """The mixing matrix among ``members`` (client ids) of a graph over ``n`` clients.

    The graph is drawn with ``seed`` (integer keys); only links between members are used (clients outside the
    cohort do not gossip), and the weights are computed on that subgraph.
    """
    full = adjacency(graph, n, edge_probability, np.random.default_rng(list(seed)))
    adj = full[np.ix_(members, members)]
    return fastest_mixing(adj) if mixing == "fast" else metropolis_hastings(adj)


def consensus_distance(stacked: dict[str, Tensor]) -> Tensor:
    """``(1/I) sum_i ||x_i - mean_j x_j||^2`` over all leaves stacked ``[I, ...]``."""
    total = torch.zeros((), dtype=torch.float64)
    for v in stacked.values():
        v = v.double()
        total = total + ((v - v.mean(0)) ** 2).sum() / len(v)
    return total
