"""``benchmarks/defaults_study.py``: its grids hold each algorithm's default, and the defaults the
library ships agree with the committed evidence (results/defaults/study.json)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pflego.algorithms import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study_module():
    spec = importlib.util.spec_from_file_location(
        "defaults_study", ROOT / "benchmarks" / "defaults_study.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_algorithm_with_a_step_size_is_studied_in_leaderboard_order(study_module):
    order = study_module.algorithms_in_order()
    assert sorted(order + list(study_module.NO_STEP_SIZE)) == sorted(ALGORITHMS)
    assert order[:3] == ["fedbn", "fedavg+", "fedphp"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.05, [0.01, 0.03, 0.05, 0.1, 0.3]),  # off the ladder: two points each side
        (0.3, [0.03, 0.1, 0.3, 1.0, 3.0]),
        (0.09, [0.01, 0.03, 0.09, 0.3, 1.0]),  # 0.1 is too close to 0.09 to be a neighbour
    ],
)
def test_grid_points_around_a_default(study_module, value, expected):
    assert study_module.around(value, 2, 2) == expected


def test_grids_hold_the_default_and_cross_a_second_step_size(study_module):
    grid = study_module.default_grid("fedbn")
    assert grid == ["client_lr=0.03,0.1,0.3,1.0"]  # SGD steps over 1 are left out
    (pfedme,) = study_module.default_grid("pfedme")
    key, _, values = pfedme.partition("=")
    assert key == "client_lr+options.personal_lr"
    pairs = [tuple(float(v) for v in item.split("/")) for item in values.split(",")]
    default = study_module.current_default("pfedme")
    lr, personal = default["client_lr"], default["options"]["personal_lr"]
    assert (lr, personal) in pairs  # the defaults themselves
    assert {b for a, b in pairs if a != lr} == {personal}  # client_lr moves at personal_lr's
    assert {a for a, b in pairs if b != personal} == {lr}  # and personal_lr at client_lr's
    assert study_module.decimal(0.0001) == "0.0001" and study_module.decimal(1.0) == "1.0"


def test_shipped_defaults_are_the_studys_choice_or_the_default_it_kept(study_module):
    study = json.loads((ROOT / "results" / "defaults" / "study.json").read_text())
    for name, entry in study["algorithms"].items():
        if "chosen" not in entry:
            continue
        default = study_module.current_default(name)
        if name == "pflego":  # its server step size is part of the choice
            cls = ALGORITHMS[name]
            default |= {"server_optimizer": "sgd", "server_lr": cls.default_server_lr}
            default = {k: default[k] for k in ("client_lr", "server_optimizer", "server_lr")}
        label = study_module.point_label(default)
        assert label in (entry["chosen"], entry["old default"]), name
