"""What preflight costs a healthy run: seconds added before torchrun, against the run itself.

A healthy two-"node" preflight as the sbatch runs it, on loopback: the rendezvous host
(``--serve --nodes 2``) and a second node start together, each imports torch in its probe,
says hello, and writes its record; the wall time until both have exited is what the job waits
before torchrun. Timed alongside, in a rotating order: the worker's two tutorial checks on 2
ranks (``torchrun --standalone … --checks environment,ddp_step``), the run preflight sits in
front of. Prints medians, their ratio and each phase of one preflight (from the records). No
assert: on a shared machine the figures move with the load, printed before and after.

    .venv/bin/python bench/preflight_cost.py [ROUNDS]     # from the repo root, after make venv
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

PY = ".venv/bin/python"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preflight(root: str, i: int) -> float:
    """Wall seconds of a 2-node preflight (host + node), both passing."""
    out, port = os.path.join(root, f"pf{i}"), _port()
    common = [PY, "-m", "ddp_smoke", "preflight", "--report-dir", out, "--rdzv",
              f"127.0.0.1:{port}", "--timeout", "60", "--run-id", f"bench{i}"]
    t0 = time.monotonic()
    procs = [subprocess.Popen(common + ["--serve", "--nodes", "2", "--node", "n0"],
                              env={**os.environ, "SLURM_NODEID": "0"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
             subprocess.Popen(common + ["--node", "n1"], env={**os.environ, "SLURM_NODEID": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    wall = time.monotonic() - t0
    if any(p.returncode for p in procs):
        raise SystemExit(f"preflight failed: {outs}")
    return wall


def worker(root: str, i: int) -> float:
    t0 = time.monotonic()
    subprocess.run([".venv/bin/torchrun", "--standalone", "--nproc-per-node=2", "-m",
                    "ddp_smoke", "--checks", "environment,ddp_step", "--report-dir",
                    os.path.join(root, f"w{i}")], capture_output=True, check=True, timeout=300,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.monotonic() - t0


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    print(f"# preflight cost, {rounds} rounds; load {os.getloadavg()[0]:.2f}")
    times: dict[str, list[float]] = {"preflight": [], "worker": []}
    with tempfile.TemporaryDirectory(prefix="ddp-smoke-bench-pf-") as root:
        for i in range(rounds):
            order = ("preflight", "worker") if i % 2 == 0 else ("worker", "preflight")
            for name in order:
                times[name].append((preflight if name == "preflight" else worker)(root, i))
        with open(os.path.join(root, "pf0", "preflight", "n1.json")) as f:
            record = json.load(f)
    pf, wk = (statistics.median(times[k]) for k in ("preflight", "worker"))
    print(f"preflight, 2 nodes on loopback      median {pf:6.2f} s  "
          f"({' '.join(f'{t:.2f}' for t in times['preflight'])})")
    print(f"worker, 2 ranks environment,ddp_step median {wk:6.2f} s  "
          f"({' '.join(f'{t:.2f}' for t in times['worker'])})")
    print(f"preflight / worker run: {pf / wk:.2f}  (a job pays preflight + the run)")
    print("# one node's preflight: " + "; ".join(c["detail"] for c in record["checks"]
                                                 if c["name"] in ("rendezvous", "torch")))
    print(f"# load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
