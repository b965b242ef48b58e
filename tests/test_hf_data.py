"""``--dataset hf:...``: Hugging Face datasets built here (save_to_disk folders, a parquet file),
read offline; nothing comes from the network (``HF_DATASETS_OFFLINE=1``)."""

from __future__ import annotations

import os

os.environ["HF_DATASETS_OFFLINE"] = "1"  # before datasets is imported: it reads it once
os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

datasets = pytest.importorskip("datasets")

from pflego.cli import main  # noqa: E402
from pflego.config import load_config  # noqa: E402
from pflego.data import load_dataset  # noqa: E402
from pflego.errors import ConfigError  # noqa: E402
from pflego.history import History  # noqa: E402
from pflego.sim import build_experiment  # noqa: E402

Features, ClassLabel, Image, Value = (
    datasets.Features,
    datasets.ClassLabel,
    datasets.Image,
    datasets.Value,
)


@pytest.fixture(autouse=True)
def _private_caches(tmp_path, monkeypatch):
    """pflego's and Hugging Face's caches in the test's folder; offline, quiet; no curves.png
    (drawing it is most of a tiny run's time; tests/test_runs.py covers it)."""
    import pflego.plots

    monkeypatch.setattr(pflego.plots, "plot_histories", lambda *args, **kwargs: None)
    monkeypatch.setenv("PFLEGO_CACHE", str(tmp_path / "pflego-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-home" / "datasets")
    datasets.disable_progress_bars()


def image_set(rng: np.random.Generator, n: int) -> dict:
    """``n`` 6x6 grayscale images in 3 classes, each class a bright square in its own place, and
    a writer id (4 writers)."""
    y = np.arange(n) % 3
    x = rng.integers(0, 60, (n, 6, 6), dtype=np.uint8)
    for k in range(3):
        x[y == k, 2 * k : 2 * k + 2, :] += 180
    return {"image": list(x), "label": y.tolist(), "writer": [f"w{i % 4}" for i in range(n)]}


IMAGE_FEATURES = Features(
    {"image": Image(), "label": ClassLabel(names=["a", "b", "c"]), "writer": Value("string")}
)


@pytest.fixture
def image_folder(tmp_path):
    """A DatasetDict (train 48, test 24) of PNG-encoded uint8 images saved with save_to_disk."""
    rng = np.random.default_rng(0)
    train, test = image_set(rng, 48), image_set(rng, 24)
    folder = tmp_path / "images"
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict(train, features=IMAGE_FEATURES),
        test=datasets.Dataset.from_dict(test, features=IMAGE_FEATURES),
    ).save_to_disk(str(folder))
    return folder, train, test


def test_images_read_back_as_written(image_folder):
    folder, train, test = image_folder
    data = load_dataset(f"hf:{folder}")
    assert data.x_train.shape == (48, 1, 6, 6) and data.x_train.dtype == np.uint8
    np.testing.assert_array_equal(data.x_train[:, 0], np.stack(train["image"]))
    np.testing.assert_array_equal(data.x_test[:, 0], np.stack(test["image"]))
    np.testing.assert_array_equal(data.y_train, train["label"])
    np.testing.assert_array_equal(data.y_test, test["label"])
    assert data.num_classes == 3 and data.scale == pytest.approx(1 / 255)
    assert data.groups_train is None  # no natural clients unless hf_client names a column
    assert data.sources == [folder]  # recorded for environment.json
    again = load_dataset(f"hf:{folder}")  # from pflego's cache now
    np.testing.assert_array_equal(again.x_train, data.x_train)


