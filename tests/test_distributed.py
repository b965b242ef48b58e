"""One run across processes (torch.distributed, gloo on CPU) gives the numbers of one process.

The two processes are launched once for the whole module and run every job in turn (a launch
costs seconds); the one-process runs they are compared with run here.
"""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pflego.algorithms import ALGORITHMS
from pflego.cli import main
from pflego.config import Config, load_config, read_yaml
from pflego.errors import ConfigError
from pflego.history import History
from pflego.sim import Simulation, build_experiment, resume, run
from pflego.sim.distributed import (
    Job,
    check_settings,
    failure_line,
    launch,
    merged_store,
    split_store,
)

NAMES = sorted(ALGORITHMS)
#: Built-in offline data (spawned processes do not see the suite's registered datasets), small
#: enough that every algorithm runs 2 rounds, evaluated after each, in about half a second. In
#: float64 the order of sums moves the numbers by about 1e-15, so rel 1e-6 leaves them room and
#: catches any other difference.
SMALL = {
    "dataset": "mnist5k",
    "clients": 8,
    "participation": 0.5,
    "rounds": 2,
    "inner_steps": 2,
    "batch_size": 50,
    "eval_every": 1,
    "average_last": 0,
    "unseen_fraction": 0.25,
    "eval_train_samples": 25,
    "dtype": "float64",
}
#: Shorter fine-tuning, to keep the evaluations quick.
OPTIONS = {
    "fedbabu": {"finetune_epochs": 0.5},
    "fedavg+": {"finetune_epochs": 0.5},
    **{name: {"join_epochs": 0.5} for name in ("pgfed", "pgfed-ce", "pgfedmo")},
}
#: Tiny cohorts (often one client: one process trains nobody) and a sample of evaluated clients,
#: for clients with a state (trained by their owner) and without (shared out by position).
SPARSE = {"sampling": "bernoulli", "participation": 0.15, "eval_clients": 5, "rounds": 3}
SPARSE_NAMES = ("fedrep", "fedavg")
#: Runs stopped after 2 rounds and resumed to 3 under the other process count.
RESUMED = ("pflego", "d-fedem")


def settings(name: str, **changes) -> dict:
    return SMALL | {"algorithm": name, "options": OPTIONS.get(name, {})} | changes


def one_process(name: str, **changes) -> Simulation:
    """The run of the one-process simulator, in memory (no files, no figure)."""
    simulation = Simulation(build_experiment(load_config(settings(name, **changes))), None)
    simulation.run(progress=False)
    return simulation


