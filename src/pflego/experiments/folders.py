"""One rule for every output folder: a command never writes into a folder that holds something
else pflego wrote.

A folder's kind is read from the files each kind writes, so folders of earlier versions are
recognized too: a run (``metrics.jsonl`` or ``checkpoint.pt``), an experiment of several runs
(``experiment.json``: a comparison, a reproduction, runs over seeds), a tuning (``tune.md``,
``chosen.yaml`` or its ``grid/``) or a report (``report.md`` and its siblings). :func:`check_out`
refuses a folder of another kind, and one of the same kind unless the command continues it
(``--resume``, or rerunning ``reproduce`` and ``tune``), unless ``--overwrite`` is given;
:func:`clear_out` then removes what pflego wrote there (nothing else), once every check passed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from datetime import datetime
from pathlib import Path

from pflego.errors import ConfigError
from pflego.experiments.measures import COSTS_FILE
from pflego.experiments.runs import DIVERGED
from pflego.history import EXPERIMENT_MANIFEST, RUN_FILES, RUN_OUTPUTS

#: The kind of an experiment folder by its manifest's ``kind``.
MANIFEST_KINDS = {
    "compare": "comparison",
    "reproduce": "reproduction",
    "seeds": "run over seeds",
    "tune": "tuning",
}
#: Files a tuning writes at its top (beside ``grid/`` and ``final/``).
TUNING_FILES = ("tune.md", "chosen.yaml")
#: Files a report writes (``report.*``, or ``comparison.*`` for a comparison).
REPORT_FILES = tuple(
    f"{stem}.{ext}" for stem in ("report", "comparison") for ext in ("md", "csv", "png", "tex")
) + ("sweep.png",)
#: How to continue each kind, for the error message.
CONTINUE = {
    "run": "`pflego run --resume {out}` continues it",
    "comparison": "`pflego compare --resume {out}` finishes it",
    "reproduction": "rerunning its `pflego reproduce` command finishes it",
    "tuning": "rerunning its `pflego tune` command finishes it",
}


def manifest(folder: Path) -> dict:
    """``folder``'s experiment manifest as read, or ``{}`` (none, or not a JSON object)."""
    try:
        values = json.loads((folder / EXPERIMENT_MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def stamp() -> str:
    """The date and time that name a new default output folder (``20250131-154500``)."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def kind_of(folder: Path) -> str | None:
    """What pflego wrote in ``folder``: ``run``, ``comparison``, ``reproduction``, ``run over
    seeds``, ``tuning``, ``report``, or ``None`` (nothing of pflego's, or no folder)."""
    if any((folder / name).exists() for name in RUN_FILES):
        return "run"
    if (folder / EXPERIMENT_MANIFEST).is_file():
        return MANIFEST_KINDS.get(manifest(folder).get("kind"), "experiment")
    if any((folder / n).exists() for n in TUNING_FILES) or (folder / "grid").is_dir():
        return "tuning"
    if any((folder / n).exists() for n in REPORT_FILES):
        return "report"
    return None


def check_out(
    out: Path,
    kind: str,
    overwrite: bool = False,
    continues: bool = False,
    name: str | None = None,
) -> str | None:
    """Refuse ``--out`` when it holds something pflego wrote, unless it may be written there.

    Args:
        out: The output folder.
        kind: What the command writes (see :func:`kind_of`).
        overwrite: ``--overwrite``: whatever is there is replaced (:func:`clear_out`).
        continues: The command finishes a folder of its own ``kind`` (reproduce and tune rerun).
        name: With ``continues``: the experiment's name, which the folder's manifest must carry.

    Returns:
        The kind found in ``out`` (``None``: nothing of pflego's).

    Raises:
        ConfigError: One line naming what ``out`` holds and how to go on.
    """
    found = kind_of(out)
    if found is None or overwrite:
        return found
    if continues and found == kind:
        held = manifest(out).get("name")
        if name is None or held in (None, name) or held.startswith(f"{name}, "):
            return found  # a preset run with changes is named "<preset>, <changes>"
        raise ConfigError(
            f"{out} already holds a {found} of {held}, not of {name}; choose another --out, "
            "or pass --overwrite to replace it"
        )
    how = CONTINUE.get(found, "")
    how = f" ({how.format(out=out)})" if how and found == kind else ""
    raise ConfigError(
        f"{out} already holds a {found}{how}; choose another --out, or pass --overwrite to "
        f"replace it with this {kind}"
    )


def clear_out(out: Path) -> None:
    """Remove what pflego wrote in ``out`` (``--overwrite``); other files stay.

    A run's files, an experiment's manifest, the run directories it lists and its ``tune/``,
    a tuning's files with ``grid/`` and ``final/``, and the report files.
    """
    found = kind_of(out)
    if found is None:
        return
    names = {*RUN_OUTPUTS, DIVERGED, COSTS_FILE, *TUNING_FILES, *REPORT_FILES}
    names |= {EXPERIMENT_MANIFEST, "tune", "grid", "final"}
    with contextlib.suppress(KeyError, TypeError):  # a damaged manifest names no run
        names |= {str(r["dir"]).split("/")[0] for r in manifest(out).get("runs", [])}
    for name in names:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
