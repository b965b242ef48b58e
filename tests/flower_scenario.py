"""Deployment scenarios for the slow Flower tests; run inside a private network namespace.

``python flower_scenario.py SCENARIO WORKDIR RESULT_JSON`` starts a SuperLink and SuperNodes on
127.0.0.1 with :class:`pflego.flower.deploy.LocalDeployment`, runs experiments, writes what
happened to RESULT_JSON and stops every process it started (also on errors and SIGTERM).

Scenarios:
    ``plain``: 3 nodes, no TLS; a PFLEGO and a FedAvg run of 2 rounds and a PFLEGO run with
        SecAgg+, side by side.
    ``secure``: the multi-host guide's commands on 127.0.0.1: TLS and SuperNode
        authentication, each of 3 nodes serving its own image folder (written from a
        partition), a server whose machine has no dataset (``PFLEGO_DATA`` is an empty folder and
        the config names ``mnist``, which it could not load), plus a fourth node whose key was
        never registered (it must be refused).
    ``kill``: 3 nodes, every client sampled each round; node 2 is killed after round 0.
    ``resume``: 3 nodes; the SuperLink and its ServerApp are killed after round 1 and
        restarted; the run continues from the server's checkpoint.
    ``guide``: the multi-host guide of ``docs/flower.md``, its commands run as they stand with
        ``SERVER=127.0.0.1``: three sites, each with its own key, image folder and home.
    ``sites``: 5 nodes, each serving an image folder written from ``$PFLEGO_SITES_DATASET``
        (default ``mnist5k``; ``mnist`` with ``$PFLEGO_SITES_DATA_DIR``), a server without data;
        the settings come from ``$PFLEGO_SITES_SETTINGS`` (JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from pflego.config import load_config, to_dict
from pflego.flower.certs import generate
from pflego.flower.deploy import LocalDeployment
from pflego.flower.records import encode_config
from pflego.flower.sitedata import export_partition

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
SITES = json.loads(os.environ.get("PFLEGO_SITES_SETTINGS", "{}"))
CONFIGS = {
    "pflego": BASE | {"algorithm": "pflego"},
    "fedavg": BASE | {"algorithm": "fedavg"},
    "secagg": BASE | {"algorithm": "pflego", "rounds": 1},  # SecAgg+: 4 message rounds each
    "guide": BASE | {"algorithm": "pflego", "eval_every": 2},
    "kill": BASE | {"algorithm": "pflego", "participation": 1.0, "rounds": 3, "eval_every": 1},
    "resume": BASE | {"algorithm": "pflego", "rounds": 3, "eval_every": 3},
    "sites": BASE
    | {
        "algorithm": "pflego",
        "clients": 5,
        "participation": 0.6,
        "dataset": os.environ.get("PFLEGO_SITES_DATASET", "mnist5k"),
        "data_dir": os.environ.get("PFLEGO_SITES_DATA_DIR"),
    }
    | SITES,
}
#: What the server of a site-data run is given: a dataset it cannot load (only its default model
#: is used) and no data folder.
SERVER_SIDE = {"dataset": "mnist", "data_dir": None}


def run_config(name: str, out: Path, round_timeout: float = 120.0, **settings) -> dict:
    return {
        "pflego-config": encode_config(load_config(CONFIGS[name] | settings)),
        "out": str(out),
        "round-timeout": round_timeout,
        "join-timeout": 120.0,
    }


def write_sites(name: str, root: Path) -> list[dict]:
    """Image folders written from the partition of ``CONFIGS[name]``, as node configs."""
    paths = export_partition(load_config(CONFIGS[name]), root, "imagefolder")
    return [{"data": str(p), "format": "imagefolder", "site": p.name} for p in paths]


def no_data_env(workdir: Path) -> dict[str, str]:
    """Every Flower process sees an empty data folder and its own cache."""
    (workdir / "no-data").mkdir(parents=True, exist_ok=True)
    return {"PFLEGO_DATA": str(workdir / "no-data"), "PFLEGO_CACHE": str(workdir / "cache")}


def read_json(path: Path, default):
    return json.loads(path.read_text()) if path.is_file() else default


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def side_by_side(
    deployment: LocalDeployment, workdir: Path, result: dict, runs: dict[str, dict]
) -> None:
    """Submit runs together (name -> extra run config) and wait for all of them."""
    ids = {name: deployment.submit(extra) for name, extra in runs.items()}
    for name, run_id in ids.items():
        status = deployment.wait(run_id, timeout=420)
        out = workdir / f"run-{name}"
        result[name] = {
            "status": status,
            "records": read_jsonl(out / "metrics.jsonl"),
            "events": read_jsonl(out / "flower.jsonl"),
            "files": sorted(p.name for p in out.iterdir()),
        }
        if status != "finished:completed":
            result[name]["log"] = deployment.run_log(run_id)[-4000:]


def plain(workdir: Path, result: dict) -> None:
    with LocalDeployment(workdir / "deploy", say=print) as deployment:
        deployment.start_nodes(3)
        secure = {"secure-aggregation": True, "secagg-clipping-range": 8.0}
        runs = {name: run_config(name, workdir / f"run-{name}") for name in ("pflego", "fedavg")}
        runs["secagg"] = run_config("secagg", workdir / "run-secagg") | secure
        side_by_side(deployment, workdir, result, runs)


def secure(workdir: Path, result: dict) -> None:
    creds = generate(workdir / "certs", nodes=4)
    sites = write_sites("pflego", workdir / "sites")
    env = no_data_env(workdir)
    with LocalDeployment(
        workdir / "deploy", creds, authenticate=True, say=print, extra_env=env
    ) as deployment:
        deployment.start_nodes(3, sites=sites)
        intruder = deployment.start_node(3, 2, 3, key=creds.node_key(3), max_wait=15)
        runs = {
            name: run_config(name, workdir / f"run-{name}", **SERVER_SIDE)
            for name in ("pflego", "fedavg")
        }
        side_by_side(deployment, workdir, result, runs)
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
        result["no_data"] = sorted(p.name for p in (workdir / "no-data").iterdir())


def kill(workdir: Path, result: dict) -> None:
    out = workdir / "run-kill"
    with LocalDeployment(workdir / "deploy", say=print) as deployment:
        deployment.start_nodes(3)
        run_id = deployment.submit(run_config("kill", out, round_timeout=30.0))
        wait_for_round(out, 0)
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


def wait_for_round(out: Path, t: int, timeout: float = 300) -> None:
    """Wait until ``flower.jsonl`` logs training round t."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(
            e.get("phase") == "train" and e["round"] >= t for e in read_jsonl(out / "flower.jsonl")
        ):
            return
        time.sleep(0.5)
    raise TimeoutError(f"round {t} was not logged in {timeout} s")


