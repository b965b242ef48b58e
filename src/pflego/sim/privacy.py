"""Client-level differential privacy of the shared parameters: clipping, Gaussian noise, accounting.

One wrapper, used by the simulator's round loop and by the Flower server alike, around an
algorithm's ``aggregate`` (only algorithms whose aggregate is a weighted sum, ``sum_aggregate``,
and whose ``server_round`` is the default ``server_update(aggregate(...))``):

- **Clipping.** Each client's upload ``u_c`` (all its tensors as one vector) becomes
  ``u_c * min(1, C / ||u_c||)``.
- **Central noise** (default). The server computes the algorithm's own aggregate
  ``A = sum_c lambda_c u_c`` of the clipped uploads and adds ``N(0, (sigma * Delta)^2)`` to every
  coordinate, where ``Delta`` is the L2 sensitivity of ``A`` to one client: how far ``A`` can move
  when one client's data change, for any cohort the sampler can draw. ``sigma`` (``dp_noise``) is
  thus the noise multiplier the accountant sees. For an unweighted sum ``Delta = C`` and the noise
  is ``sigma * C``; for a weighted sum the weights scale it:

  * coefficients that depend only on the client (PFLEGO: ``lambda_c = (I/r) alpha_c``): adding or
    removing client j moves ``A`` by ``lambda_j u_j``, so ``Delta = C max_j lambda_j`` (Poisson
    sampling, add/remove-one neighbours); replacing it, by at most ``2 C max_j lambda_j``
    (fixed-size sampling, replace-one neighbours);
  * a weighted mean (FedAvg, FedPer: ``lambda_c = N_c / sum_cohort N``): adding or removing j
    moves ``A`` by ``lambda_j (u_j - A_without_j)``, at most ``2 C lambda_j``, with ``lambda_j``
    largest when j is the largest client among the smallest others; replacing j moves it by at
    most ``4 C lambda_max`` (and never more than the diameter ``2 C``).

  The coefficients are read off the algorithm's ``aggregate`` itself (it is linear: applied to
  one-hot uploads it returns them) on the worst cohort of the population's sample counts, so the
  calibration follows whatever weighted sum the algorithm computes. The aggregation weights
  (``ClientOut.weight``) must be uniform or proportional to the clients' sample counts N_i,
  which, like I, N and r, are treated as public.
- **Local noise** (``dp_local``). Each client adds ``N(0, (sigma * C)^2)`` to its own clipped
  upload before sending it; the server aggregates as usual.

Noise is drawn in float64 on the CPU from generators seeded by (seed, round) on the server and
(seed, round, client) on a client, so the simulator and Flower give the same numbers.

**Accounting** (Google's ``dp-accounting``, RDP accountant): one round is a subsampled Gaussian
mechanism with noise multiplier ``sigma``: ``SampledWithoutReplacementDpEvent(I, r, .)`` with
replace-one neighbours for fixed-size cohorts, ``PoissonSampledDpEvent(p, .)`` with add/remove-one
neighbours for Bernoulli participation, composed over the rounds run. With local noise each
client's release is a Gaussian mechanism of multiplier ``sigma / 2`` (a clipped upload moves by
up to 2C), composed over every round (no amplification: the server sees who answered). What is
protected is client-level: the shared parameters (every upload's influence on them); personal
heads and other private states never leave the client and are not released.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm
from pflego.errors import ConfigError
from pflego.rng import seed_for
from pflego.tree import Params
from pflego.types import ClientOut, RoundContext, ServerState

#: RDP orders the accountant evaluates (the library's defaults minus the orders above 64, whose
#: sampled-without-replacement bounds are slow to compute and never the best below epsilon 100).
ORDERS = (1.25, 1.5, 1.75, 2, 2.25, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24,
          28, 32, 40, 48, 56, 64)  # fmt: skip
CENTRAL_STREAM, LOCAL_STREAM = 6, 7


def _dp_accounting():
    try:
        import dp_accounting
    except ModuleNotFoundError:
        raise ConfigError(
            "differential privacy needs Google's dp-accounting: pip install 'pflego[dp]'"
        ) from None
    return dp_accounting


@dataclass(frozen=True)
class Accountant:
    """The privacy spent by a run: epsilon at ``delta`` after t rounds.

    Attributes:
        noise: The noise multiplier sigma.
        population: I, the number of clients.
        cohort: r, the (expected) cohort size.
        sampling: ``fixed`` (exactly r without replacement) or ``bernoulli`` (each with p = r/I).
        delta: The delta epsilon is reported at.
        local: Noise added by each client instead of the server.
    """

    noise: float
    population: int
    cohort: float
    sampling: str
    delta: float
    local: bool = False

    def event(self, rounds: int, noise: float | None = None):
        """The dp-accounting event of ``rounds`` rounds (at multiplier ``noise``, default sigma)."""
        dpa = _dp_accounting()
        sigma = self.noise if noise is None else noise
        if self.local:
            return dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma / 2), rounds)
        gaussian = dpa.GaussianDpEvent(sigma)
        if self.sampling == "fixed":
            one = dpa.SampledWithoutReplacementDpEvent(self.population, int(self.cohort), gaussian)
        else:
            one = dpa.PoissonSampledDpEvent(self.cohort / self.population, gaussian)
        return dpa.SelfComposedDpEvent(one, rounds)

    def fresh(self):
        """An empty RDP accountant with the neighbouring relation of the sampling."""
        dpa = _dp_accounting()
        relation = (
            dpa.NeighboringRelation.REPLACE_ONE
            if self.sampling == "fixed" and not self.local
            else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        )
        return dpa.rdp.RdpAccountant(list(ORDERS), neighboring_relation=relation)

    @functools.lru_cache(maxsize=512)  # noqa: B019  (frozen and hashable; a handful per run)
    def epsilon(self, rounds: int) -> float:
        """Epsilon at ``delta`` after ``rounds`` rounds (infinite without noise, 0 before any)."""
        if rounds == 0:
            return 0.0
        if self.noise == 0:
            return math.inf
        try:
            return float(self.fresh().compose(self.event(rounds)).get_epsilon(self.delta))
        except (ArithmeticError, ValueError):  # noise too small for the accountant's arithmetic
            return math.inf

    @functools.lru_cache(maxsize=16)  # noqa: B019  (once a process: every Flower node's sigma)
    def calibrate(self, target_epsilon: float, rounds: int) -> float:
        """The noise multiplier whose epsilon after ``rounds`` rounds is ``target_epsilon``."""
        dpa = _dp_accounting()
        try:
            with warnings.catch_warnings():  # numpy overflows while bracketing a huge epsilon
                warnings.simplefilter("ignore", RuntimeWarning)
                return float(
                    dpa.calibrate_dp_mechanism(
                        self.fresh,
                        lambda sigma: self.event(rounds, sigma),
                        target_epsilon,
                        self.delta,
                        dpa.LowerEndpointAndGuess(1e-3, 1.0),
                        tol=1e-4,
                    )
                )
        except (
            ArithmeticError,
            ValueError,
            dpa.mechanism_calibration.NoBracketIntervalFoundError,
        ) as exc:
            raise ConfigError(
                f"no noise multiplier gives epsilon {target_epsilon:g} at delta {self.delta:g} "
                f"over {rounds} rounds ({type(exc).__name__}); choose another dp_target_epsilon "
                "or give dp_noise"
            ) from None


def clip(upload: Params, norm: float) -> Params:
    """Each row of stacked uploads ``[C, ...]`` scaled to L2 norm at most ``norm`` (all leaves)."""
    squares = sum(v.double().reshape(v.shape[0], -1).pow(2).sum(1) for v in upload.values())
    scale = (norm / squares.sqrt().clamp(min=1e-300)).clamp(max=1.0)
    return {k: v * scale.to(v.dtype).reshape(-1, *[1] * (v.dim() - 1)) for k, v in upload.items()}


def gaussian_like(params: Params, std: float, seed: int) -> Params:
    """Gaussian noise of standard deviation ``std`` shaped like ``params`` (float64 on the CPU,
    leaves in sorted order, then cast), the same on every machine for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    draws = {
        k: torch.randn(params[k].shape, generator=generator, dtype=torch.float64) * std
        for k in sorted(params)
    }
    return {k: draws[k].to(device=v.device, dtype=v.dtype) for k, v in params.items()}


