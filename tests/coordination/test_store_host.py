"""The store host (issue 24): where it runs, the report of last resort it writes from a real
store, the lost ranks' records and the verdict built from them, and the plain-env path whose
lost store ends in one JSON line and a record, not a traceback."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from ddp_smoke import config
from ddp_smoke.coordination import hosting, keys, lost, signing, stopped_run
from ddp_smoke.outputs import last_line, launch_report
from ddp_smoke.model import Report
from tests.launch import REPO, free_port


@pytest.mark.parametrize("args, want", [
    (["--standalone", "--nproc-per-node=2"], ("host", "127.0.0.1:0")),
    (["--nnodes=2", "--rdzv-endpoint=node-a:29500", "--local-addr=10.0.0.2"],
     ("join", "node-a:29501")),
    (["--nnodes=2", "--rdzv_endpoint", "node-a:29500", "--local-addr=10.0.0.1"],
     ("join", "node-a:29501")),
    (["--nnodes=2", "--rdzv-endpoint=10.0.0.1:29500", "--local-addr=10.0.0.1"],
     ("host", "10.0.0.1:29501")),
    (["--nnodes=2", "--rdzv-endpoint=x:29500", "--rdzv-conf=join_timeout=3,is_host=1"],
     ("host", "x:29501")),
    (["--nnodes=2", "--rdzv-endpoint=me:29500", "--rdzv-conf=is_host=0"], ("join", "me:29501")),
    (["--nnodes=2", "--rdzv-endpoint=me:29500"], ("host", "me:29501")),  # its hostname
    (["--nnodes=2", "--master-addr=m", "--master-port=1234", "--node-rank=0"],
     ("host", "m:1235")),
    (["--nnodes=2", "--master-addr=m", "--master-port=1234", "--node-rank=1"],
     ("join", "m:1235")),
])
def test_every_node_derives_the_same_store_address(args, want):
    assert hosting.plan(args, hostname="me", addresses={"10.0.0.9"}) == want


def test_a_plan_without_an_endpoint_is_refused():
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        hosting.plan(["--nnodes=2"], hostname="me", addresses=set())


def _store():
    """The store as the ranks and the store host see it: every record signed with the run's
    secret (coordination/signing.py)."""
    raw = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10),
                        wait_for_workers=False)
    return signing.SignedStore(dist.PrefixStore(hosting.PREFIX, raw), hosting.PREFIX,
                               bytes(range(32)), rank=-1)


def test_last_resort_names_the_ranks_that_went_silent_first(tmp_path):
    """Three ranks connected and arrived at ddp_step; rank 2's heartbeat stopped 3 s before
    the others'. The report (the worker's schema) names rank 2 on its host, written by the
    store host, with environment's posted result kept."""
    store = _store()
    cfg = {"checks": ["environment", "ddp_step"], "timeout": 20, "backend": "gloo"}
    hosting.post_meta(store, 3, cfg, str(tmp_path), "2026-01-01T00:00:00+00:00")
    hosting.post_meta(store, 3, {"checks": []}, "/elsewhere", "x")  # the first one stands
    for r in range(3):
        store.set(keys.of(keys.RANK, r), json.dumps({"rank": r, "local_rank": 0,
                                                    "host": f"node{r}"}))
        store.set(keys.of(keys.ARRIVE, keys.stage("environment", 0)) + f"/{r}", "1")
        store.set(keys.of(keys.ARRIVE, keys.stage("ddp_step", 0)) + f"/{r}", "1")
        store.set(keys.of(keys.BEAT, r), json.dumps({"n": 5, "t": 1.0, "stage": "ddp_step"}))
    store.set(keys.RUN_ID, "run-7")
    store.set(keys.of(keys.RESULT, keys.stage("environment", 0)),
              json.dumps({"name": "environment", "status": "pass", "summary": "ok"}))
    meta = hosting.read_meta(store)
    assert meta["report_dir"] == str(tmp_path)
    now = time.monotonic()
    report = stopped_run.last_resort(store, meta, {0: now, 1: now - 0.2, 2: now - 3.0},
                               "127.0.0.1:1", "test")
    got = report.to_dict()
    worker_fields = {f.name for f in dataclasses.fields(Report)}
    assert worker_fields <= set(got)
    assert got["verdict"] == "fail" and got["run_id"] == "run-7" and got["world_size"] == 3
    checks = {c["name"]: c for c in got["checks"]}
    assert checks["environment"]["status"] == "pass"
    step = checks["ddp_step"]
    assert [(c["rank"], c["host"]) for c in step["culprits"]] == [(2, "node2")]
    assert got["written_by"] == stopped_run.STORE_HOST
    assert step["figures"]["silent_first"] == [2]
    assert got["error"]["type"] == "AllRanksLost" and got["error"]["host"] == "node2"