def test_array_feature_and_colour_images(tmp_path):
    rng = np.random.default_rng(1)
    gray = rng.integers(0, 256, (5, 4, 4), dtype=np.uint8)
    datasets.Dataset.from_dict(
        {"pixels": list(gray), "digit": [0, 1, 2, 3, 1]},
        features=Features({"pixels": datasets.Array2D((4, 4), "uint8"), "digit": Value("int64")}),
    ).save_to_disk(str(tmp_path / "arrays"))
    data = load_dataset(f"hf:{tmp_path / 'arrays'}", hf_label="digit")
    np.testing.assert_array_equal(data.x_train[:, 0], gray)
    assert data.num_classes == 4 and data.x_test is None  # pflego splits it

    rgb = rng.integers(0, 256, (2, 4, 4, 3), dtype=np.uint8)
    datasets.Dataset.from_dict(
        {"img": [rgb[0], gray[0], rgb[1]], "label": ["cat", "dog", "ant"]},
        features=Features({"img": Image(), "label": Value("string")}),
    ).save_to_disk(str(tmp_path / "mixed"))
    data = load_dataset(f"hf:{tmp_path / 'mixed'}")
    assert data.x_train.shape == (3, 3, 4, 4)
    np.testing.assert_array_equal(data.x_train[0], rgb[0].transpose(2, 0, 1))
    np.testing.assert_array_equal(data.x_train[1], np.stack([gray[0]] * 3))  # gray to 3 channels
    assert data.y_train.tolist() == [1, 2, 0]  # string labels: ids of the sorted values


def test_parquet_table_reads_back_with_named_columns(tmp_path):
    rng = np.random.default_rng(2)
    table = {
        "height": rng.normal(size=20).tolist(),
        "weight": rng.normal(size=20).tolist(),
        "note": ["x"] * 20,  # a string column is not an input
        "species": (np.arange(20) % 2).tolist(),
        "site": (np.arange(20) % 5).tolist(),
    }
    path = tmp_path / "table.parquet"
    datasets.Dataset.from_dict(table).to_parquet(str(path))
    data = load_dataset(f"hf:{path}", hf_label="species", hf_features="weight,height")
    expected = np.stack([table["weight"], table["height"]], axis=1).astype(np.float32)
    np.testing.assert_array_equal(data.x_train, expected)
    np.testing.assert_array_equal(data.y_train, table["species"])
    assert data.num_classes == 2 and data.scale == 1.0 and data.sources == [path]
    found = load_dataset(f"hf:{path}", hf_label="species")  # every numeric column but the label
    np.testing.assert_array_equal(
        found.x_train,
        np.stack([table[c] for c in ("height", "weight", "site")], 1).astype(np.float32),
    )


def test_natural_partition_by_a_column(image_folder):
    folder, train, test = image_folder
    data = load_dataset(f"hf:{folder}", hf_client="writer")
    assert data.extra["group_names"] == ["w0", "w1", "w2", "w3"]
    np.testing.assert_array_equal(data.groups_train, [int(w[1]) for w in train["writer"]])
    np.testing.assert_array_equal(data.groups_test, [int(w[1]) for w in test["writer"]])
    config = load_config(
        dataset=f"hf:{folder}", hf_client="writer", partition="natural", clients=4, rounds=1
    )
    fed = build_experiment(config).data
    assert fed.num_clients == 4 and fed.groups == ["w0", "w1", "w2", "w3"]
    images = np.stack(train["image"])
    for client, writer in enumerate(fed.groups):  # each client holds exactly its writer's samples
        held = fed.x_train[fed.train_slice(client)].numpy()[:, 0]
        own = images[[w == writer for w in train["writer"]]]
        assert sorted(map(bytes, held)) == sorted(map(bytes, own))
        assert fed.test_sizes[client] == sum(w == writer for w in test["writer"])


