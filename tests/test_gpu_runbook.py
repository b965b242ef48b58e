"""``benchmarks/gpu_runbook.sh``: every preset, block and row it names exists, its dry run prints
a resumable ``pflego reproduce`` line for each, its smoke test covers every registered algorithm,
and (slow) the smoke test passes on the CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pflego.algorithms import ALGORITHMS
from pflego.cli import build_parser
from pflego.experiments.presets import load_preset

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_runbook.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def runbook(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> str:
    result = subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "RUNBOOK_PYTHON": sys.executable, **(env or {})},
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def entries() -> list[dict[str, str]]:
    """The run-book's entries as ``--list`` prints them (a header, then one line each)."""
    lines = runbook("--list").strip().splitlines()
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"), strict=True)) for line in lines[1:]]


def test_every_preset_block_and_row_of_the_runbook_exists():
    listed = entries()
    assert [e["preset"] for e in listed][:2] == ["pflego-omniglot", "pgfed-cifar10"]
    for entry in listed:
        preset = load_preset(entry["preset"])
        if entry["blocks"] != "-":
            assert set(entry["blocks"].split(",")) <= set(preset.blocks), entry
        if entry["rows"] != "-":
            assert set(entry["rows"].split(",")) <= set(preset.rows), entry
        assert float(entry["GPU hours (estimate)"]) > 0, entry


def test_the_dry_run_prints_one_resumable_reproduce_line_per_entry(tmp_path):
    out = runbook("--dry-run", "cuda:1", env={"RUNBOOK_OUT": str(tmp_path)})
    commands = [line for line in out.splitlines() if " -m pflego reproduce " in line]
    listed = entries()
    assert len(commands) == len(listed)
    for entry, command in zip(listed, commands, strict=True):
        words = command.split()
        assert words[words.index("reproduce") + 1] == entry["preset"]
        assert "--set" in words and "device=cuda:1" in words and "--jobs" in words
        if entry["blocks"] != "-":
            assert words[words.index("--blocks") + 1] == entry["blocks"]
        assert words[words.index("--out") + 1].startswith(str(tmp_path))  # fixed: reruns resume
        build_parser().parse_args(words[words.index("reproduce") :])  # extra arguments included
        assert command.endswith(entry["arguments"] or "--quiet")
    assert next(e for e in listed if e["preset"] == "pflego-cifar10")["arguments"].startswith(
        "--tune"
    )
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_the_smoke_test_runs_every_registered_algorithm():
    assert set(load_preset("leaderboard-mnist").rows) >= set(ALGORITHMS)
    assert "leaderboard-mnist --quick --offline" in SCRIPT.read_text()


def test_an_unknown_option_is_one_line_and_exit_code_2():
    result = subprocess.run(
        ["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, check=False, cwd=ROOT
    )
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "gpu_runbook.sh: unknown option --bogus"


def smoke_with(python: Path, tmp_path: Path, budget: int = 0) -> subprocess.CompletedProcess:
    """``--smoke cpu`` (its CPU size) with ``python`` standing in for pflego's Python."""
    env = {
        **os.environ,
        "RUNBOOK_PYTHON": str(python),
        "RUNBOOK_OUT": str(tmp_path / "out"),
        "RUNBOOK_SMOKE_TINY": "1",
        "RUNBOOK_SMOKE_BUDGET": str(budget),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), "--smoke", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
        check=False,
    )


def fake_python(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "python"
    script.write_text(f"#!/usr/bin/env bash\n{body}\n")
    script.chmod(0o755)
    return script


def test_the_smoke_test_goes_on_past_a_failing_part_and_says_which_failed(tmp_path):
    result = smoke_with(fake_python(tmp_path, "exit 1"), tmp_path)
    assert result.returncode == 1
    ran = [line for line in result.stdout.splitlines() if ": rc 1 in " in line]
    assert len(ran) == 2  # the CNN bench and every algorithm's rounds, both tried
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("smoke test FAILED on cpu")
    assert "CNN bench on cpu (mnist5k) (rc 1)" in last and "2 rounds on cpu (rc 1)" in last


@pytest.mark.slow  # ~11 s: a part runs out of its time on purpose
def test_the_smoke_budget_stops_a_part_and_skips_what_it_leaves_out(tmp_path):
    result = smoke_with(fake_python(tmp_path, "sleep 30"), tmp_path, budget=11)
    assert result.returncode == 1
    last = result.stdout.strip().splitlines()[-1]
    assert "CNN bench on cpu (mnist5k) (out of time)" in last
    assert "2 rounds on cpu (skipped)" in last


@pytest.mark.slow
def test_the_smoke_test_passes_on_the_cpu(tmp_path):
    env = {
        "RUNBOOK_OUT": str(tmp_path),
        "RUNBOOK_SMOKE_TINY": "1",
        "PYTHONPATH": str(ROOT / "src"),
    }
    out = runbook("--smoke", "cpu", env=env, timeout=900)
    assert "smoke test passed on cpu" in out
    report = (tmp_path / "smoke" / "leaderboard" / "report.md").read_text()
    assert all(f"| {name} |" in report for name in ALGORITHMS)
