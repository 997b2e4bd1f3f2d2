"""One study across the nodes of a Ray cluster, a worker lost mid-trial (issue 45).

Starts a Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``, every
server on 127.0.0.1: a head that declares no CPUs and no GPUs, and ``--workers`` worker nodes of
one CPU each), runs ``vllm-autotune tune JOB --ray-address ADDRESS`` against it (real vLLM
servers of the CPU build in the trials' actors), and, once trial ``--lose-trial``'s server is up
and ``--after-s`` seconds into its replay, takes its node away: ``node`` removes the node whole
(every process of it, as a machine lost), ``raylet`` kills only its raylet (the machine lives).
Then it prints, per trial and attempt, where it ran (``placement.json``), when it started (its
folder first seen, polled every 0.5 s), how it ended, and what the loss cost (from the lost
attempt's start to its re-run's), and writes it all to ``OUT/cluster_study.json`` beside the
study and ``tune.log``.

Usage:
    python -m benchmarks.cluster_study [examples/cpu-demo.yaml] [--trials 4] [--lose-trial 2]
        [--how node|raylet] [--after-s 10] [--workers 2] [--out runs/cluster-study]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"
_NODE = {
    "node_ip_address": LOOPBACK,
    "object_store_memory": 80 * 1024**2,
    "include_log_monitor": False,
}


def _cluster(workers: int) -> tuple[Any, list[Any]]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **_NODE,
            "include_dashboard": False,
            "num_cpus": 0,
            "num_gpus": 0,
            "_system_config": {"enable_metrics_collection": False},
        },
    )
    nodes = [cluster.add_node(**_NODE, num_cpus=1, num_gpus=0) for _ in range(workers)]
    cluster.wait_for_nodes()
    return cluster, nodes


def _attempts(out: Path, number: int) -> list[Path]:
    return sorted((out / "trials" / f"{number:04d}").glob("attempt-*"))


def _placement(attempt: Path) -> dict[str, Any]:
    path = attempt / "placement.json"
    doc: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", nargs="?", default=str(REPO / "examples" / "cpu-demo.yaml"))
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--lose-trial", type=int, default=2)
    ap.add_argument("--how", choices=["node", "raylet"], default="node")
    ap.add_argument("--after-s", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "runs" / "cluster-study"))
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    args = ap.parse_args()

    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    # A Ray of this script's own, on loopback only (as the tuner's start_ray does locally).
    os.environ["RAY_TMPDIR"] = str(ray_tmp)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False

    cluster, workers = _cluster(args.workers)
    names = {w.node_id: f"worker {i + 1}" for i, w in enumerate(workers)}
    names[cluster.head_node.node_id] = "head"
    lost: dict[str, Any] = {}
    seen: dict[str, float] = {}  # each attempt's folder: when it first appeared
    started = time.time()
    try:
        cmd = [
            sys.executable, "-m", "optimizer.cli", "tune", args.job,
            "--ray-address", cluster.address, "--no-mlflow", "--out", str(out),
            "--trials", str(args.trials),
        ]  # fmt: skip
        print(f"cluster {cluster.address}: head + {args.workers} workers; {' '.join(cmd[1:])}")
        with (out / "tune.log").open("w") as log:
            tune = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            while tune.poll() is None and time.time() - started < args.timeout_s:
                for attempt in (out / "trials").glob("*/attempt-*"):
                    seen.setdefault(str(attempt.relative_to(out)), time.time())
                first = _attempts(out, args.lose_trial)[:1]
                where = _placement(first[0]) if first else {}
                if not lost and where.get("node_id") in names:
                    time.sleep(args.after_s)
                    victim = next(w for w in workers if w.node_id == where["node_id"])
                    if args.how == "node":
                        cluster.remove_node(victim, allow_graceful=False)
                    else:
                        victim.kill_raylet()
                    lost = {
                        "trial": args.lose_trial,
                        "node": names[victim.node_id],
                        "node_id": victim.node_id,
                        "how": args.how,
                        "at": time.time(),
                    }
                    print(f"{args.how} of {lost['node']} taken away during trial {args.lose_trial}")
                time.sleep(0.5)
            if tune.poll() is None:
                tune.kill()
            tune.wait()
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)

    import optuna

    storage = f"sqlite:///{out / 'study.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    rows = []
    for t in study.get_trials():
        attempts = _attempts(out, t.number)
        for attempt in attempts:
            where = _placement(attempt)
            # every attempt but a trial's last ended with its node (the study ran it once more)
            ended = "lost (node)" if attempt != attempts[-1] else t.user_attrs.get("status")
            rows.append(
                {
                    "trial": t.number,
                    "attempt": attempt.name,
                    "node": names.get(where.get("node_id", ""), "?"),
                    "started_s": round(seen.get(str(attempt.relative_to(out)), 0) - started, 1),
                    "status": ended,
                    "state": t.state.name,
                    "nodes_lost": t.user_attrs.get("nodes_lost"),
                }
            )
    runs = _attempts(out, args.lose_trial)
    cost = None
    if lost and len(runs) > 1:
        keys = [str(r.relative_to(out)) for r in runs[:2]]
        if all(k in seen for k in keys):
            cost = round(seen[keys[1]] - seen[keys[0]], 1)
    doc = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(sys.argv),
        "tune_exit": tune.returncode,
        "lost": lost,
        "loss_cost_s": cost,
        "wall_s": round(time.time() - started, 1),
        "rows": rows,
    }
    (out / "cluster_study.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'trial':>5} {'attempt':>9} {'node':>9} {'status':>11} {'state':>8}  nodes lost")
    for r in rows:
        print(
            f"{r['trial']:>5} {r['attempt']:>9} {r['node']:>9} {r['status'] or '-':>11} "
            f"{r['state']:>8}  {r['nodes_lost'] or '-'}"
        )
    print(f"tune exit {tune.returncode}; the loss cost {cost} s; wall {doc['wall_s']} s")


if __name__ == "__main__":
    main()