def test_label_partitions_and_pachinko_by_a_coarse_column(tmp_path):
    rng = np.random.default_rng(3)
    fine = np.arange(120) % 6
    table = {"x1": rng.normal(size=120).tolist(), "x2": rng.normal(size=120).tolist()}
    table |= {"fine": fine.tolist(), "coarse": (fine // 3).tolist()}
    datasets.Dataset.from_dict(table).save_to_disk(str(tmp_path / "nested"))
    spec = {"dataset": f"hf:{tmp_path / 'nested'}", "hf_label": "fine", "clients": 4, "rounds": 1}
    data = load_dataset(spec["dataset"], hf_label="fine", hf_coarse="coarse")
    np.testing.assert_array_equal(data.extra["coarse_train"], fine // 3)
    np.testing.assert_array_equal(data.extra["fine_train"], fine)
    pachinko = build_experiment(load_config(spec, hf_coarse="coarse", partition="pachinko")).data
    assert pachinko.num_clients == 4 and len(set(pachinko.train_sizes.tolist())) == 1
    for partition, extra in (("classes", {"classes_per_client": 2}), ("dirichlet", {})):
        fed = build_experiment(load_config(spec, partition=partition, **extra)).data
        assert fed.num_clients == 4 and fed.num_classes == 6
        if partition == "classes":
            assert all(len(c) == 2 for c in fed.class_counts("train"))
    with pytest.raises(ConfigError, match="coarse and fine labels.*hf_coarse=COLUMN"):
        build_experiment(load_config(spec, partition="pachinko"))


def run(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_three_rounds_train_and_resume(image_folder, capsys, tmp_path):
    folder, _, _ = image_folder
    out = tmp_path / "run"
    flags = ["--dataset", f"hf:{folder}", "--clients", "4", "--classes-per-client", "2"]
    flags += ["--inner-steps", "5", "--eval-every", "1", "--participation", "1", "--quiet"]
    code, err = run(capsys, "run", *flags, "--rounds", "3", "--out", out)
    assert code == 0, err
    first = History.load(out).records
    assert [r["round"] for r in first] == [0, 1, 2, 3]
    assert first[-1]["test_acc"] > first[0]["test_acc"]  # it learns the bright squares
    code, err = run(capsys, "run", "--resume", out, "--rounds", "5", "--quiet")
    assert code == 0, err
    resumed = History.load(out).records
    assert [r["round"] for r in resumed] == [0, 1, 2, 3, 4, 5]
    assert resumed[:4] == first  # the first three rounds stay as they were


def one_line_error(capsys, *argv) -> str:
    code, err = run(capsys, "run", *argv, "--rounds", "1", "--quiet", "--out", "unused-run")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_one_line_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    datasets.Dataset.from_dict({"text": ["a", "b"], "score": [0.5, 1.5]}).save_to_disk("regress")
    line = one_line_error(capsys, "--dataset", "hf:./regress")
    assert "not a classification dataset" in line and "hf_label" in line
    line = one_line_error(capsys, "--dataset", "hf:./regress", "--set", "hf_label=score")
    assert "not a classification dataset" in line and "float" in line
    line = one_line_error(capsys, "--dataset", "hf:./regress", "--set", "hf_label=nope")
    assert "no column 'nope'" in line and "text, score" in line
    line = one_line_error(capsys, "--dataset", "hf:someone/not-cached")
    assert "not in the Hugging Face cache" in line and "HF_DATASETS_OFFLINE=1" in line
    line = one_line_error(capsys, "--dataset", "hf:./missing.parquet")
    assert "no such save_to_disk folder or parquet file" in line
    line = one_line_error(capsys, "--dataset", "mnist5k", "--set", "hf_label=label")
    assert "hf_label=label" in line and "not one (hf:NAME)" in line
    assert not (tmp_path / "unused-run" / "metrics.jsonl").exists()


def test_missing_extra_is_one_line(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ModuleNotFoundError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ConfigError, match=r"pip install 'pflego\[hf\]'"):
        load_dataset(f"hf:{tmp_path}")


def test_default_run_directory_names_a_path_dataset_in_one_folder():
    from pflego.sim.checkpoints import default_out

    out = default_out(load_config(dataset="hf:/data/sets/my set"))
    assert out.parent.name == "runs" and out.name.startswith("pflego-hf-data-sets-my-set-")
