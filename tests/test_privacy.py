"""Differential privacy of the uploads: clipping, the noise's scale, the accountant, exactness at
sigma = 0, and the same numbers on Flower."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import tiny_experiment

from pflego import tree
from pflego.algorithms import ALGORITHMS
from pflego.algorithms.base import Algorithm
from pflego.algorithms.fedavg import FedAvg
from pflego.cli import main
from pflego.config import load_config
from pflego.errors import ConfigError
from pflego.sim import Simulation
from pflego.sim.privacy import ORDERS, Accountant, Privacy, clip
from pflego.types import ClientOut

dpa = pytest.importorskip("dp_accounting")

ELIGIBLE = sorted(
    name
    for name, cls in ALGORITHMS.items()
    if cls.sum_aggregate and cls.server_round is Algorithm.server_round
)

#: Methods whose local loss grows faster than quadratically in the parameters (FedSR's KL to
#: its class references, whose gradient scales with 1 / r_sigma^2): parameters moved by a noise
#: of std 1e9 overflow their local steps, so their noise test uses a noise of std 1e-3.
STEEP = {"fedsr"}


def simulation(**settings) -> Simulation:
    return Simulation(tiny_experiment(**settings), None)


def params_after(sim: Simulation, rounds: int = 3) -> dict[str, torch.Tensor]:
    for t in range(rounds):
        sim.run_round(t)
    return {**sim.server["params"], **{f"client.{k}": v for k, v in sim.store.tensors.items()}}


# --- clipping ------------------------------------------------------------------------------------


def test_clipping_bounds_every_uploads_norm_and_keeps_small_ones():
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.01, 0.5, 3.0, 100.0, 1e6])[:, None]
    upload = {
        "a": torch.randn(5, 7, generator=gen, dtype=torch.float64) * scales,
        "b": torch.randn(5, 3, 2, generator=gen, dtype=torch.float64) * scales[:, :, None],
    }
    norms = lambda u: torch.cat([v.flatten(1) for v in u.values()], 1).norm(dim=1)  # noqa: E731
    clipped = clip(upload, 1.0)
    assert (norms(clipped) <= 1.0 + 1e-12).all()
    small = norms(upload) <= 1.0
    assert small.any() and (~small).any()
    for k in upload:
        assert torch.equal(clipped[k][small], upload[k][small])  # exactly unchanged
        ratio = clipped[k][~small] / upload[k][~small]  # the direction is kept
        torch.testing.assert_close(
            ratio, ratio.flatten(1)[:, :1].expand_as(ratio.flatten(1)).reshape(ratio.shape)
        )
    torch.testing.assert_close(
        norms(clipped)[~small], torch.ones(int((~small).sum()), dtype=torch.float64)
    )


@pytest.mark.parametrize("local", [False, True])
def test_every_upload_the_server_aggregates_is_clipped(monkeypatch, local):
    seen = []
    original = FedAvg.aggregate

    def recording(self, out, ctx):
        if "probe" not in out.upload:
            flat = torch.cat([v.flatten(1) for v in out.upload.values()], 1)
            seen.append(flat.norm(dim=1))
        return original(self, out, ctx)

    monkeypatch.setattr(FedAvg, "aggregate", recording)
    params_after(simulation(algorithm="fedavg", dp_clip=0.05, dp_noise=0.0, dp_local=local), 2)
    assert len(seen) == 2 and (torch.cat(seen) <= 0.05 + 1e-9).all()
    params_after(simulation(algorithm="fedavg"), 2)
    assert float(torch.cat(seen[2:]).min()) > 0.05  # without dp_clip they are larger


# --- the noise -----------------------------------------------------------------------------------


def zero_round(sim: Simulation):
    """Round 0's real cohort, context and weights, with all-zero uploads: the aggregate of the
    clipped uploads is 0, so what the server adds is the noise alone."""
    ctx, cohort = sim.context(0), sim.cohort(0)
    sizes = sim.exp.data.train_sizes[cohort].double()
    weight = sizes / sim.exp.data.total_train if sim.algorithm.name == "pflego" else sizes
    upload = {"w": torch.zeros(len(cohort), 400, 500, dtype=torch.float64)}
    return ClientOut(upload, weight, {}), ctx, torch.as_tensor(cohort)


@pytest.mark.parametrize("sampling", ["fixed", "bernoulli"])
@pytest.mark.parametrize("name", ["pflego", "fedavg"])
def test_central_noise_has_the_stated_standard_deviation(name, sampling):
    sigma, clip_norm = 0.7, 2.0
    sim = simulation(
        algorithm=name, partition="dirichlet", sampling=sampling, dp_clip=clip_norm, dp_noise=sigma
    )
    privacy, data = sim.privacy, sim.exp.data
    out, ctx, cohort = zero_round(sim)
    noise = privacy.aggregate(sim.algorithm, out, ctx, cohort)["w"].flatten()
    # The sensitivity by hand: the largest client, with the r - 1 smallest others (fixed size).
    sizes = data.train_sizes.double().sort().values
    r, fixed = ctx.cohort_size, sampling == "fixed"
    if name == "pflego":  # (I/r) alpha_j: each client's own coefficient
        own = ctx.num_clients / r * sizes[-1] / data.total_train
        delta = (2 if fixed else 1) * clip_norm * own
    else:  # a weighted mean: N_j over the cohort's total
        others = sizes[: int(r) - 1] if fixed else sizes[:1]
        share = sizes[-1] / (sizes[-1] + others.sum())
        delta = clip_norm * (min(4 * share, 2.0) if fixed else max(min(2 * share, 2.0), 1.0))
    assert privacy.sensitivity(sim.algorithm, out, ctx, cohort) == pytest.approx(float(delta))
    # 200,000 draws: the sample standard deviation is within 1% of sigma * Delta (about 6
    # standard errors), and the mean within 6 standard errors of 0.
    std = sigma * float(delta)
    assert float(noise.std()) == pytest.approx(std, rel=0.01)
    assert abs(float(noise.mean())) < 6 * std / math.sqrt(noise.numel())
    # Seeded by (seed, round): the same draw again, another one in another round.
    again = privacy.aggregate(sim.algorithm, out, ctx, cohort)["w"].flatten()
    assert torch.equal(noise, again)
    later = privacy.aggregate(sim.algorithm, out, dataclasses.replace(ctx, round=1), cohort)
    assert not torch.equal(noise, later["w"].flatten())


def test_local_noise_is_sigma_c_on_each_client_and_differs_between_clients():
    sigma, clip_norm = 0.3, 5.0
    sim = simulation(algorithm="fedavg", dp_clip=clip_norm, dp_noise=sigma, dp_local=True)
    out, _, cohort = zero_round(sim)
    noisy = sim.privacy.on_clients(out, cohort.numpy(), 4).upload["w"]
    for row in noisy:
        assert float(row.std()) == pytest.approx(sigma * clip_norm, rel=0.01)
    assert not torch.equal(noisy[0], noisy[1])


# --- the accountant ------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", ["fixed", "bernoulli", "local"])
def test_the_accountants_epsilon_is_the_librarys(sampling):
    accountant = Accountant(1.1, 100, 20, "bernoulli" if sampling == "local" else sampling, 1e-5,
                            local=sampling == "local")  # fmt: skip
    gaussian = dpa.GaussianDpEvent(1.1)
    if sampling == "fixed":
        event = dpa.SampledWithoutReplacementDpEvent(100, 20, gaussian)
        relation = dpa.NeighboringRelation.REPLACE_ONE
    elif sampling == "bernoulli":
        event = dpa.PoissonSampledDpEvent(0.2, gaussian)
        relation = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    else:
        event = dpa.GaussianDpEvent(1.1 / 2)
        relation = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    for rounds in (1, 50, 200):
        library = dpa.rdp.RdpAccountant(list(ORDERS), neighboring_relation=relation)
        library.compose(dpa.SelfComposedDpEvent(event, rounds))
        assert accountant.epsilon(rounds) == library.get_epsilon(1e-5)
        # The library's default orders (more of them) give at most a slightly smaller epsilon.
        default = dpa.rdp.RdpAccountant(neighboring_relation=relation)
        default.compose(dpa.SelfComposedDpEvent(event, rounds))
        assert default.get_epsilon(1e-5) <= accountant.epsilon(rounds) * (1 + 1e-9)
        assert accountant.epsilon(rounds) <= 1.05 * default.get_epsilon(1e-5)
    assert accountant.epsilon(0) == 0 and math.isinf(
        dataclasses.replace(accountant, noise=0.0).epsilon(5)
    )


def test_a_target_epsilon_picks_the_sigma_that_spends_it():
    sim = simulation(algorithm="pflego", dp_clip=1.0, dp_target_epsilon=3.0, rounds=40)
    assert sim.privacy.accountant.epsilon(40) == pytest.approx(3.0, rel=1e-3)
    looser = simulation(algorithm="pflego", dp_clip=1.0, dp_target_epsilon=30.0, rounds=40)
    assert looser.privacy.noise < sim.privacy.noise


# --- exactness and refusals ----------------------------------------------------------------------


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("name", ELIGIBLE)
def test_no_noise_and_a_huge_clip_is_the_non_private_run_exactly(name, local):
    plain = params_after(simulation(algorithm=name))
    private = params_after(simulation(algorithm=name, dp_clip=1e12, dp_noise=0.0, dp_local=local))
    assert plain.keys() == private.keys()
    for k in plain:
        assert torch.equal(plain[k], private[k]), k
    noise = 1e-15 if name in STEEP else 1e-3  # a noise of std 1e-3, or of 1e9
    noisy = params_after(simulation(algorithm=name, dp_clip=1e12, dp_noise=noise, dp_local=local))
    assert any(not torch.equal(plain[k], noisy[k]) for k in plain)


def test_an_aggregate_that_is_not_a_weighted_sum_is_refused():
    @dataclass(frozen=True)
    class MedianFedAvg(FedAvg):
        sum_aggregate = False

    exp = tiny_experiment(algorithm="fedavg", dp_clip=1.0, dp_noise=1.0)
    fields = {f.name: getattr(exp.algorithm, f.name) for f in dataclasses.fields(FedAvg)}
    exp.algorithm = MedianFedAvg(**fields)
    with pytest.raises(ConfigError, match="weighted-sum aggregates only"):
        Simulation(exp, None)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"dp_noise": 1.0}, "need dp_clip"),
        ({"dp_local": True}, "need dp_clip"),
        ({"dp_clip": 1.0, "dp_noise": 1.0, "dp_target_epsilon": 2.0}, "not both"),
        ({"dp_clip": 0.0}, "dp_clip=0.0 must be a positive"),
        ({"dp_clip": 1.0, "dp_noise": -1.0}, "dp_noise=-1.0 must be 0 or more"),
        ({"dp_clip": 1.0, "dp_delta": 1.0}, "dp_delta=1.0 must lie in"),
        ({"dp_clip": float("nan")}, "dp_clip=nan must be a finite number"),
    ],
)
def test_bad_privacy_settings_are_one_line_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        load_config(settings)


def test_the_cli_runs_with_privacy_and_logs_epsilon_every_evaluation(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "--dataset", "tiny", "--clients", "6", "--classes-per-client", "2",
            "--rounds", "4", "--inner-steps", "2", "--eval-every", "1", "--quiet", "--participation", "0.5",
            "--out", str(out), "--dp-clip", "1.0", "--dp-noise", "1.2", "--dp-delta", "1e-4"]  # fmt: skip
    assert main(args) == 0
    assert "epsilon" in capsys.readouterr().out
    import json

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epsilons = [r["dp_epsilon"] for r in records]
    assert epsilons[0] == 0 and all(a < b for a, b in zip(epsilons, epsilons[1:]))
    accountant = Accountant(1.2, 6, 3, "fixed", 1e-4)
    assert epsilons[-1] == pytest.approx(accountant.epsilon(4))
    local = [*args, "--dp-local"]
    local[local.index(str(out))] = str(tmp_path / "local")
    assert main(local) == 0


# --- Flower ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("local", [False, True])
def test_flower_gives_the_simulators_private_numbers(tmp_path, local):
    pytest.importorskip("flwr", exc_type=ImportError)
    from flower_inprocess import InProcessGrid
    from test_flower import simulate, small_config, without_seconds

    from pflego.flower.apps import client_app
    from pflego.flower.server import FlowerServer

    config = small_config("pflego", dp_clip=0.5, dp_noise=0.8, dp_local=local)
    sim = simulate(config)
    grid = InProcessGrid(client_app, config, tmp_path / "state")
    flower = FlowerServer(config, grid, None, join_timeout=1)
    history = flower.run()
    for key, value in sim.server["params"].items():
        assert torch.equal(flower.server["params"][key], value), key
    assert without_seconds(history.records) == without_seconds(sim.records)
    assert history.records[-1]["dp_epsilon"] > 0
    plain = simulate(small_config("pflego"))
    assert not np.isclose(plain.records[-1]["train_loss"], sim.records[-1]["train_loss"])


def test_privacy_builds_nothing_without_a_clip():
    sim = simulation(algorithm="pflego")
    assert sim.privacy is None
    assert Privacy.build(sim.cfg, sim.algorithm, sim.exp.data.train_sizes) is None
    assert tree.all_finite(sim.server["params"])


def test_uniform_weights_are_calibrated_like_a_mean_of_r_uploads():
    @dataclass(frozen=True)
    class UniformFedAvg(FedAvg):
        def client_update(self, downlink, state, data, ctx):
            out, new_state = super().client_update(downlink, state, data, ctx)
            return out._replace(weight=torch.ones_like(data.num_samples)), new_state

    exp = tiny_experiment(algorithm="fedavg", partition="dirichlet", dp_clip=2.0, dp_noise=1.0)
    fields = {f.name: getattr(exp.algorithm, f.name) for f in dataclasses.fields(FedAvg)}
    exp.algorithm = UniformFedAvg(**fields)
    sim = Simulation(exp, None)
    out, ctx, cohort = zero_round(sim)
    out = out._replace(weight=torch.ones_like(out.weight))
    r = ctx.cohort_size  # each of r uploads weighs 1/r: replacing one moves the mean by 4C/r
    expected = 2.0 * min(4 / r, 2.0)
    assert sim.privacy.sensitivity(sim.algorithm, out, ctx, cohort) == pytest.approx(expected)
    with pytest.raises(ConfigError, match="uniform or proportional"):
        sim.privacy.sensitivity(sim.algorithm, out._replace(weight=torch.rand(len(cohort))),
                                ctx, cohort)  # fmt: skip