def test_the_store_host_takes_the_runs_own_dead_after_silence_once_posted(tmp_path):
    """Before the ranks post the run's config the store host uses the package's silence;
    after, the run's ``diagnosis.dead_after_s`` (a run that set 4 s is not judged at 1.5)."""
    store = _store()
    watch = hosting.Watch(store)
    assert watch.silence.after_s == config.DIAGNOSIS["dead_after_s"] == 1.5
    cfg = config.resolve({"diagnosis": {"dead_after_s": 4}}, {})
    hosting.post_meta(store, 3, cfg, str(tmp_path), "2026-01-01T00:00:00+00:00")
    watch.look_beats()
    assert watch.silence.after_s == 4.0


def test_first_silent_takes_every_rank_of_a_job_killed_at_once():
    assert stopped_run.first_silent({0: 10.0, 1: 10.2, 2: 14.0}, 1.5) == [0, 1]
    assert stopped_run.first_silent({}, 1.5) == []


def test_lost_records_that_each_know_part_of_the_world_name_the_silent_node_once(tmp_path):
    """Ranks other than 0 know their own node's hosts and rank 0's node's: two survivors on
    two nodes name rank 0's whole node (ranks 0 and 1) as one culprit, and each other."""
    def known(ranks):
        return [f"n{r // 2}" if r in ranks else None for r in range(6)]
    for r, ranks in ((3, {0, 1, 2, 3}), (2, {0, 1, 2, 3}), (5, {0, 1, 4, 5}),
                     (4, {0, 1, 4, 5})):
        lost.write(str(tmp_path), r, {"ddp_smoke_rank": r, "run_id": "r1", "stage": "ddp_step",
                                      "store": "n0:29500", "world_size": 6,
                                      "hosts": known(ranks)[:max(ranks) + 1]})
    records = lost.read(str(tmp_path), "r1")
    assert lost.hosts(records) == {0: "n0", 1: "n0", 2: "n1", 3: "n1", 4: "n2", 5: "n2"}
    culprits, victims = launch_report.lost_culprits(records)
    assert [(c.rank, c.host) for c in culprits] == [(None, "n0")]
    assert culprits[0].reason.startswith("ranks 0, 1 went silent")
    assert victims[0].startswith("rank 2 n1: lost the store")
    assert "silent: rank 0 n0, rank 1 n0 (node n0)" in last_line.from_lost(records)