def coefficients(algorithm: Algorithm, weights: Tensor, ctx: RoundContext) -> Tensor:
    """``lambda_c``: the algorithm's aggregate of one-hot uploads with these weights."""
    probe = torch.eye(len(weights), dtype=torch.float64)
    return algorithm.aggregate(ClientOut({"probe": probe}, weights.double(), {}), ctx)["probe"]


@dataclass(frozen=True)
class Privacy:
    """A run's differential privacy: clipping norm, noise, sampling, and the population's sizes.

    Attributes:
        clip: C, the clipping norm of each upload.
        accountant: The noise multiplier sigma, sampling and delta (and local or central).
        seed: The run's seed (noise streams are seeded by it).
        sizes: The training sample count N_i of every client (public, for the sensitivity).
    """

    clip: float
    accountant: Accountant
    seed: int
    sizes: tuple[int, ...]

    @property
    def noise(self) -> float:
        return self.accountant.noise

    @property
    def local(self) -> bool:
        return self.accountant.local

    @classmethod
    def build(cls, config: Any, algorithm: Algorithm, sizes: Tensor):
        """The privacy of a run whose training clients have ``sizes`` samples, or ``None``
        without ``dp_clip``; refuses what it cannot wrap or account for."""
        if config.dp_clip is None:
            return None
        population = len(sizes)
        if config.sampling == "fixed":  # r as the round loop draws it
            cohort = max(1, round(config.participation * population))
        elif config.sampling == "bernoulli":
            cohort = config.participation * population
        else:
            raise ConfigError(
                f"differential privacy accounts for fixed and bernoulli sampling, not "
                f"sampling={config.sampling}"
            )
        name = getattr(algorithm, "name", type(algorithm).__name__)
        if not algorithm.sum_aggregate or type(algorithm).server_round is not (
            Algorithm.server_round
        ):
            raise ConfigError(
                f"differential privacy wraps weighted-sum aggregates only, and {name}'s server "
                "step is not one; drop the dp_ settings for it"
            )
        accountant = Accountant(
            config.dp_noise or 0.0,
            population,
            cohort,
            config.sampling,
            config.dp_delta,
            config.dp_local,
        )
        _dp_accounting()  # fail before training when the accountant is missing
        if config.dp_target_epsilon is not None:
            sigma = accountant.calibrate(config.dp_target_epsilon, config.rounds)
            accountant = dataclasses.replace(accountant, noise=sigma)
        return cls(config.dp_clip, accountant, config.seed, tuple(int(n) for n in sizes))

    # --- the clients' side ----------------------------------------------------------------------

    def on_clients(self, out: ClientOut, clients, t: int) -> ClientOut:
        """With local noise: each client's clipped upload plus its own noise (stacked ``[C, ...]``).

        Unchanged under central noise (the server clips)."""
        if not self.local:
            return out
        clipped = clip(out.upload, self.clip)
        noisy = []
        for c, client in enumerate(clients):
            one = {k: v[c] for k, v in clipped.items()}
            seed = seed_for(self.seed, LOCAL_STREAM, t, int(client))
            noisy.append(tree.add(one, gaussian_like(one, self.noise * self.clip, seed)))
        return out._replace(upload=tree.stack(noisy))

    def on_client(self, out: ClientOut, client: int, t: int) -> ClientOut:
        """``on_clients`` for one client's unstacked output (a Flower node)."""
        stacked = self.on_clients(out._replace(upload=tree.stack([out.upload])), [client], t)
        return out._replace(upload={k: v[0] for k, v in stacked.upload.items()})

    # --- the server's side ----------------------------------------------------------------------

    def population_weights(self, weights: Tensor, clients) -> Tensor:
        """Every client's aggregation weight, from the cohort's: the same for all (uniform) or
        proportional to the sample counts N_i, which are public; other weights are refused."""
        sizes = torch.tensor(self.sizes, dtype=torch.float64)
        if torch.allclose(weights, weights[0].expand_as(weights), rtol=1e-9):
            return weights[0].expand_as(sizes)
        per_sample = weights / sizes[torch.as_tensor(clients).cpu()]
        if torch.allclose(per_sample, per_sample[0].expand_as(per_sample), rtol=1e-6):
            return per_sample[0] * sizes
        raise ConfigError(
            "differential privacy needs aggregation weights that are uniform or proportional to "
            "the clients' sample counts; this algorithm's are neither"
        )

    def sensitivity(self, algorithm: Algorithm, out: ClientOut, ctx: RoundContext, clients):
        """Delta: the L2 sensitivity of the aggregate of clipped uploads to one client."""
        weights = self.population_weights(out.weight.double().cpu(), clients).sort().values
        largest, others = weights[-1:], weights[:-1]
        alone = coefficients(algorithm, largest, ctx)[0]
        fixed = self.accountant.sampling == "fixed"
        worst = torch.cat([largest, others[: max(int(ctx.cohort_size) - 1, 1) if fixed else 1]])
        coef = coefficients(algorithm, worst, ctx)
        if torch.isclose(coef[0], alone, rtol=1e-9):  # each client's own coefficient
            return float((2.0 if fixed else 1.0) * self.clip * coef[0])
        if torch.isclose(coef.sum(), torch.ones((), dtype=coef.dtype), rtol=1e-9):  # a mean
            if fixed:
                return float(min(4.0 * coef[0], 2.0) * self.clip)
            return float(max(min(2.0 * coef[0], 2.0), 1.0) * self.clip)
        raise ConfigError(
            "differential privacy needs an aggregate whose coefficients are each client's own "
            "or a weighted mean; this algorithm's are neither"
        )

    def aggregate(self, algorithm: Algorithm, out: ClientOut, ctx: RoundContext, clients):
        """The algorithm's aggregate of the clipped uploads plus the central noise."""
        aggregated = algorithm.aggregate(out._replace(upload=clip(out.upload, self.clip)), ctx)
        if self.noise == 0:
            return aggregated
        std = self.noise * self.sensitivity(algorithm, out, ctx, clients)
        noise = gaussian_like(aggregated, std, seed_for(self.seed, CENTRAL_STREAM, ctx.round))
        return tree.add(aggregated, noise)

    def record(self, completed: int) -> dict[str, float]:
        """What an evaluation logs: epsilon spent after ``completed`` rounds, delta and sigma."""
        return {
            "dp_epsilon": self.accountant.epsilon(completed),
            "dp_delta": self.accountant.delta,
            "dp_noise": self.noise,
        }


def server_round(
    algorithm: Algorithm,
    privacy: Privacy | None,
    server: ServerState,
    out: ClientOut,
    ctx: RoundContext,
    clients: Tensor,
) -> ServerState:
    """The server's step: the algorithm's own, or with central noise the noised aggregate's."""
    if privacy is None or privacy.local:
        return algorithm.server_round(server, out, ctx, clients)
    return algorithm.server_update(server, privacy.aggregate(algorithm, out, ctx, clients), ctx)
