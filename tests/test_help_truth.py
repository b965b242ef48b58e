"""Help that tells the truth (issue 39, finding 4): each command's ``--help`` shows its own
defaults and lists no flag the command refuses; ``compare`` on another dataset than its file's
runs every algorithm with its own step sizes, as ``run`` does, and says so."""

from __future__ import annotations

import re

import yaml

from pflego.algorithms import ALGORITHMS
from pflego.cli import build_parser, main
from pflego.cli.parsing import leaf_parsers


def help_of(command: str) -> str:
    parser = next(p for p in leaf_parsers(build_parser()) if p.prog == f"pflego {command}")
    return " ".join(parser.format_help().split())


def test_compare_help_shows_compare_s_defaults_and_no_algorithm_flag():
    text = help_of("compare")
    assert not re.search(r"--algorithm\b(?!s)", text)
    assert "pflego 1, fedavg 0.3, fedper 0.3 on mnist5k" in text
    assert "--out OUT output directory (default: runs/compare-<date>-<time>)" in text
    assert "number of rounds T (default: 100, the main experiment's)" in text
    assert "runs/<algorithm>-<dataset>" not in text


def test_run_and_tune_help_show_their_own_defaults():
    run = help_of("run")
    assert "the algorithm's: " in run and "the main experiment" not in run
    tune = help_of("tune")
    assert "runs/tune-<algorithm>-<date>-<time>" in tune
    assert "--seed SEED" not in tune  # tune refuses --seed (it takes --seeds and --tune-seeds)


def test_compare_on_another_dataset_uses_each_algorithm_s_step_sizes(capsys, tmp_path):
    out = tmp_path / "c"
    argv = ["compare", "--dataset", "tiny", "--clients", "6", "--classes-per-client", "2"]
    argv += ["--rounds", "1", "--inner-steps", "1", "--eval-every", "1", "--quiet"]
    assert main([*argv, "--algorithms", "pflego,fedavg", "--out", str(out)]) == 0
    capsys.readouterr()
    for name in ("pflego", "fedavg"):
        config = yaml.safe_load((out / name / "config.yaml").read_text())
        cls = ALGORITHMS[name]
        assert (config["client_lr"], config["server_lr"]) == (
            cls.default_client_lr,
            cls.default_server_lr,
        )
    assert (
        "on tiny every algorithm runs with its own defaults" in (out / "comparison.md").read_text()
    )