def resume(workdir: Path, result: dict) -> None:
    out = workdir / "run-resume"
    with LocalDeployment(workdir / "deploy", say=print) as deployment:
        deployment.start_nodes(3)
        first = deployment.submit(run_config("resume", out, round_timeout=60.0))
        wait_for_round(out, 0)
        deployment.restart_superlink()  # the SuperLink and its ServerApp die mid-run
        result["killed_after"] = read_jsonl(out / "flower.jsonl")
        second = deployment.submit(run_config("resume", out, round_timeout=60.0) | {"resume": True})
        status = deployment.wait(second, timeout=420)
        result["resume"] = {
            "status": status,
            "first": first,
            "records": read_jsonl(out / "metrics.jsonl"),
            "events": read_jsonl(out / "flower.jsonl"),
        }
        if status != "finished:completed":
            result["resume"]["log"] = deployment.run_log(second)[-4000:]


GUIDE = Path(__file__).resolve().parents[1] / "docs" / "flower.md"


def guide_blocks() -> dict[str, list[str]]:
    """The guide's shell blocks (``<!-- guide: NAME -->`` then a fenced block), by name."""
    blocks, name, inside = {}, None, False
    for line in GUIDE.read_text().splitlines():
        if line.startswith("<!-- guide: "):
            name = line[len("<!-- guide: ") :].split()[0]
        elif line.startswith("```bash") and name:
            blocks[name], inside = [], True
        elif line.startswith("```") and inside:
            name, inside = None, False
        elif inside:
            blocks[name].append(line)
    return blocks