def test_lost_records_make_a_verdict_naming_the_silent_node(tmp_path):
    hosts = ["gpu-a", "gpu-b", "gpu-c"]
    for r in (1, 2):
        assert lost.write(str(tmp_path), r, {"ddp_smoke_rank": r, "run_id": "r1",
                                             "stage": "ddp_step", "store": "gpu-a:29501",
                                             "world_size": 3, "hosts": hosts})
    lost.write(str(tmp_path), 0, {"ddp_smoke_rank": 0, "run_id": "older"})  # not this run's
    line = last_line.from_folder(str(tmp_path), "r1")
    assert line.startswith("ddp-smoke FAIL · run r1 · 3 ranks"), line
    assert "silent: rank 0 gpu-a (node gpu-a)" in line and "during ddp_step" in line, line
    assert "lost the store: rank 1 gpu-b, rank 2 gpu-c" in line, line
    out = subprocess.run([sys.executable, "-m", "ddp_smoke", "last-line", "--dir", str(tmp_path),
                          "--run-id", "nobody"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("ddp-smoke: error: "), out.stderr
    # rank 0, starting: an earlier run's words go, an earlier run of this id's too (written
    # before rank 0's process started); this run's, left while rank 0 was starting, stay
    os.utime(os.path.join(tmp_path, "lost", "2.json"), (time.time() - 60,) * 2)
    lost.clear(str(tmp_path), "r1", time.time() - 30)
    assert lost.read(str(tmp_path)).keys() == {1}
    lost.clear(str(tmp_path), "r1", time.time() + 1)
    assert lost.read(str(tmp_path)) == {}


@pytest.mark.timeout(120)
def test_without_a_store_host_a_lost_store_is_one_line_and_a_record(tmp_path):
    """The plain env contract (submitit's): rank 0 hosts the store and crashes mid-check. The
    survivor prints one JSON line, leaves lost/1.json and exits 1: no traceback (the watchdog's
    or the main thread's look at the abort list raised DistNetworkError before)."""
    port = free_port()
    procs = []
    for r in (0, 1):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "DDP_SMOKE_RUN_ID": "plain-1"}
        env.pop("DDP_SMOKE_STORE", None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ddp_smoke", "--backend", "gloo", "--checks",
             "environment,ddp_step", "--fault", "0:crash@ddp_step", "--timeout", "20",
             "--report-dir", str(tmp_path)], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=100) for p in procs]
    err = outs[1][1]
    assert procs[1].returncode == 1, err
    assert "Traceback" not in err, err
    lines = [json.loads(x) for x in err.splitlines() if x.startswith('{"ddp_smoke_rank"')]
    assert len(lines) == 1 and lines[0]["ddp_smoke_rank"] == 1, err
    assert lost.read(str(tmp_path), "plain-1").keys() == {1}
    assert "silent: rank 0" in last_line.from_folder(str(tmp_path), "plain-1")


def test_the_store_host_raises_its_open_files_limit_or_says_so_first(tmp_path):
    """One store connection per rank: the store host raises its soft limit on open files to
    the hard one; when even that is too low for the world size it says so in one preflight
    line and exits 2 before it listens (issue 34), instead of ranks hanging at connect."""
    import resource

    def limits(soft, hard):
        return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    p = subprocess.run([sys.executable, "-m", "ddp_smoke.store_host", "--host", "127.0.0.1",
                        "--world-size", "5000"], preexec_fn=limits(256, 1024), cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert (p.returncode, p.stdout, p.stderr.count("\n")) == (2, "", 1), p.stderr
    assert p.stderr.startswith("ddp-smoke: error: store host: preflight: 5000 ranks need 5064 "
                               "file descriptors here") and "allows 1024" in p.stderr
    raised = subprocess.run(
        [sys.executable, "-c", "import resource; from ddp_smoke.coordination import hosting; "
         "print(hosting.raise_nofile(900), resource.getrlimit(resource.RLIMIT_NOFILE))"],
        preexec_fn=limits(256, 1024), capture_output=True, text=True, timeout=60, check=True)
    assert raised.stdout.split("\n")[0] == "None (1024, 1024)"


_BOTH_LOSE_IT = """
import sys, tempfile, threading, time, types
from ddp_smoke.coordination import ending
env = types.SimpleNamespace(rank=1, run_id="r", world_size=2, store_address="127.0.0.1:1",
                            store=None)
run = types.SimpleNamespace(env=env, stage="ddp_step", ranks=[], report_dir=sys.argv[1])
c = types.SimpleNamespace(run=run, env=env, progress=lambda: time.sleep(0.2) or {})
start = threading.Barrier(2)

def lose(why):
    start.wait()
    ending.give_up(c, RuntimeError(why))

for why in ("Broken pipe", "Connection reset by peer"):
    threading.Thread(target=lose, args=(why,)).start()
"""


def test_two_threads_that_lose_the_store_at_once_say_it_once(tmp_path):
    """CI: the watchdog and the main thread both found the store gone and each printed the
    rank's record (two JSON lines where one was promised). Now one says it and exits; the
    other waits for that. Before: 2 lines in 3 of 4 tries."""
    for attempt in range(3):
        p = subprocess.run([sys.executable, "-c", _BOTH_LOSE_IT, str(tmp_path / str(attempt))],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(REPO / "job")})
        said = [ln for ln in p.stderr.splitlines() if ln.startswith('{"ddp_smoke_rank"')]
        assert p.returncode == 1 and len(said) == 1, p.stderr
