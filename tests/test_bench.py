"""``pflego bench`` runs end to end on a tiny setting and writes its Markdown table."""

from __future__ import annotations

import argparse

import pytest
import torch

from pflego.bench import add_commands, run_bench, scale_row
from pflego.bench.against import targets
from pflego.cli import main
from pflego.errors import ConfigError


@pytest.mark.slow  # ~14 s: the default suite keeps the cheaper bench tests below
def test_bench_writes_markdown_tables(tmp_path) -> None:
    out = tmp_path / "bench.md"
    report = run_bench(
        data_dir=str(tmp_path),  # no MNIST there: falls back to the embedded mnist5k
        clients=10,
        taus=(1, 3),
        backend_tau=2,
        rounds=1,
        memory_clients=20,
        threads=1,
        out=out,
    )
    assert out.read_text() == report
    assert "mnist5k" in report and "fused ms" in report and "peak RSS MB" in report
    assert "failed" not in report
    assert report.count("| pflego |") >= 2 + 4


def test_bench_subcommand_is_wired() -> None:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(["bench", "--taus", "5", "25", "--rounds", "1", "--out", "x.md"])
    assert args.taus == [5, 25] and args.rounds == 1 and callable(args.handler)


def test_bench_against_conventional_on_the_same_split(tmp_path) -> None:
    report = run_bench(
        data_dir=str(tmp_path),
        clients=10,
        threads=1,
        out=None,
        sections=["against"],
        against_rounds=2,
        models=["mlp", "no-such-model"],
        algorithms=["fedavg", "fedper", "apfl", "no-such-method"],
    )
    assert "| mlp | fedavg | " in report and "| mlp | fedper | " in report
    apfl = next(line for line in report.splitlines() if line.startswith("| mlp | apfl | "))
    cells = apfl.split(" | ")
    assert cells[5].endswith("x")  # a speed-up: benchmarks/ has a conventional APFL
    assert cells[6].endswith("x") and float(cells[14]) > 0  # its ceiling, and the row's peak
    assert "train ≥5x" in report
    assert "model no-such-model is not registered here" in report
    assert "no-such-method is not registered here" in report


def test_bench_device_is_the_against_sections_alone(capsys) -> None:
    """--device moves only the comparison with the conventional way; asking it of a CPU-only
    section, or naming a device that is not there, is a one-line error."""
    with pytest.raises(ConfigError, match="applies to the against section only"):
        run_bench(out=None, sections=["against", "tau"], device="cuda")
    if not torch.cuda.is_available():
        assert main(["bench", "--against", "conventional", "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "drop --device" in err


def test_bench_scale_row_runs_a_generated_population_in_a_fresh_process() -> None:
    row = scale_row("fedavg", clients=3_000, cohort=30, rounds=1, threads=1, eval_clients=50)
    assert row[:3] == ["fedavg", "3,000", "30"] and row[3] != "failed"
    assert float(row[7]) > 0 and "(50)" in row[6]
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(["bench", "--clients", "1000000"])
    assert args.clients == 1_000_000 and args.sections is None


def test_bench_targets_are_those_of_issue_26() -> None:
    def marks(model, algorithm, train, evaluate, peak, ceilings=None):
        measured = {"train": train, "eval": evaluate, "peak": peak}
        return targets(model, algorithm, measured, ceilings or {})

    assert marks("mlp", "fedavg", 5.1, 4.0, 41.0) == "train ≥5x ✓, eval ≥5x ✗, peak ≥40% ✓"
    assert marks("mlp", "pfedme", 2.9, 6.0, 1.0) == "train ≥3x ✗, eval ≥5x ✓"
    assert marks("pgfed-cnn", "ditto", 2.0, 5.0, 1.0) == "train ≥2x ✓, eval ≥5x ✓"
    assert marks("mlp", "fedprox", 1.0, float("nan"), 1.0) == "train ≥1x ✓, eval ≥5x ✗"
    # a missed target beyond what the conventional FLOPs at the matmul peak allow says so
    ceilings = {"train": 2.5, "eval": 6.0}
    assert marks("mlp", "pgfed", 1.7, 2.0, 1.0, ceilings) == "train ≥3x ✗ (ceiling), eval ≥5x ✗"
    assert marks("mlp", "pgfed", 3.1, 2.0, 1.0, ceilings) == "train ≥3x ✓, eval ≥5x ✗"


def test_the_conventional_fedper_head_comes_from_the_seed_not_the_global_generator() -> None:
    """pflego's FedPer keeps its heads per client, so the conventional model's shared head is
    initialized by the bench: from the run's seed, whatever ran before it."""
    from pflego.bench.against import conventional_model, conventional_module
    from pflego.config import load_config
    from pflego.sim import Simulation, build_experiment

    cfg = load_config({"dataset": "mnist5k", "clients": 5, "algorithm": "fedper", "model": "mlp"})
    sim = Simulation(build_experiment(cfg), None)
    conventional = conventional_module()
    heads = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        heads.append(conventional_model(conventional, sim).state_dict()["head.weight"])
        assert torch.initial_seed() == global_seed  # the global generator is left alone
    assert torch.equal(heads[0], heads[1])


def test_bench_against_takes_the_two_sides_rounds_in_turn(tmp_path, monkeypatch) -> None:
    """On a shared machine the load changes: each timed conventional round is followed by
    pflego's same round, so that a change falls on both sides alike."""
    from pflego.bench import against

    order = []
    conventional = against.conventional_module()
    conventional_rounds = conventional.time_rounds
    monkeypatch.setattr(against, "conventional_module", lambda: conventional)
    monkeypatch.setattr(
        conventional,
        "time_rounds",
        lambda runner, cohorts, first_round=0: (
            order.append(("conventional", first_round))
            or conventional_rounds(runner, cohorts, first_round)
        ),
    )
    ours = against.time_round
    monkeypatch.setattr(
        against, "time_round", lambda sim, t: order.append(("pflego", t)) or ours(sim, t)
    )
    run_bench(
        data_dir=str(tmp_path), clients=10, threads=1, out=None, sections=["against"],
        against_rounds=3, models=["mlp"], algorithms=["fedavg"],
    )  # fmt: skip
    assert order == [("conventional", 1), ("pflego", 1), ("conventional", 2), ("pflego", 2)]