def numbers(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


def assert_close(a, b, where: str) -> None:
    """Equal up to the order of sums: rel 1e-6 (an absolute 1e-9 near zero)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, where
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, float) and b is None:  # metrics.jsonl writes a non-finite value as null
        assert not math.isfinite(a), (where, a, b)
    elif isinstance(a, float):
        same = math.isnan(a) and math.isnan(b)
        assert same or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9), (where, a, b)
    else:
        assert a == b, where


def assert_same_run(one: Simulation, many: Path) -> None:
    """The run directory ``many`` holds the records, server state and client states of ``one``."""
    assert_close(numbers(one.records), numbers(History.load(many).records), "metrics")
    checkpoint = torch.load(many / "checkpoint.pt", weights_only=False)
    assert checkpoint["next_round"] == one.next_round
    assert load_config(read_yaml(many / "config.yaml")) == one.cfg
    assert_close(one.server, checkpoint["server"], "server")
    assert_close(one.store.state_dict(), checkpoint["store"], "store")
    partition = json.loads((many / "partition.json").read_text())
    assert partition == json.loads(json.dumps(one.exp.partition_summary()))


#: The one-process runs the two processes' runs are compared with: (algorithm, changes).
REFERENCES = {
    **{name: (name, {}) for name in NAMES},
    **{f"sparse-{name}": (name, SPARSE) for name in SPARSE_NAMES},
    **{f"{name}-3": (name, {"rounds": 3, "checkpoint_every": 1}) for name in RESUMED},
}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[Path, dict[str, Simulation]]:
    """Every job of this module run by two processes, launched once, and (meanwhile, in a
    thread) the one-process runs they are compared with."""
    root = tmp_path_factory.mktemp("nproc2")
    quiet = {"progress": False, "plot": False}
    jobs = [Job(str(root / name), settings(name), **quiet) for name in NAMES]
    for name in SPARSE_NAMES:
        jobs.append(Job(str(root / f"sparse-{name}"), settings(name, **SPARSE), **quiet))
    for name in RESUMED:  # started here, resumed by the two processes; and the other way round
        run(settings(name, checkpoint_every=1), root / f"{name}-1to2", progress=False)
        jobs.append(Job(str(root / f"{name}-1to2"), resume=True, rounds=3, **quiet))
        jobs.append(Job(str(root / f"{name}-2to1"), settings(name, checkpoint_every=1), **quiet))
    # Last, a run that stops in its first round with a one-line error raised by one process
    # only (client 0, of rank 0, holds 750 samples; the others at most 562): both stop with it.
    jobs.append(Job(str(root / "fails"), settings("mocha", options={"max_samples": 600}), **quiet))
    torch.set_num_threads(1)
    with ThreadPoolExecutor(1) as pool:
        references = pool.submit(
            lambda: {
                key: one_process(name, **changes) for key, (name, changes) in REFERENCES.items()
            }
        )
        with pytest.raises(ConfigError, match="holds 750 training samples .* max_samples=600"):
            launch(jobs, 2, threads=1)
        return root, references.result()


@pytest.mark.slow  # two spawned processes over the registry: ~30 s, kept out of the default suite
@pytest.mark.parametrize("name", NAMES)
def test_two_processes_give_the_numbers_of_one(name, two):
    root, one = two
    assert_same_run(one[name], root / name)
    environment = json.loads((root / name / "environment.json").read_text())
    assert environment["processes"] == 2 and environment["backend"] == "gloo"
    assert not (root / name / "curves.png").exists()


@pytest.mark.slow  # two spawned processes over the registry: ~30 s, kept out of the default suite
@pytest.mark.parametrize("name", SPARSE_NAMES)
def test_a_process_whose_share_of_the_cohort_is_empty_waits_for_the_other(name, two):
    root, one = two
    sparse = one[f"sparse-{name}"]
    assert any(len(sparse.cohort(t)) == 1 for t in range(3)) and len(sparse.records) == 4
    assert all(r["eval_clients"] == 5 for r in sparse.records)
    assert_same_run(sparse, root / f"sparse-{name}")


@pytest.mark.slow  # two spawned processes over the registry: ~30 s, kept out of the default suite
@pytest.mark.parametrize("name", RESUMED)
def test_a_checkpoint_resumes_under_another_process_count(name, two):
    root, one = two
    assert_same_run(one[f"{name}-3"], root / f"{name}-1to2")  # by one process, resumed by two
    resume(root / f"{name}-2to1", progress=False, rounds=3)  # by two, resumed by one
    assert_same_run(one[f"{name}-3"], root / f"{name}-2to1")


@pytest.mark.slow  # two spawned processes: ~15 s
def test_the_processes_probe_auto_and_agree_on_one_backend(tmp_path, monkeypatch):
    """With the probe on (the suite switches it off), each process measures its share of the
    first cohort and all settle on one backend; the numbers are still those of one process."""
    monkeypatch.setenv("PFLEGO_BACKEND_PROBE", "1")  # the spawned processes inherit it
    name = "moon"  # its local steps do not all fuse: auto measures fused against vmap
    run(settings(name, rounds=3), tmp_path, progress=False, profile=True, nproc=2, threads=1)
    probe = json.loads((tmp_path / "profile.json").read_text())["backend_probe"]
    slowest = probe["predicted_round_of_the_slowest_process"]
    assert set(slowest) == {"fused", "vmap"} and probe["chosen"] == min(slowest, key=slowest.get)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert checkpoint["backend"] == probe["chosen"]
    assert_same_run(one_process(name, rounds=3), tmp_path)


def test_the_store_splits_by_owner_and_merges_back():
    store = {
        "rows": torch.tensor([0, 2, 3, 6]),
        "tensors": {"head.w": torch.arange(8.0).reshape(4, 2)},
        "visited": torch.tensor([1, 0, 1, 0, 0, 0, 1], dtype=torch.bool),
        "initialized": torch.tensor([1, 0, 1, 1, 0, 0, 1], dtype=torch.bool),
    }
    parts = split_store(store, 3, 7)
    assert [p["rows"].tolist() for p in parts] == [[0, 3, 6], [], [2]]
    assert parts[1]["tensors"]["head.w"].shape == (0, 2)
    assert parts[2]["initialized"].tolist() == [0, 0, 1, 0, 0, 0, 0]
    assert_close(merged_store(parts), store, "store")
    with pytest.raises(ValueError, match="7 clients, not 9"):
        split_store(store, 2, 9)


def test_a_crashed_process_is_named_in_one_line():
    crash = SimpleNamespace(
        message={"message": "RuntimeError: boom\n", "extraInfo": {}}, exitcode=1
    )
    assert failure_line(crash) == "RuntimeError: boom"
    assert failure_line(SimpleNamespace(message="", exitcode=-9)) == "exit code -9"


def test_bad_process_counts_are_one_line_errors(tmp_path, capsys):
    for nproc in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="must be a whole number of processes"):
            run(settings("fedavg"), tmp_path, progress=False, nproc=nproc)
    with pytest.raises(ConfigError, match="use --device cuda"):  # (not validated: no GPU here)
        check_settings(Config(device="cuda:0"), 2)
    check_settings(Config(device="cuda:0"), 1)
    assert main(["run", "--nproc", "0", "--out", str(tmp_path / "cli")]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_on_two_loopback_nodes_gives_the_numbers_of_one_process(tmp_path):
    """Two torchrun agents on this machine, one process each, meet at a c10d rendezvous on
    127.0.0.1 as two nodes would; then the same run from ``pflego run --nproc 2``."""
    given = settings("pgfed")
    small = [f"--set={k}={v}" for k, v in given.items() if k != "options"]
    small += [f"--set=options.{k}={v}" for k, v in given["options"].items()]
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = (
        f"{sys.executable} -m torch.distributed.run --nnodes 2 --nproc-per-node 1 "
        f"--rdzv-backend c10d --rdzv-id loopback --rdzv-endpoint 127.0.0.1:{port} "
        "--local-addr 127.0.0.1 --max-restarts 0"
    ).split()
    agents = [
        subprocess.Popen(
            [*torchrun, "--rdzv-conf", f"is_host={int(node == 0)}", "-m", "pflego", "run"]
            + [*small, "--quiet", "--out", str(tmp_path / "torchrun")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    for agent in agents:
        output, _ = agent.communicate(timeout=300)
        assert agent.returncode == 0, output
    local = [*small, "--quiet", "--nproc", "2", "--out", str(tmp_path / "nproc")]
    assert main(["run", *local]) == 0
    one = one_process("pgfed")
    assert_same_run(one, tmp_path / "torchrun")
    assert_same_run(one, tmp_path / "nproc")
    run(settings("pgfed"), tmp_path / "files", progress=False)
    files, nproc = tmp_path / "files", tmp_path / "nproc"
    assert (files / "config.yaml").read_text() == (nproc / "config.yaml").read_text()
    rows = [list(csv.DictReader((d / "clients.csv").open())) for d in (files, nproc)]
    numeric = [[{k: float(v or "nan") for k, v in r.items()} for r in part] for part in rows]
    assert_close(*numeric, "rows")
    assert (nproc / "curves.png").is_file()
