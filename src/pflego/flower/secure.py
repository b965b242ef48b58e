"""Secure aggregation of a round's uploads with Flower's SecAgg+ (``--secure-aggregation``).

The server learns only the sum of the cohort's uploads, never one client's. SecAgg+ exists on
Flower's legacy workflow path: :class:`flwr.server.workflow.SecAggPlusWorkflow` drives its message
rounds over the grid and hands the unmasked result to a legacy strategy; on the node,
``secaggplus_mod`` masks what the train handler returns. This module runs it once per training
round of :class:`FlowerServer`.

An algorithm qualifies when its aggregate is ``A = s · sum_c N_c u_c`` with one factor s per
cohort and its ``server_round`` is the default. With M the largest sample count of the cohort,
client c sends ``x_c = (N_c / M) u_c`` with Flower weight M, so SecAgg+ returns the plain mean of
the x_c over the n clients that answered; the server rebuilds ``sum_c N_c u_c = n M mean`` and
runs the algorithm's ``server_round`` on n copies of the count-weighted mean with the clients'
real weights (sent in the clear), which gives A. Entries are clipped to [-R, R] and quantized with
step ``delta = 2R / Q``, so A is within ``|s| n M delta`` of the plain aggregate (reported as
``secagg_error_bound``); n must stay below 2^32 / Q. ``docs/flower.md`` ("Secure aggregation")
gives the details.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from pflego.algorithms import Algorithm
from pflego.errors import ConfigError
from pflego.types import ClientOut, RoundContext

log = logging.getLogger("pflego.flower")

FIT_CONFIG = "fitins.config"
FIT_PARAMETERS = "fitins.parameters"


@dataclass(frozen=True)
class SecureAggregation:
    """SecAgg+ settings (the run config's ``secagg-*`` keys).

    Attributes:
        clipping_range: R: each entry sent lies in [-R, R].
        quantization_range: Q: entries are quantized to Q levels over [-R, R].
        modulus_range: The masks' modulus (a power of 2 larger than Q).
        threshold: Fraction of a client's key shares needed to unmask (at least 2 shares).
    """

    clipping_range: float = 8.0
    quantization_range: int = 2**22
    modulus_range: int = 2**32
    threshold: float = 0.5

    @property
    def step(self) -> float:
        """delta = 2R / Q, the quantization step of one entry."""
        return 2 * self.clipping_range / self.quantization_range

    def check(self) -> SecureAggregation:
        if not self.clipping_range > 0:
            raise ConfigError(f"secagg-clipping-range={self.clipping_range} must be positive")
        if not 1 < self.quantization_range < self.modulus_range:
            raise ConfigError(
                f"secagg-quantization-range={self.quantization_range} must lie in "
                f"2..{self.modulus_range - 1}"
            )
        if not 0 < self.threshold <= 1:
            raise ConfigError(f"secagg-threshold={self.threshold} must lie in (0, 1]")
        return self


def cohort_factor(
    algorithm: Algorithm, weights: torch.Tensor, counts: torch.Tensor, ctx: RoundContext
) -> float:
    """s in ``aggregate = s · sum_c N_c u_c``, read off the algorithm's aggregate (it is linear:
    one-hot uploads return its coefficients); a one-line error when they are not ∝ N_c."""
    n = len(weights)
    probe = ClientOut({"e": torch.eye(n, dtype=torch.float64)}, weights.double(), {})
    coefficients = algorithm.aggregate(probe, ctx)["e"].double()
    ratio = coefficients / counts.double()
    rtol = 100 * torch.finfo(weights.dtype).eps  # the weights' own rounding (N_i / N in float32)
    if not torch.allclose(ratio, ratio[0].expand(n), rtol=rtol, atol=0.0):
        raise ConfigError(
            "secure aggregation needs an aggregate whose weights are proportional to the "
            f"clients' sample counts; this round's are {coefficients.tolist()} for counts "
            f"{counts.tolist()}"
        )
    return float(ratio[0])


# --- the node's side ----------------------------------------------------------------------------


def is_secure(message: Message) -> bool:
    """Whether a train message belongs to the SecAgg+ protocol."""
    return RECORD_KEY_CONFIGS in message.content.config_records


def is_fit(message: Message) -> bool:
    """Whether a train message is SecAgg+'s FitIns (its masked-vector stage)."""
    return FIT_CONFIG in message.content.config_records


def fit_inputs(message: Message) -> tuple[dict[str, Any], dict[str, torch.Tensor], float, float]:
    """From a FitIns: the plain round's records, the downlink, M and the clipping range R."""
    config = message.content.config_records[FIT_CONFIG]
    parameters = compat.arrayrecord_to_parameters(
        message.content.array_records[FIT_PARAMETERS], keep_input=True
    )
    keys = json.loads(str(config["pflego.keys"]))
    arrays = parameters_to_ndarrays(parameters)
    downlink = {k: torch.from_numpy(a.copy()) for k, a in zip(keys, arrays)}
    return (
        json.loads(str(config["pflego.message"])),
        downlink,
        float(config["pflego.weight-scale"]),
        float(config["pflego.clip"]),
    )


