"""The server's table of every client's latest model (``ModelTable``), which FedMTL, MetaFed,
FedAP, pFedSim, FedAMP and FedFomo keep: the initial model stands in for a client never stored,
a store writes the cohort's uploads in their rows only and leaves the table it read as it was."""

from __future__ import annotations

import torch
from test_fast_sim import ragged_experiment

from pflego.algorithms.table import ModelTable
from pflego.sim import Simulation
from pflego.types import ClientOut


def test_the_table_starts_as_the_initial_model_and_stores_each_cohorts_rows():
    sim = Simulation(ragged_experiment("fedmtl"), None)
    algorithm, ctx = sim.algorithm, sim.context(0)
    assert isinstance(algorithm, ModelTable)
    server = algorithm.init_server(sim.server["params"])
    params, count = server["params"], ctx.num_clients
    for k, v in algorithm.stored(server, ctx).items():
        assert v.shape == (count, *params[k].shape) and torch.equal(v[count - 1], params[k])
    for k, v in algorithm.initial(server, torch.tensor([4, 1])).items():
        assert v.shape == (2, *params[k].shape) and torch.equal(v[1], params[k])

    def upload(shift: float) -> ClientOut:
        models = {f"model.{k}": torch.stack([v + shift, v - shift]) for k, v in params.items()}
        return ClientOut(models, torch.ones(2, dtype=torch.float64), {})

    first = algorithm.store(server, upload(1.0), ctx, torch.tensor([0, 3]))
    second = algorithm.store(first, upload(2.0), ctx, torch.tensor([3, 2]))
    for k, v in params.items():
        rows = second["models"][k]
        assert torch.equal(rows[0], v + 1) and torch.equal(rows[3], v + 2)
        assert torch.equal(rows[2], v - 2) and torch.equal(rows[1], v)  # never stored: initial
        assert torch.equal(first["models"][k][3], v - 1)  # the table a store read is unchanged
    assert "models" not in server and torch.equal(
        second["params"]["head.bias"], params["head.bias"]
    )
