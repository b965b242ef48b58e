"""What pflego's Flower adapter cannot run: the one check a Flower run's config passes first.

Flower runs client-server rounds only: an algorithm that mixes client states peer to peer or
needs public data on the server, calibrates on every training client's statistics before
evaluating (CCVR), a simulator-only setting (``unseen_fraction``, ``eval_train_samples``), or,
under SecAgg+, an algorithm whose server step is not a weighted sum or central differential
privacy (which clips every upload on the server) is refused with one line that says what to do
instead.
"""

from __future__ import annotations

from pflego.algorithms import ALGORITHMS, Algorithm
from pflego.config import Config
from pflego.errors import ConfigError


def refuse_unsupported(config: Config, secure: bool = False) -> None:
    """Fail with one line for a run that Flower's client-server rounds cannot do."""
    cls = ALGORITHMS.get(config.algorithm)
    if cls is None:
        raise ConfigError(
            f"unknown algorithm {config.algorithm!r}; choose one of {', '.join(sorted(ALGORITHMS))}"
        )
    if cls.mix is not Algorithm.mix:
        raise ConfigError(
            f"{config.algorithm} mixes client states peer to peer, which the Flower "
            "adapter cannot do; run it with `pflego run`"
        )
    if cls.public_size:
        raise ConfigError(
            f"{config.algorithm} needs public data that the run's server holds, which a Flower "
            "server (it holds no data) has not; run it with `pflego run`"
        )
    if cls.calibrate is not Algorithm.calibrate:
        raise ConfigError(
            f"{config.algorithm} calibrates on every training client's feature statistics "
            "before each evaluation, which the Flower adapter does not gather; run it with "
            "`pflego run`"
        )
    if secure:
        if not cls.sum_aggregate or cls.server_round is not Algorithm.server_round:
            raise ConfigError(
                f"--secure-aggregation sums the uploads, but {config.algorithm}'s aggregate is "
                "not a weighted sum of them; run it without --secure-aggregation"
            )
        if config.dp_clip is not None and not config.dp_local:
            raise ConfigError(
                "central differential privacy clips every upload on the server, which secure "
                "aggregation hides from it; set dp_local (each node clips and noises its own) "
                "or drop --secure-aggregation"
            )
    if config.unseen_fraction:
        raise ConfigError("unseen_fraction is a simulator setting; run it with `pflego run`")
    if config.eval_train_samples is not None:
        raise ConfigError(
            "eval_train_samples is a simulator setting (each node evaluates its whole training "
            "split); drop it, or run with `pflego run`"
        )
