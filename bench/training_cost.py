"""The training check's cost on CPU ranks, and what the run's verdict waits for it.

For 2 and 4 ranks on this machine: ROUNDS launches of ``make smoke-local``'s launcher at the
standard level with the checks ``environment,training`` and as many with ``environment`` only
(the baseline, alternated, same invocation); printed: the training check's own time (its
slowest rank, the report's ``duration_s``), the launch's wall time against the baseline's, the
job's tokens/s and each rank's step (median) against its compute-only time. The budget is 15 s
for the check (issue 46); printed, never asserted (a loaded 2-core machine). The quick level's
time to verdict (no training there) is ``bench/smoke_vs_tutorial.py``'s.

    python bench/training_cost.py [ROUNDS]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = str(REPO / ".venv" / "bin" / "python")
BUDGET_S = 15.0


def launch(nproc: int, checks: str) -> tuple[float, dict | None]:
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        subprocess.run([PY, "-m", "ddp_smoke.launch_local", f"--nproc-per-node={nproc}", "--",
                        "--backend", "gloo", "--level", "standard", "--checks", checks,
                        "--report-dir", tmp], capture_output=True, check=False,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
        wall = time.perf_counter() - t
        report = json.loads((Path(tmp) / "report.json").read_text())
    return wall, next((c for c in report["checks"] if c["name"] == "training"), None)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    print(f"# training check, standard level, CPU ranks (gloo), {rounds} round(s) each; "
          f"budget {BUDGET_S:g} s; load average {os.getloadavg()[0]:.1f}")
    print(f"# {'ranks':>5} {'check s':>8} {'wall s':>7} {'baseline':>9} {'tokens/s':>9} "
          f"{'step ms':>8} {'compute ms':>11} {'status':>7}")
    for nproc in (2, 4):
        got, base = [], []
        for _ in range(rounds):
            base.append(launch(nproc, "environment")[0])
            got.append(launch(nproc, "environment,training"))
        checks = [c for _, c in got]
        ranks = [k for c in checks for k in c["figures"].get("ranks", [])]
        print(f"  {nproc:>5} {statistics.median(c['duration_s'] for c in checks):>8.2f} "
              f"{statistics.median(w for w, _ in got):>7.2f} {statistics.median(base):>9.2f} "
              f"{statistics.median(c['figures']['tokens_per_s'] for c in checks):>9,.0f} "
              f"{statistics.median(k['step_s_median'] for k in ranks) * 1e3:>8.1f} "
              f"{statistics.median(k['compute_s_median'] for k in ranks) * 1e3:>11.1f} "
              f"{'/'.join(sorted({c['status'] for c in checks})):>7}")


if __name__ == "__main__":
    main()
