"""The official download locations and checksums of the built-in datasets, fetched with pooch,
and checks of local copies.

A missing file is downloaded unless ``PFLEGO_NO_DOWNLOAD=1``: pooch streams it next to its
destination, checks the published checksum and only then moves it into place (no partial file is
ever left), trying the official URL and then the mirrors. An official file found locally is checked
against the same checksum once per process: a mismatch is an error naming the file, or a warning
with ``--no-verify`` (``PFLEGO_NO_VERIFY=1``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pooch

from pflego.environment import digest
from pflego.errors import DataError

log = logging.getLogger("pflego.data")

NO_DOWNLOAD_ENV = "PFLEGO_NO_DOWNLOAD"
NO_VERIFY_ENV = "PFLEGO_NO_VERIFY"
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Remote:
    """A file published at one or more URLs with a published checksum.

    Attributes:
        filename: Name of the file on disk.
        urls: Official location first, then mirrors.
        checksum: ``"md5:<hex>"`` or ``"sha256:<hex>"``, as published (pooch's ``known_hash``).
    """

    filename: str
    urls: tuple[str, ...]
    checksum: str


def _md5s(base_urls: tuple[str, ...], files: dict[str, str]) -> list[Remote]:
    return [
        Remote(name, tuple(base + name for base in base_urls), f"md5:{digest}")
        for name, digest in files.items()
    ]


_MNIST_BASES = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
_FMNIST_BASES = ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",)
_OMNIGLOT_BASES = ("https://raw.githubusercontent.com/brendenlake/omniglot/master/python/",)

REMOTES: dict[str, list[Remote]] = {
    "mnist": _md5s(
        _MNIST_BASES,
        {
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
    ),
    "fmnist": _md5s(
        _FMNIST_BASES,
        {
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
    ),
    "emnist": _md5s(
        (
            "https://biometrics.nist.gov/cs_links/EMNIST/",
            "http://www.itl.nist.gov/iaui/vip/cs_links/EMNIST/",
        ),
        {"gzip.zip": "58c8d27c78d21e728a6bc7b3cc06412e"},
    ),
    "cifar10": _md5s(
        ("https://www.cs.toronto.edu/~kriz/",),
        {"cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a"},
    ),
    "cifar100": _md5s(
        ("https://www.cs.toronto.edu/~kriz/",),
        {"cifar-100-python.tar.gz": "eb9058c3a382ffc7106e4002c42a8d85"},
    ),
    # MedMNIST v3 (the ``medmnist`` package's INFO["organamnist"]: url and MD5 of the 28x28 file).
    "organamnist": _md5s(
        ("https://zenodo.org/records/10519652/files/",),
        {"organamnist.npz": "68e3f8846a6bd62f0c9bf841c0d9eacc"},
    ),
    "omniglot": _md5s(
        _OMNIGLOT_BASES,
        {
            "images_background.zip": "68d2efa1b9178cc56df9314c21c6e718",
            "images_evaluation.zip": "6b91aef0f799c5bb55b94e3f2daec811",
        },
    ),
}


def downloads_enabled() -> bool:
    """False when ``PFLEGO_NO_DOWNLOAD`` is set to anything but ``0`` / empty."""
    return os.environ.get(NO_DOWNLOAD_ENV, "") in ("", "0")


#: Local files whose mismatch has been warned about in this process.
_warned: set[Path] = set()


def verify_local(key: str, path: Path) -> Path:
    """Check a local copy of one of ``REMOTES[key]`` against its published checksum.

    Files of other names (not official files) pass unchecked.

    Raises:
        DataError: The file does not match, unless verification is off (``--no-verify``), in
            which case a warning is logged (once) and the file is used.
    """
    path = Path(path)
    remote = next((r for r in REMOTES.get(key, []) if r.filename == path.name), None)
    if remote is None:
        return path
    algo, _, published = remote.checksum.partition(":")
    try:
        found = digest(path, algo)
    except OSError as exc:
        raise DataError(f"cannot read {path} ({exc.strerror or exc}); replace it") from None
    if found == published.lower():
        return path
    if os.environ.get(NO_VERIFY_ENV, "") in ("", "0"):  # no --no-verify
        raise DataError(
            f"{path} does not match the official {remote.filename} ({algo} {found} != "
            f"published {published}); replace it with the official file (delete it to download "
            "it again), or pass --no-verify to use it anyway"
        )
    if path.resolve() not in _warned:
        _warned.add(path.resolve())
        log.warning(
            "%s does not match the official file's published checksum; using it anyway "
            "(--no-verify)",
            path,
        )
    return path


def _failure(exc: BaseException) -> str:
    """Why a download failed, in one line: the HTTP status, or the innermost network error."""
    response = getattr(exc, "response", None)
    if response is not None:
        return f"HTTP {response.status_code} {response.reason}"
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return " ".join(str(exc).split()) or type(exc).__name__


def fetch(remote: Remote, folder: Path) -> Path:
    """Download ``remote`` into ``folder``, trying its URLs in order; verify its checksum.

    Raises:
        DataError: Downloads are off, every URL failed, or the checksum does not match.
    """
    folder = Path(folder)
    dest = folder / remote.filename
    if not downloads_enabled():
        raise DataError(
            f"downloads are off ({NO_DOWNLOAD_ENV}=1); put {remote.filename} in {folder}"
        )
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {folder} ({exc}); pass a writable --data-dir") from None
    pooch.get_logger().setLevel(logging.WARNING)  # pflego logs the download itself
    downloader = pooch.HTTPDownloader(progressbar=sys.stderr.isatty(), timeout=TIMEOUT_S)
    errors = []
    try:
        for url in remote.urls:
            log.info("downloading %s", url)
            try:  # pooch streams it to a temporary file, checks it, then moves it into place
                pooch.retrieve(url, remote.checksum, remote.filename, folder, downloader=downloader)
                return dest
            except OSError as exc:  # requests' errors are OSErrors
                errors.append(f"{url}: {_failure(exc)}")
            except ValueError:  # pooch's checksum mismatch (it has deleted the download already)
                raise DataError(
                    f"download of {url} does not match its published checksum "
                    f"({remote.checksum}); try again later or put the official file at {dest}"
                ) from None
        raise DataError(f"cannot download {remote.filename} ({'; '.join(errors)})")
    finally:
        for path in created:  # leave no empty folders behind after a failed download
            if not dest.exists():
                with contextlib.suppress(OSError):
                    path.rmdir()


def ensure_files(key: str, folder: Path, names: list[str] | None = None) -> list[Path]:
    """The files of ``REMOTES[key]`` (or those of them named) in ``folder``, downloading missing ones.

    Raises:
        DataError: One line naming the files to put where, when a file is missing and cannot be
            downloaded (offline, downloads off, checksum mismatch).
    """
    remotes = [r for r in REMOTES[key] if names is None or r.filename in names]
    missing = [r for r in remotes if not (Path(folder) / r.filename).is_file()]
    for remote in remotes:
        if remote not in missing:
            verify_local(key, Path(folder) / remote.filename)
    for remote in missing:
        try:
            fetch(remote, folder)
        except DataError as exc:
            wanted = ", ".join(r.filename for r in missing)
            raise DataError(
                f"{key}: missing {wanted} in {folder} and {exc}; download them from "
                f"{remote.urls[0].rsplit('/', 1)[0]}/ into that folder (or pass --data-dir)"
            ) from None
    return [Path(folder) / r.filename for r in remotes]
