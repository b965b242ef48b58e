"""Progress: a redrawn bar on a terminal, one plain line per evaluation anywhere else."""

from __future__ import annotations

import io

from conftest import TINY

from pflego.history import History
from pflego.sim import run
from pflego.sim.engine import RoundProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


RECORD = {"train_loss": 0.5, "test_acc": 0.75}


def test_a_log_file_gets_one_line_per_evaluation_and_no_bar_frames(tmp_path, capsys):
    run({**TINY, "rounds": 4, "eval_every": 2}, out=tmp_path / "run", progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == [
        f"pflego on tiny: round {t}/4 train_loss {loss} test_acc {acc}"
        for t, loss, acc in _logged(tmp_path / "run", (2, 4))
    ]


def _logged(run_dir, rounds):
    for record in History.load(run_dir).records:
        if record["round"] in rounds:
            yield record["round"], f"{record['train_loss']:.4f}", f"{100 * record['test_acc']:.2f}%"


def test_a_terminal_gets_a_bar_redrawn_in_place():
    stream = Terminal()
    bar = RoundProgress("fedavg on tiny", 0, 2, True, stream)
    bar.advance()
    bar.evaluated(1, RECORD)
    bar.advance()
    bar.close()
    shown = stream.getvalue()
    assert "\r" in shown and "2/2" in shown and "test_acc=75.00%" in shown
    assert "round 1/2" not in shown


def test_quiet_shows_nothing_anywhere():
    for stream in (Terminal(), io.StringIO()):
        bar = RoundProgress("fedavg on tiny", 0, 1, False, stream)
        bar.evaluated(1, RECORD)
        bar.advance()
        bar.close()
        assert stream.getvalue() == ""