class Shell:
    """Runs the guide's lines with ``sh`` (daemons in their own process groups, logged)."""

    def __init__(self, workdir: Path, base_env: dict[str, str]) -> None:
        self.workdir, self.base_env = workdir, base_env
        self.daemons: list[tuple[str, object]] = []

    def env(self, **values: object) -> dict[str, str]:
        return {**self.base_env, **{k: str(v) for k, v in values.items()}}

    def run(self, lines: list[str], **values: object) -> str:
        import subprocess

        out = []
        for line in lines:
            done = subprocess.run(
                ["sh", "-c", line], env=self.env(**values), cwd=self.workdir,
                capture_output=True, text=True, timeout=180,
            )  # fmt: skip
            if done.returncode:
                raise RuntimeError(f"{line!r} failed ({done.returncode}): {done.stderr[-2000:]}")
            out.append(done.stdout)
        return "".join(out)

    def start(self, name: str, lines: list[str], **values: object) -> None:
        import subprocess

        from pflego.flower.deploy import _die_with_parent

        (line,) = lines
        log = (self.workdir / f"{name}.log").open("ab")
        process = subprocess.Popen(
            ["sh", "-c", f"exec {line}"], env=self.env(**values), cwd=self.workdir,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        self.daemons.append((name, process))

    def stop(self) -> None:
        for _, process in self.daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def guide(workdir: Path, result: dict) -> None:
    from pflego.flower.deploy import flower_env, free_port, superlink_healthy

    blocks = guide_blocks()
    sites = write_sites("pflego", workdir / "data")
    server_home = workdir / "server"
    server_home.mkdir(parents=True)
    base = flower_env(server_home / ".flwr") | no_data_env(workdir)
    shell = Shell(workdir, base)
    server = {
        "HOME": server_home,
        "FLWR_HOME": server_home / ".flwr",
        "SERVER": "127.0.0.1",
        "PORT": free_port(),
        "CERTS": server_home / "certs",
        "OUT": workdir / "run-guide",
        "SITES": len(sites),
    }
    homes = []
    try:
        for k, site in enumerate(sites):
            home = workdir / f"site{k}"
            home.mkdir()
            homes.append({
                "HOME": home, "FLWR_HOME": home / ".flwr", "KEY": home / "key", "SITE": site["site"],
                "DATA": site["data"], "STATE": home / "state", "NODE_PORT": free_port(),
                "SERVER": "127.0.0.1", "PORT": server["PORT"], "CA": server["CERTS"] / "ca.crt",
            })  # fmt: skip
            shell.run(blocks["site-key"], **homes[-1])
        shell.run(blocks["server-certs"], **server)
        shell.start("superlink", blocks["superlink"], **server)
        deadline = time.monotonic() + 60
        while not superlink_healthy(server["PORT"], server["CERTS"] / "ca.crt"):
            if time.monotonic() > deadline:
                raise TimeoutError("the guide's SuperLink gave no health answer in 60 s")
            time.sleep(0.5)
        shell.run(blocks["operator"], **server)
        for home in homes:
            shell.run(blocks["register"], **server, KEY=home["KEY"])
        for k, home in enumerate(homes):
            shell.start(f"supernode{k}", blocks["supernode"], **home)
        shell.run(blocks["submit"], **server)
        deadline, status = time.monotonic() + 420, "unknown"
        while time.monotonic() < deadline:
            answer = shell.run(blocks["status"], **server)
            runs = json.loads(answer[answer.index("{") :]).get("runs", [])
            status = runs[0]["status"] if runs else "unknown"
            if status.startswith("finished"):
                break
            time.sleep(2)
        out = server["OUT"]
        result["guide"] = {
            "status": status,
            "records": read_jsonl(out / "metrics.jsonl"),
            "events": read_jsonl(out / "flower.jsonl"),
            "files": sorted(p.name for p in out.iterdir()) if out.is_dir() else [],
            "sites": read_json(out / "partition.json", []),
        }
        if status != "finished:completed":
            result["guide"]["log"] = (workdir / "superlink.log").read_text(errors="replace")[-4000:]
    finally:
        shell.stop()


def sites(workdir: Path, result: dict) -> None:
    nodes = write_sites("sites", workdir / "sites")
    with LocalDeployment(
        workdir / "deploy", say=print, extra_env=no_data_env(workdir)
    ) as deployment:
        deployment.start_nodes(len(nodes), sites=nodes)
        run = run_config("sites", workdir / "run-sites", round_timeout=600.0, **SERVER_SIDE)
        side_by_side(deployment, workdir, result, {"sites": run})


def main() -> int:
    scenario, workdir, result_path = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    result: dict = {
        "scenario": scenario,
        "configs": {k: to_dict(load_config(v)) for k, v in CONFIGS.items()},
    }
    start = time.monotonic()
    try:
        scenarios = {
            "plain": plain,
            "secure": secure,
            "kill": kill,
            "resume": resume,
            "guide": guide,
            "sites": sites,
        }
        scenarios[scenario](workdir, result)
    except BaseException:  # noqa: BLE001  (reported to the test)
        result["error"] = traceback.format_exc()
    result["seconds"] = round(time.monotonic() - start, 1)
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
