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
        assert command.endswith(entry["arguments"])
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
