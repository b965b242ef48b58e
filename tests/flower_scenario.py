"""Deployment scenarios for the slow Flower tests; run inside a private network namespace.

``python flower_scenario.py SCENARIO WORKDIR RESULT_JSON`` starts a SuperLink and SuperNodes on
127.0.0.1 with :class:`pflego.flower.deploy.LocalDeployment`, runs experiments, writes what
happened to RESULT_JSON and stops every process it started (also on errors and SIGTERM).

Scenarios:
    ``plain``: 3 nodes, no TLS; a PFLEGO and a FedAvg run of 2 rounds, side by side.
    ``secure``: the same with TLS and SuperNode authentication, plus a fourth node whose key
        was never registered (it must be refused).
    ``kill``: 3 nodes, every client sampled each round; node 2 is killed after round 0.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import traceback
from pathlib import Path

from pflego.config import load_config, to_dict
from pflego.flower.certs import generate
from pflego.flower.deploy import LocalDeployment
from pflego.flower.records import encode_config

BASE = dict(
    clients=3,
    classes_per_client=4,
    participation=0.67,
    rounds=2,
    inner_steps=2,
    eval_every=2,
    average_last=0,
    seed=5,
)
CONFIGS = {
    "pflego": BASE | {"algorithm": "pflego"},
    "fedavg": BASE | {"algorithm": "fedavg"},
    "kill": BASE | {"algorithm": "pflego", "participation": 1.0, "rounds": 3, "eval_every": 1},
}


def run_config(name: str, out: Path, round_timeout: float = 120.0) -> dict:
    return {
        "pflego-config": encode_config(load_config(CONFIGS[name])),
        "out": str(out),
        "round-timeout": round_timeout,
        "join-timeout": 120.0,
    }


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def side_by_side(deployment: LocalDeployment, workdir: Path, result: dict) -> None:
    """Submit the PFLEGO and FedAvg runs together and wait for both."""
    runs = {}
    for name in ("pflego", "fedavg"):
        runs[name] = deployment.submit(run_config(name, workdir / f"run-{name}"))
    for name, run_id in runs.items():
        status = deployment.wait(run_id, timeout=400)
        result[name] = {
            "status": status,
            "records": read_jsonl(workdir / f"run-{name}" / "metrics.jsonl"),
            "events": read_jsonl(workdir / f"run-{name}" / "flower.jsonl"),
            "files": sorted(p.name for p in (workdir / f"run-{name}").iterdir()),
        }
        if status != "finished:completed":
            result[name]["log"] = deployment.run_log(run_id)[-4000:]


def plain(workdir: Path, result: dict) -> None:
    with LocalDeployment(workdir / "deploy", say=print) as deployment:
        deployment.start_nodes(3)
        side_by_side(deployment, workdir, result)


def secure(workdir: Path, result: dict) -> None:
    creds = generate(workdir / "certs", nodes=4)
    with LocalDeployment(workdir / "deploy", creds, authenticate=True, say=print) as deployment:
        deployment.start_nodes(3)
        intruder = deployment.start_node(3, 2, 3, key=creds.node_key(3), max_wait=15)
        side_by_side(deployment, workdir, result)
        try:
            code = intruder.process.wait(timeout=60)
        except Exception:  # noqa: BLE001
            code = None
        time.sleep(1)  # let the log file catch up with the exit
        superlink = deployment.daemons[0].log.read_text(errors="replace")
        result["intruder"] = {
            "exit_code": code,
            "log": [
                x
                for x in intruder.log.read_text(errors="replace").splitlines()
                if "retrying" not in x
            ],
            "superlink_refusals": superlink.count("No SuperNode found with the given public key"),
        }


def kill(workdir: Path, result: dict) -> None:
    out = workdir / "run-kill"
    with LocalDeployment(workdir / "deploy", say=print) as deployment:
        deployment.start_nodes(3)
        run_id = deployment.submit(run_config("kill", out, round_timeout=30.0))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if any(e.get("phase") == "train" for e in read_jsonl(out / "flower.jsonl")):
                break
            time.sleep(1)
        deployment.kill_node(2)
        result["killed_after"] = [e for e in read_jsonl(out / "flower.jsonl")]
        status = deployment.wait(run_id, timeout=400)
        result["kill"] = {
            "status": status,
            "records": read_jsonl(out / "metrics.jsonl"),
            "events": read_jsonl(out / "flower.jsonl"),
        }
        if status != "finished:completed":
            result["kill"]["log"] = deployment.run_log(run_id)[-4000:]


def main() -> int:
    scenario, workdir, result_path = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    result: dict = {
        "scenario": scenario,
        "configs": {k: to_dict(load_config(v)) for k, v in CONFIGS.items()},
    }
    start = time.monotonic()
    try:
        {"plain": plain, "secure": secure, "kill": kill}[scenario](workdir, result)
    except BaseException:  # noqa: BLE001  (reported to the test)
        result["error"] = traceback.format_exc()
    result["seconds"] = round(time.monotonic() - start, 1)
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
