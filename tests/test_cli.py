"""The command line through ``pflego.cli.main``, one test per item of issue 14.

Each checks the exit code, the one line on stderr (never a traceback) and that nothing was lost.
"""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, VERIFY_LOCAL, preset
from data_formats import idx_bytes, mnist_arrays, write_cifar10, write_emnist_zip, write_idx_set

from pflego.algorithms import ALGORITHMS
from pflego.algorithms.base import Algorithm
from pflego.cli import build_parser, main
from pflego.config import load_config
from pflego.data import DATASETS, ArrayDataset, download, load_dataset, register
from pflego.errors import DataError
from pflego.history import History
from pflego.sim import Simulation, build, build_experiment

TINY_FLAGS = ["--dataset", "tiny", "--clients", "6", "--classes-per-client", "2"]
TINY_FLAGS += ["--participation", "0.5", "--inner-steps", "3", "--client-lr", "0.1"]
TINY_FLAGS += ["--eval-every", "2", "--set", "average_last=0", "--set", "dtype=float64"]
TINY_FLAGS += ["--quiet"]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    """The single line of an error report (and no traceback)."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def records(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in History.load(run_dir).records]


# --- 1. a finished run is never overwritten --------------------------------------------------


def test_existing_run_directory_is_refused_unless_overwrite(capsys, tmp_path):
    out = tmp_path / "run"
    assert run_cli(capsys, "run", *TINY_FLAGS, "--rounds", "4", "--out", out)[0] == 0
    before = (out / "metrics.jsonl").read_bytes()
    code, _, err = run_cli(capsys, "run", *TINY_FLAGS, "--rounds", "2", "--out", out)
    line = one_line(err)
    assert code == 2 and "already holds a run" in line
    assert "--resume" in line and "--overwrite" in line
    assert (out / "metrics.jsonl").read_bytes() == before

    code, _, err = run_cli(capsys, "run", *TINY_FLAGS, "--rounds", "2", "--out", out, "--overwrite")
    assert code == 0, err
    assert [r["round"] for r in records(out)] == [0, 2]
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["next_round"] == 2  # the old run's checkpoint is gone with it


def test_a_bit_flipped_in_the_checkpoint_is_one_line_on_resume(capsys, tmp_path):
    """torch.load reads a checkpoint whose pickle has one bit flipped (here a record's key
    ``dataset``, once a KeyError after resuming); its zip checksums catch every such flip."""
    out = tmp_path / "run"
    assert run_cli(capsys, "run", *TINY_FLAGS, "--rounds", "2", "--out", out)[0] == 0
    raw = bytearray((out / "checkpoint.pt").read_bytes())
    raw[raw.index(b"dataset") + 1] ^= 2  # "dataset" -> "dctaset"
    (out / "checkpoint.pt").write_bytes(bytes(raw))
    code, _, err = run_cli(capsys, "run", "--resume", out, "--quiet")
    assert code == 2
    assert "checkpoint.pt is damaged" in one_line(err) and "data.pkl" in one_line(err)


# --- 2. an unwritable --out is one line, before anything runs --------------------------------


def unwritable(tmp_path: Path) -> list[Path]:
    afile = tmp_path / "a-file"
    afile.write_text("")
    return [Path("/proc/pflego-test"), afile / "below"]


@pytest.mark.parametrize("command", ["run", "compare", "plot"])
def test_unwritable_out_is_one_line_before_training(capsys, tmp_path, monkeypatch, command):
    assert run_cli(capsys, "run", *TINY_FLAGS, "--rounds", "1", "--out", tmp_path / "done")[0] == 0
    monkeypatch.setattr(Simulation, "run_round", lambda *a: pytest.fail("training started"))
    monkeypatch.setattr(Simulation, "evaluate", lambda *a: pytest.fail("training started"))
    for out in unwritable(tmp_path):
        if command == "plot":
            argv = ["plot", tmp_path / "done", "--out", out / "x.png"]
        elif command == "compare":
            argv = ["compare", "--algorithms", "fedavg", *TINY_FLAGS, "--out", out]
        else:
            argv = ["run", *TINY_FLAGS, "--out", out]
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and "cannot write to" in one_line(err) and str(out.parent) in err
    assert not Path("/proc/pflego-test").exists()


# --- 3. Ctrl-C at any moment leaves a run that --resume finishes ----------------------------


def interrupt_first_call(monkeypatch, owner, name: str) -> None:
    original = getattr(owner, name)
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)


@pytest.mark.parametrize(
    "where", ["loading", "before the first evaluation", "first evaluation", "round 1"]
)
def test_ctrl_c_at_any_stage_resumes_to_the_uninterrupted_numbers(
    capsys, tmp_path, monkeypatch, where
):
    argv = ["run", *TINY_FLAGS, "--rounds", "4"]
    assert run_cli(capsys, *argv, "--out", tmp_path / "whole")[0] == 0
    out = tmp_path / "cut"
    with monkeypatch.context() as patch:
        if where == "loading":
            interrupt_first_call(patch, build, "load_dataset")
        elif where == "before the first evaluation":
            interrupt_first_call(patch, Simulation, "__init__")
        elif where == "first evaluation":
            interrupt_first_call(patch, Simulation, "evaluate")
        else:
            original = Simulation.run_round

            def ctrl_c_in_round_one(self, t):
                if t == 1:
                    signal.raise_signal(signal.SIGINT)
                return original(self, t)

            patch.setattr(Simulation, "run_round", ctrl_c_in_round_one)
        code, _, err = run_cli(capsys, *argv, "--out", out)
    assert code == 130
    assert one_line(err) == f"pflego: interrupted; continue with `pflego run --resume {out}`"
    code, stdout, err = run_cli(capsys, "run", "--resume", out, "--quiet")
    assert code == 0, err
    if where in ("loading", "before the first evaluation"):
        assert "stopped before its first checkpoint" in one_line(err)
    else:
        assert one_line(err).startswith(f"pflego: resuming {out}: pflego on tiny from round ")
    assert "final evaluation (round 4)" in stdout
    assert records(out) == records(tmp_path / "whole")


def test_out_of_memory_is_one_line(capsys, tmp_path, monkeypatch):
    def allocate(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"
        )

    monkeypatch.setattr(Simulation, "run_round", allocate)
    code, _, err = run_cli(capsys, "run", *TINY_FLAGS, "--rounds", "2", "--out", tmp_path / "run")
    assert code == 2
    assert one_line(err).startswith("pflego: error: out of memory (RuntimeError); lower clients")


@pytest.mark.slow
def test_sigint_to_the_command_then_resume(tmp_path):
    """``timeout -s INT 8 pflego run ...; pflego run --resume X``, with real processes."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "x"
    cli = [sys.executable, "-m", "pflego.cli", "run"]
    child = subprocess.Popen(
        [*cli, "--algorithm", "fedavg", "--rounds", "200", "--quiet", "--out", str(out)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (out / "checkpoint.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    assert err.strip().splitlines()[-1] == (
        f"pflego: interrupted; continue with `pflego run --resume {out}`"
    )
    done = subprocess.run(
        [*cli, "--resume", str(out), "--rounds", "3", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert [r["round"] for r in records(out)][-1] == 3


# --- 4. --resume takes --rounds (to extend) and refuses every other setting ------------------


def test_resume_extends_with_rounds_and_refuses_other_flags(capsys, tmp_path):
    out, whole = tmp_path / "run", tmp_path / "whole"
    assert run_cli(capsys, "run", *TINY_FLAGS, "--rounds", "4", "--out", out)[0] == 0
    assert run_cli(capsys, "run", *TINY_FLAGS, "--rounds", "8", "--out", whole)[0] == 0
    config = (out / "config.yaml").read_text()
    for extra, named in (
        (["--client-lr", "1"], "--client-lr"),
        (["--set", "seed=3"], "--set seed=3"),
        (["--out", tmp_path / "elsewhere"], "--out"),
        (["--overwrite"], "--overwrite"),
        (["--rounds", "8", "--algorithm", "fedavg"], "(remove --algorithm)"),
    ):
        code, _, err = run_cli(capsys, "run", "--resume", out, *extra)
        line = one_line(err)
        assert code == 2 and "only --rounds may change" in line and named in line
    code, _, err = run_cli(capsys, "run", "--resume", out, "--rounds", "2")
    assert code == 2 and "fewer than the 4 rounds" in one_line(err)
    assert (out / "config.yaml").read_text() == config

    code, stdout, err = run_cli(capsys, "run", "--resume", out, "--rounds", "8", "--quiet")
    assert code == 0
    assert one_line(err) == f"pflego: resuming {out}: pflego on tiny from round 4 to 8 (was 4)"
    assert "final evaluation (round 8)" in stdout
    assert records(out) == records(whole)
    assert yaml.safe_load((out / "config.yaml").read_text())["rounds"] == 8

    code, _, err = run_cli(capsys, "run", "--resume", out, "--quiet")
    assert code == 0 and "already run all 8 rounds" in one_line(err)


# --- 7. corrupt but well-formed files, and checksums of official files -----------------------


def write_mnist(folder: Path, n_train: int = 400, n_test: int = 100, **changes) -> None:
    arrays = {**mnist_arrays(n_train, n_test), **changes}
    write_idx_set(folder, arrays)


def run_mnist(capsys, data_dir: Path, *extra) -> tuple[int, str, str]:
    return run_cli(
        capsys,
        "run",
        "--dataset",
        "mnist",
        "--data-dir",
        data_dir,
        "--clients",
        "5",
        "--rounds",
        "1",
        "--inner-steps",
        "1",
        "--quiet",
        "--out",
        data_dir.parent / "out",
        *extra,
    )


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLEGO_NO_DOWNLOAD", "1")
    monkeypatch.setenv("PFLEGO_CACHE", str(tmp_path / "cache"))


def test_corrupt_but_well_formed_files_are_one_line_errors(capsys, tmp_path, offline):
    labels = np.arange(400, dtype=np.uint8) % 10
    labels[::5] = 200  # well-formed IDX, impossible labels
    cases = {
        "labels": ({"y_train": labels}, "80 of 400 labels lie outside 0..9 (for example 200)"),
        "counts": ({"y_train": labels[:399] % 10}, "different numbers of samples"),
        "shape": (
            {"x_train": np.zeros((400, 28, 27), np.uint8)},
            "images of shape (28, 27), not 28x28",
        ),
    }
    for name, (changes, message) in cases.items():
        data_dir = tmp_path / name / "data"
        write_mnist(data_dir / "mnist", **changes)
        code, _, err = run_mnist(capsys, data_dir)
        assert code == 2 and message in one_line(err), name
        assert not (tmp_path / name / "out").exists()

    bad = mnist_arrays(40, 20)
    bad["y_train"] = bad["y_train"] + 30  # EMNIST digits: 10 classes
    write_emnist_zip(tmp_path / "emnist" / "gzip.zip", "digits", bad)
    with pytest.raises(DataError, match="labels lie outside 0..9"):
        load_dataset("emnist-digits", tmp_path)
    folder = write_cifar10(tmp_path / "cifar" / "cifar-10-batches-py")
    from data_formats import cifar_batch

    (folder / "test_batch").write_bytes(cifar_batch(12, {"labels": np.full(12, 10)}))
    with pytest.raises(DataError, match="test_batch.*outside 0..9"):
        load_dataset("cifar10", tmp_path / "cifar")


def test_every_loader_output_is_checked(tmp_path):
    """A loader of any dataset that returns impossible labels or counts fails in one line."""

    @register("broken-test-only", "mlp", False, "tests only")
    def broken(root: Path, seed: int = 0) -> ArrayDataset:
        x = np.zeros((10, 1, 4, 4), np.float32)
        return ArrayDataset("broken", x, np.arange(10) % 3 + 1, None, None, 3)

    try:
        with pytest.raises(DataError, match="3 train labels lie outside 0..2"):
            load_dataset("broken-test-only")
        with pytest.raises(DataError, match="10 inputs, 9 labels"):
            ArrayDataset("short", np.zeros((10, 2)), np.zeros(9, np.int64), None, None, 2)
    finally:
        DATASETS.pop("broken-test-only")


def test_official_files_are_checked_against_published_checksums(
    capsys, tmp_path, offline, monkeypatch
):
    monkeypatch.setattr(download, "verify_local", VERIFY_LOCAL)
    monkeypatch.delenv("PFLEGO_NO_VERIFY", raising=False)  # the check is what is tested
    data_dir = tmp_path / "data"
    write_mnist(data_dir / "mnist")
    code, _, err = run_mnist(capsys, data_dir)
    line = one_line(err)
    assert code == 2 and "train-images-idx3-ubyte.gz does not match the official" in line
    assert "--no-verify" in line and "md5" in line

    code, stdout, err = run_mnist(capsys, data_dir, "--no-verify")
    assert code == 0, err
    warnings = err.strip().splitlines()
    assert len(warnings) == 4 and all("warning:" in w and "--no-verify" in w for w in warnings)
    assert "PFLEGO_NO_VERIFY" not in os.environ  # restored after the command

    # a file whose bytes are the published ones passes (here: a published checksum of our own)
    path = data_dir / "mnist" / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.arange(100) % 10), mtime=0))
    own = download.Remote(path.name, ("https://example.invalid/",), "md5:" + md5(path))
    monkeypatch.setitem(download.REMOTES, "mnist", [own])
    assert download.verify_local("mnist", path) == path


def md5(path: Path) -> str:
    import hashlib

    return hashlib.md5(path.read_bytes()).hexdigest()


def test_the_shared_mnist_is_byte_identical_to_the_official_files():
    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
    if not shared.is_dir():
        pytest.skip(f"no real MNIST at {shared}")
    for path in sorted(shared.glob("*.gz")):
        assert VERIFY_LOCAL("mnist", path) == path


# --- 8. one name, one unit, one definition; one step-size rule --------------------------------


def test_console_and_metrics_use_the_same_names_and_step_sizes(capsys, tmp_path):
    out = tmp_path / "run"
    code, stdout, _ = run_cli(capsys, "run", *TINY_FLAGS, "--rounds", "2", "--out", out)
    last = History.load(out).records[-1]
    assert code == 0
    first = stdout.splitlines()[0]
    for key in ("test_acc", "test_acc_weighted", "test_acc_p10", "test_acc_p90", "test_acc_std"):
        assert f"{key} {100 * last[key]:.2f}%" in first  # percent on the console
        assert 0 <= last[key] <= 1  # fractions in the file
    assert f"train_loss {last['train_loss']:.4f}" in first
    assert "accuracies as fractions" in stdout

    # run and compare train with the same step sizes: the algorithm's defaults (chosen across
    # settings, docs/defaults.md); each run's config.yaml records them
    for name in preset()["algorithms"]:
        defaults = ALGORITHMS[name]
        config = build_experiment(load_config({**TINY, "client_lr": None}, algorithm=name)).config
        assert (config.client_lr, config.server_lr) == (
            defaults.default_client_lr,
            defaults.default_server_lr,
        )
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["client_lr"] == 0.1  # given
    assert written["server_lr"] == ALGORITHMS["pflego"].default_server_lr  # the default's


# --- 9. --help, --version, no abbreviations, --threads ---------------------------------------


def leaf_parsers():
    from pflego.cli.parsing import leaf_parsers as _leaf_parsers

    root = build_parser()
    return [p for p in _leaf_parsers(root) if p is not root]


def test_help_shows_every_default_and_choice(capsys):
    from pflego.data.partition import PARTITIONS

    parsers = leaf_parsers()
    assert {p.prog for p in parsers} >= {"pflego run", "pflego compare", "pflego bench"}
    for parser in parsers:
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or action.help == "==SUPPRESS==":
                continue
            if action.nargs == 0:  # a switch: off unless given
                assert action.help, (parser.prog, action.option_strings)
                continue
            help_text = parser._get_formatter()._expand_help(action)
            assert "default" in help_text or action.required, (parser.prog, action.dest)
        assert "--threads" in text, parser.prog
    run_help = next(p for p in parsers if p.prog == "pflego run").format_help()
    flat = " ".join(run_help.split())
    for name in (*PARTITIONS, *ALGORITHMS, "bernoulli", "adam", "momentum", "loop", "conv4"):
        assert name in flat, name

    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.startswith("pflego ")


def test_every_command_that_reads_dataset_files_takes_no_verify():
    """The checksum error's hint (--no-verify) works wherever --data-dir does."""
    readers = [p for p in leaf_parsers() if "--data-dir" in p._option_string_actions]
    assert {p.prog for p in readers} >= {"pflego run", "pflego reproduce", "pflego bench"}
    for parser in readers:
        assert "--no-verify" in parser._option_string_actions, parser.prog


def test_abbreviations_are_refused(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", *TINY_FLAGS, "--round", "2", "--out", tmp_path / "r")
    assert code == 2 and "unrecognized arguments: --round" in one_line(err)
    assert not (tmp_path / "r").exists()


def test_threads_flag_sets_torch_threads_for_the_command_only(capsys, monkeypatch):
    import pflego.cli.tools as tools

    seen = []
    monkeypatch.setattr(tools, "cmd_list", lambda args: seen.append(torch.get_num_threads()) or 0)
    before = torch.get_num_threads()
    assert run_cli(capsys, "list", "--threads", "2")[0] == 0
    assert seen == [2] and torch.get_num_threads() == before
    code, _, err = run_cli(capsys, "list", "--threads", "0")
    assert code == 2 and "--threads=0 must be at least 1" in one_line(err)


# --- 11. list and plot ----------------------------------------------------------------------


def test_list_aligns_long_names(capsys):
    code, out, _ = run_cli(capsys, "list")
    assert code == 0
    lines = out.splitlines()
    datasets = lines[lines.index("datasets:") + 1 : -1]
    columns = {len(line) - len(line[2:].split("  ", 1)[1].lstrip()) for line in datasets}
    assert len(columns) == 1  # every description starts in the same column
    assert any("emnist-balanced" in line for line in datasets)


def test_plot_has_a_title_a_zoomed_accuracy_axis_and_the_bottom_decile(
    capsys, tmp_path, monkeypatch
):
    from matplotlib.figure import Figure

    for name, algorithm in (("a", "pflego"), ("b", "fedavg")):
        argv = ["run", *TINY_FLAGS, "--algorithm", algorithm, "--rounds", "6"]
        assert run_cli(capsys, *argv, "--out", tmp_path / name)[0] == 0
    figures = []
    original = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda self, *a, **k: (figures.append(self), original(self, *a, **k))
    )
    code, out, _ = run_cli(
        capsys, "plot", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "p.png"
    )
    assert code == 0 and (tmp_path / "p.png").is_file()
    figure = figures[-1]
    assert figure._suptitle.get_text() == "pflego, fedavg on tiny"
    accuracy = figure.axes[1]
    labels = [line.get_label() for line in accuracy.get_lines()]
    assert labels == ["a", "a, bottom 10% of clients", "b", "b, bottom 10% of clients"]
    late = [
        y
        for line in accuracy.get_lines()
        for x, y in zip(line.get_xdata(), line.get_ydata())
        if x >= 3
    ]
    low, high = accuracy.get_ylim()
    assert min(late) - 10 <= low <= min(late) and max(late) <= high <= min(100, max(late) + 10)


# --- 12. flower local: small sizes and Ctrl-C ---------------------------------------------


def test_flower_local_small_sizes_and_ctrl_c(capsys, tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    import tempfile

    from pflego.flower import deploy

    class Interrupting:
        def __init__(self, workdir, *args, **kwargs):
            (Path(workdir) / "logs").mkdir(parents=True)
            (Path(workdir) / "logs" / "superlink.log").write_text("started")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def start_nodes(self, count, **kwargs):
            raise KeyboardInterrupt

    monkeypatch.setattr(deploy, "LocalDeployment", Interrupting)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    local = ["flower", "local", "--no-netns", "--quiet"]

    code, _, err = run_cli(capsys, *local, "--nodes", "2", "--clients", "2", "--rounds", "2")
    line = one_line(err)
    assert code == 2 and "--classes-per-client 5" in line and "at least 5 clients" in line

    out = tmp_path / "flower-run"
    code, _, err = run_cli(capsys, *local, *TINY_FLAGS, "--nodes", "6", "--out", out)
    assert code == 130
    line = one_line(err)
    assert f"pflego flower local --resume {out}" in line and "every Flower process" in line
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary folder is gone


def test_run_help_shows_the_default_step_sizes(capsys):
    from pflego.cli.flags import step_size_default

    code, out, _ = run_cli(capsys, "run", "--help")
    assert code == 0
    shown = " ".join(out.split())  # argparse wraps the help's lines
    for key in ("client_lr", "server_lr"):
        text = step_size_default(key)
        assert text in shown
        library = getattr(Algorithm, f"default_{key}")
        assert f"others {library:g}" in text
        for name, cls in ALGORITHMS.items():  # each one's own value named, the others' not
            value = getattr(cls, f"default_{key}")
            named = f": {name} " in text or f", {name} " in text
            assert named == (value != library), (key, name)
            assert not named or f"{name} {value:g}" in text
