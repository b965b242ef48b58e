"""Independent runs in parallel worker processes (``--jobs``) give the serial plan's files."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pflego
from pflego.errors import ConfigError
from pflego.experiments.parallel import RunsFailedError, Workers, parse_devices
from pflego.experiments.reproduce import run_seeds
from pflego.experiments.runs import execute, read_manifest
from pflego.history import History

#: Built-in offline data: spawned workers do not see the test suite's registered datasets.
SMALL = {
    "dataset": "synthetic",
    "algorithm": "fedavg",
    "clients": 6,
    "participation": 0.5,
    "rounds": 3,
    "inner_steps": 2,
    "client_lr": 0.05,
    "eval_every": 1,
    "average_last": 0,
}


def numbers(run_dir):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in History.load(run_dir).records]


def final_params(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["server"]["params"]


@pytest.mark.slow  # two spawned workers: ~55 s, kept out of the default suite
def test_two_workers_write_the_serial_plans_numbers(tmp_path):
    serial = tmp_path / "serial"
    parallel = tmp_path / "parallel"
    run_seeds(SMALL, [0, 1], out=serial, progress=False)
    run_seeds(SMALL, [0, 1], out=parallel, progress=False, workers=Workers(jobs=2, threads=1))
    for seed in (0, 1):
        a, b = serial / f"seed-{seed}", parallel / f"seed-{seed}"
        assert numbers(a) == numbers(b)
        for key, value in final_params(a).items():
            assert torch.equal(value, final_params(b)[key]), key
        assert (a / "config.yaml").read_text() == (b / "config.yaml").read_text()
    assert (serial / "report.md").is_file() and (parallel / "report.md").is_file()


@pytest.mark.slow
def test_a_failed_run_is_named_and_the_others_finish(tmp_path):
    out = tmp_path / "runs"
    run_seeds(SMALL | {"rounds": 1}, [0, 1], out=out, progress=False)
    shutil.rmtree(out / "seed-0")  # to run again
    (out / "seed-1" / "metrics.jsonl").write_text("")  # to resume, from a damaged checkpoint
    (out / "seed-1" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RunsFailedError, match=r"^1 of 2 runs failed .*: seed-1 \(") as info:
        execute(read_manifest(out), out, progress=False, workers=Workers(jobs=2))
    assert "\n" not in str(info.value)
    assert numbers(out / "seed-0")[-1]["round"] == 1


def test_workers_and_devices_are_checked_in_one_line():
    with pytest.raises(ConfigError, match="--jobs=0 must be at least 1"):
        Workers(jobs=0)
    with pytest.raises(ConfigError, match="not a device"):
        parse_devices("cpu,gpu7")
    assert parse_devices("cpu, cpu") == ("cpu", "cpu")
    assert Workers(jobs=2, threads=3).threads_each() == 3
    assert Workers(jobs=3, devices=("cpu", "meta")).device_of(2) == "cpu"


@pytest.mark.slow
def test_ctrl_c_stops_every_worker_with_a_checkpoint_and_rerunning_finishes(tmp_path):
    out = tmp_path / "cmp"
    flags = ["--dataset", "synthetic", "--clients", "6", "--rounds", "150", "--inner-steps", "5"]
    flags += ["--eval-every", "1", "--set", "checkpoint_every=1"]
    command = [sys.executable, "-m", "pflego.cli", "compare", "--jobs", "2", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(Path(pflego.__file__).parents[1])}
    parent = subprocess.Popen(
        [*command, "--algorithms", "fedavg,fedper", *flags, "--quiet", "--out", str(out)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a signal for the parent alone, as from a terminal
    )
    checkpoints = [out / name / "checkpoint.pt" for name in ("fedavg", "fedper")]
    deadline = time.monotonic() + 120
    while not all(p.is_file() for p in checkpoints) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    parent.send_signal(signal.SIGINT)
    _, err = parent.communicate(timeout=120)
    assert parent.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    stopped = [torch.load(p, weights_only=False)["next_round"] for p in checkpoints]
    assert all(done < 150 for done in stopped), stopped  # both stopped early, both kept
    rerun = subprocess.run(
        [*command, "--resume", str(out), "--quiet"], env=env, capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stderr
    assert [numbers(out / name)[-1]["round"] for name in ("fedavg", "fedper")] == [150, 150]
