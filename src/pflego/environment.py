"""The reproducibility record of a run (``environment.json``) and the checkpoint format.

Every run directory records what produced it: pflego's version and, when pflego runs from a git
checkout, the commit (and whether the work tree had uncommitted changes); the Python, torch and
numpy versions (and flwr's, when installed); the device and the thread counts; and the SHA-256 of
every source file the dataset was read from (a generated dataset has none).

A checkpoint carries ``CHECKPOINT_FORMAT``. The number changes whenever a checkpoint of the old
format can no longer be resumed to the numbers an uninterrupted run gives (its contents, or the
meaning of the states it holds: issue 13 took personal heads' label sets from the training split
only, which changes their width, and redrew minibatch PFLEGO's joint batch); ``pflego run
--resume`` refuses any other format with one line.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from pflego._version import __version__

#: The format of ``checkpoint.pt`` this code writes and reads (checkpoints without one are 1).
CHECKPOINT_FORMAT = 2

#: Digests already taken in this process: (path, size, mtime, algorithm) -> hex digest.
_DIGESTS: dict[tuple[str, int, int, str], str] = {}


def pflego_version() -> str:
    return __version__


def git_checkout() -> dict[str, Any] | None:
    """The commit of the checkout pflego runs from (and whether it has uncommitted changes)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists() or not (root / "pyproject.toml").is_file():
        return None
    try:
        git = lambda *args: subprocess.run(  # noqa: E731
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        }
    except (OSError, subprocess.SubprocessError):
        return None


def digest(path: Path, algorithm: str = "sha256") -> str:
    """The hex ``algorithm`` digest of a file (``hashlib``'s names), remembered for this process
    while the file's size and time stay."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, algorithm)
    if key not in _DIGESTS:
        hasher = hashlib.new(algorithm)
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                hasher.update(chunk)
        _DIGESTS[key] = hasher.hexdigest()
    return _DIGESTS[key]


def source_files(sources: Iterable[Path]) -> list[Path]:
    """The files of ``sources``, resolved and sorted: each file, and every file inside a folder."""
    files = []
    for source in sorted({Path(s).resolve() for s in sources}):
        inside = source.rglob("*") if source.is_dir() else [source]
        files += sorted(p for p in inside if p.is_file())
    return files


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(device: str) -> str:
    """A description of the run's device (the GPU's name, or the CPU's)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str, data_files: Iterable[Path]) -> dict[str, Any]:
    """What ``environment.json`` records for a run on ``device`` reading ``data_files``."""
    return {
        "pflego": pflego_version(),
        "git": git_checkout(),
        "checkpoint_format": CHECKPOINT_FORMAT,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "flwr": _version("flwr"),
        "platform": platform.platform(),
        "device": device,
        "device_name": device_name(device),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "data_files": {str(f): f"sha256:{digest(f)}" for f in source_files(data_files)},
    }