def fit_reply(
    message: Message, out: ClientOut, n_train: int, scale: float, clip: float, extra: dict
) -> Message:
    """The FitRes ``secaggplus_mod`` masks: ``(N_c / M) u_c`` with weight M, weight in the clear.

    Also counts the entries beyond the clipping range R (SecAgg+ would clip them).
    """
    keys = sorted(out.upload)
    factor = n_train / scale
    arrays = [out.upload[k].detach().double().cpu().numpy() * factor for k in keys]
    clipped = int(sum(int(np.sum(np.abs(a) > clip)) for a in arrays))
    metrics = {
        "weight": float(out.weight),
        "n_train": int(n_train),
        "clipped": clipped,
        "keys": json.dumps(keys),
        **{f"metrics.{k}": float(v) for k, v in out.metrics.items()},
        **extra,
    }
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), scale, metrics)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=message)


# --- the server's side -------------------------------------------------------------------------


class _Collect:
    """The legacy strategy's two calls SecAgg+ makes: it hands out the round's FitIns and keeps
    the unmasked result."""

    def __init__(self, instructions: list[tuple[GridClientProxy, FitIns]]) -> None:
        self.instructions = instructions
        self.results: list[tuple[int, FitRes]] = []

    def configure_fit(self, server_round, parameters, client_manager):
        return self.instructions

    def aggregate_fit(self, server_round, results, failures):
        self.results = [(proxy.node_id, res) for proxy, res in results]
        return None, {}


@dataclass
class SecureRound:
    """What one secure round returned: who answered, their clear metrics and the secure mean."""

    answered: dict[int, dict[str, Any]]  # node id -> the FitRes metrics
    mean: list[np.ndarray] | None


def run_protocol(
    settings: SecureAggregation,
    grid,
    t: int,
    instructions: dict[int, tuple[RecordDict, dict[str, torch.Tensor]]],
    scale: float,
    timeout: float,
) -> SecureRound:
    """One SecAgg+ round over the nodes of ``instructions`` (node id -> the plain round's records
    and downlink); returns the answers and the unmasked mean (``None`` when it halted)."""
    fitins = []
    for node, (records, downlink) in instructions.items():
        keys = sorted(downlink)
        config = {
            "pflego.message": json.dumps(records),
            "pflego.keys": json.dumps(keys),
            "pflego.weight-scale": float(scale),
            "pflego.clip": float(settings.clipping_range),
        }
        arrays = [downlink[k].detach().cpu().numpy() for k in keys]
        fitins.append(
            (GridClientProxy(node, grid, 0), FitIns(ndarrays_to_parameters(arrays), config))
        )
    strategy = _Collect(fitins)
    state = RecordDict(
        {
            MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: t + 1}),
            MAIN_PARAMS_RECORD: ArrayRecord(),
        }
    )
    context = LegacyContext(
        Context(0, 0, {}, state, {}), strategy=strategy, client_manager=SimpleClientManager()
    )
    workflow = SecAggPlusWorkflow(
        num_shares=1.0,
        reconstruction_threshold=settings.threshold,
        max_weight=float(scale),
        clipping_range=settings.clipping_range,
        quantization_range=settings.quantization_range,
        modulus_range=settings.modulus_range,
        timeout=timeout,
    )
    workflow(grid, context)
    if not strategy.results:
        return SecureRound({}, None)
    answered = {node: dict(res.metrics) for node, res in strategy.results}
    mean = parameters_to_ndarrays(strategy.results[0][1].parameters)
    return SecureRound(answered, mean)


def secure_outs(
    result: SecureRound, metrics: list[dict[str, Any]], scale: float, dtype: torch.dtype
) -> tuple[ClientOut, torch.Tensor]:
    """The pseudo-cohort whose aggregate is the secure one: n copies of the count-weighted mean
    ``sum_c N_c u_c / sum_c N_c`` with the answering clients' real weights (``metrics``, in
    client order); also their counts N_c. ``scale`` is M, the weight scale of the round."""
    keys = json.loads(str(metrics[0]["keys"]))
    counts = torch.tensor([float(m["n_train"]) for m in metrics], dtype=torch.float64)
    weights = torch.tensor([float(m["weight"]) for m in metrics], dtype=dtype)
    n = len(metrics)
    total = {k: torch.from_numpy(a * (n * scale)) for k, a in zip(keys, result.mean)}
    mean = {k: (v / counts.sum()).to(dtype) for k, v in total.items()}
    upload = {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in mean.items()}
    per_client = {
        name[len("metrics.") :]: torch.tensor([float(m[name]) for m in metrics], dtype=dtype)
        for name in metrics[0]
        if str(name).startswith("metrics.")
    }
    return ClientOut(upload, weights, per_client), counts
