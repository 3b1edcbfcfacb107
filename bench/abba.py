"""Bandwidth-check runs on network-namespace nodes, settings alternated ABBA (drift on a shared
machine hits every setting alike): what the benches that compare settings share."""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' sandbox

from tests.multinode import Nodes, torchrun_argv  # noqa: E402
from tests.sandbox.hosts import HostSandbox, missing_requirements  # noqa: E402


def ready(what: str, rounds: int) -> bool:
    """Whether this machine can make the sandbox (else says why on stderr); prints the
    bench's header line: what runs, the load, the rounds."""
    reason = missing_requirements()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return False
    print(f"# {what}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
          f"{rounds} rounds, ABBA")
    return True


def bandwidth_check(box: HostSandbox, folder: Path, config: str, port: int,
                    per_node: int) -> dict:
    """One passing run of ``--checks bandwidth`` at the quick level on every node of ``box``
    with ``config``; returns the bandwidth check of rank 0's report."""
    (folder / "cfg.yaml").write_text(config)
    worker = ["--backend", "gloo", "--checks", "bandwidth", "--level", "quick", "--timeout",
              "60", "--config", str(folder / "cfg.yaml"), "--report-dir", str(folder / "r")]
    nodes, first = Nodes(box, folder), box.hosts[0]
    for host in box.hosts:
        nodes.start(host, torchrun_argv(host, len(box.hosts), per_node,
                                        f"{first.name}:{port}", f"{box.prefix}-{port}",
                                        "join_timeout=60,read_timeout=60", worker))
    nodes.wait(180)
    report = json.loads((folder / "r" / "report.json").read_text())
    check = next(c for c in report["checks"] if c["name"] == "bandwidth")
    assert report["verdict"] == "pass", check["culprits"]
    return check


def alternate(box: HostSandbox, kinds: dict[str, str], rounds: int, per_node: int,
              port: int = 29800) -> dict[str, list[dict]]:
    """``rounds`` runs of every config in ``kinds`` (name -> config), ABBA; per kind the
    bandwidth checks of its runs."""
    got: dict[str, list[dict]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for kind in (list(kinds) if i % 2 == 0 else list(kinds)[::-1]):
                port += 1
                folder = Path(tmp) / f"{i}-{kind.replace(' ', '-')}"
                folder.mkdir()
                got[kind].append(bandwidth_check(box, folder, kinds[kind], port, per_node))
    return got


def medians(got: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per kind, the medians of the checks' ``pairs_s`` and ``check_s`` (duration)."""
    return {k: {"pairs_s": statistics.median(c["figures"]["pairs_s"] for c in v),
                "check_s": statistics.median(c["duration_s"] for c in v)}
            for k, v in got.items()}
