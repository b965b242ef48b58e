"""Downloads (through pooch) against a local HTTP server on 127.0.0.1 (the only network the tests
touch)."""

from __future__ import annotations

import hashlib
import http.server
import threading
from functools import partial
from pathlib import Path

import pooch
import pytest
from data_formats import IDX_NAMES, mnist_arrays, write_idx_set

from pflego.data import download as dl
from pflego.data import load_dataset
from pflego.errors import DataError


@pytest.fixture
def server(tmp_path):
    """Serve ``tmp_path / "www"`` on 127.0.0.1 at a free port; yields the base URL."""
    root = tmp_path / "www"
    root.mkdir()
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", root
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLEGO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PFLEGO_NO_DOWNLOAD", raising=False)


def md5(data: bytes) -> str:
    return "md5:" + hashlib.md5(data).hexdigest()


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def published(path: Path, checksum: str) -> bool:
    """Whether the file at ``path`` has the checksum ``"<algorithm>:<hex digest>"`` (by pooch)."""
    algorithm, _, digest = checksum.partition(":")
    return pooch.file_hash(str(path), alg=algorithm) == digest


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize("digest", [md5, sha256])
def test_fetch_verifies_checksum(server, tmp_path, digest):
    base, www = server
    payload = b"official bytes" * 1000
    (www / "file.bin").write_bytes(payload)
    remote = dl.Remote("file.bin", (base + "file.bin",), digest(payload))
    path = dl.fetch(remote, tmp_path / "data")
    assert path.read_bytes() == payload and published(path, remote.checksum)


def test_checksum_mismatch_leaves_nothing(server, tmp_path):
    base, www = server
    (www / "file.bin").write_bytes(b"tampered")
    remote = dl.Remote("file.bin", (base + "file.bin",), md5(b"official"))
    with pytest.raises(DataError) as exc:
        dl.fetch(remote, tmp_path / "data")
    assert "checksum" in str(exc.value) and "\n" not in str(exc.value)
    assert leftovers(tmp_path / "data") == []


def test_falls_back_to_mirror(server, tmp_path):
    base, www = server
    (www / "mirror").mkdir()
    (www / "mirror" / "file.bin").write_bytes(b"abc")
    remote = dl.Remote("file.bin", (base + "gone/file.bin", base + "mirror/file.bin"), md5(b"abc"))
    assert dl.fetch(remote, tmp_path / "data").read_bytes() == b"abc"
    assert leftovers(tmp_path / "data") == ["file.bin"]


def test_every_url_failing_names_each_failure(server, tmp_path):
    base, _ = server
    remote = dl.Remote("f.bin", (base + "gone/f.bin", "http://127.0.0.1:9/f.bin"), md5(b""))
    with pytest.raises(DataError) as exc:
        dl.fetch(remote, tmp_path / "data")
    message = str(exc.value)
    assert "\n" not in message and "cannot download f.bin" in message
    assert f"{base}gone/f.bin: HTTP 404" in message and "127.0.0.1:9/f.bin: [Errno" in message


def test_unreachable_server_is_a_one_line_error(tmp_path):
    remote = dl.Remote("f.bin", ("http://127.0.0.1:9/f.bin",), md5(b""))
    with pytest.raises(DataError) as exc:
        dl.fetch(remote, tmp_path / "data" / "sub")
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "data").exists()  # no empty folders left behind


def test_no_download_switch(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLEGO_NO_DOWNLOAD", "1")
    assert not dl.downloads_enabled()
    remote = dl.Remote("f.bin", ("http://127.0.0.1:9/f.bin",), md5(b""))
    with pytest.raises(DataError, match="PFLEGO_NO_DOWNLOAD"):
        dl.fetch(remote, tmp_path)


def test_dataset_downloads_missing_files(server, tmp_path, monkeypatch):
    base, www = server
    arrays = mnist_arrays()
    files = write_idx_set(www, arrays)
    remotes = [dl.Remote(p.name, (base + p.name,), md5(p.read_bytes())) for p in files]
    monkeypatch.setitem(dl.REMOTES, "fmnist", remotes)
    data = load_dataset("fmnist", tmp_path / "data")
    assert data.x_train.shape == (30, 1, 28, 28)
    assert leftovers(tmp_path / "data" / "fmnist") == sorted(IDX_NAMES)


def test_dataset_download_mismatch_says_where_to_put_files(server, tmp_path, monkeypatch):
    base, www = server
    files = write_idx_set(www, mnist_arrays())
    remotes = [dl.Remote(p.name, (base + p.name,), md5(b"other")) for p in files]
    monkeypatch.setitem(dl.REMOTES, "fmnist", remotes)
    with pytest.raises(DataError) as exc:
        load_dataset("fmnist", tmp_path / "data")
    message = str(exc.value)
    assert "\n" not in message and str(tmp_path / "data" / "fmnist") in message
    assert "checksum" in message and not list((tmp_path / "data").rglob("*.gz"))


def test_official_remotes_are_well_formed():
    for key, remotes in dl.REMOTES.items():
        assert remotes, key
        for r in remotes:
            algo, _, digest = r.checksum.partition(":")
            assert algo in ("md5", "sha256") and len(digest) == {"md5": 32, "sha256": 64}[algo]
            assert all(
                u.startswith(("https://", "http://")) and u.endswith(r.filename) for u in r.urls
            )


def test_shared_mnist_matches_published_checksums():
    folder = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnist"
    if not folder.is_dir():
        pytest.skip(f"no shared MNIST copy at {folder}")
    for r in dl.REMOTES["mnist"]:
        assert published(folder / r.filename, r.checksum), r.filename
