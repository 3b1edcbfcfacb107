"""Node speakers under a real torchrun: the speaker struck, the exact culprit named.

Four ranks on one node with ``--node-speaker on`` (coordination/node.py): ranks 1-3 beat,
arrive and post their observations through the lowest of them that runs, rank 1 to begin
with. Rank 1 holds back before compute, so rank 2 relays the node's arrivals there (rank 1
never arrived: it is not posted with them). The speaker is then frozen (SIGSTOP) or killed
(SIGKILL): rank 2 takes over the beats at its next look, and rank 0's watchdog names exactly
rank 1 from its counter, as it would name a rank that beats for itself; its node mates are
victims, not a lost node.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.launch import Heartbeats, Spawned
from tests.worker.test_diagnosis import _culprits, _finish_failed, _in_compute, _victims


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
def test_the_speaker_struck_is_named_alone(tmp_path, sig):
    # rank 1 holds back before compute (the others wait at its arrival, rank 0 watching
    # their heartbeats), then it is struck
    run = Spawned(4, "--checks", "environment,compute", "--timeout", "60", "--node-speaker", "on",
                  "--fault", "1:hang@compute", report_dir=tmp_path / "report",
                  env={"OMP_NUM_THREADS": "1"})
    run.wait_until(_in_compute)
    assert sorted(Heartbeats("127.0.0.1", run.port, 4).node_beats()) == [1, 2, 3]
    pid = run.worker_pid(1)
    os.kill(pid, sig)
    struck_at = time.time()
    if sig == signal.SIGSTOP:  # the report comes while it is frozen; then it may leave
        report = run.report_dir / "report.json"
        for _ in range(300):
            if report.exists():
                break
            time.sleep(0.1)
        assert report.exists(), "no report 30 s after the freeze"
        os.kill(pid, signal.SIGCONT)
    done = _finish_failed(run, struck_at, f"the speaker {signal.Signals(sig).name}")
    culprits = _culprits(done.report, "compute")
    assert [c["rank"] for c in culprits] == [1], culprits
    assert _victims(done.report, "compute") == [0, 2, 3]
