"""The correctness checks: sampler_epochs, collectives, storage.

Two halves. Pure unit tests feed each ``judge`` hand-made observations (healthy, and each kind
of fault) and assert on status and the culprits named. Then real runs: ``torchrun
--standalone`` with 2 and 4 gloo ranks on CPU, asserting on report.json — every check passes
on a healthy run; an injected ``corrupt`` fault fails the check and names the injected rank;
the missing-set_epoch demonstration is detected. Three torchrun runs, ~10–25 s each here
(most of it is each process importing torch).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from ddp_smoke.checks import collectives, sampler_epochs, storage
from ddp_smoke.checks.api import Evidence
from ddp_smoke.config import rules
from ddp_smoke.model import FAIL, PASS, SKIP
from tests import launch

RUN_TIMEOUT_S = 100  # one torchrun; the worker's own --timeout bounds each wait inside it
MY_CHECKS = "sampler_epochs,collectives,storage"
# Fault runs need no large size: a wrong element is found the same way (and 4 MB costs seconds).
SMALL_COLLECTIVES = "collectives: {sizes_bytes: [256, 65536]}\n"


def evidence(name, observations, hosts=None, config=None):
    hosts = hosts or ["node-a"] * len(observations)
    ranks = [{"rank": r, "local_rank": r, "host": h} for r, h in enumerate(hosts)]
    return Evidence(name, observations, ranks, config or {})


def blamed(result) -> list:
    return [c.rank for c in result.culprits]


# -- sampler_epochs ------------------------------------------------------------------------

def sampler_obs(world, samples=11, epochs=3, set_epoch=True, seed=0):
    """What each rank of a healthy run reports."""
    out = []
    for r in range(world):
        orders = [sampler_epochs.permutation(samples, seed, e if set_epoch else None)
                  for e in range(epochs)]
        shards = [sampler_epochs.expected_shards(o, world)[r] for o in orders]
        out.append({"samples": samples, "epochs": epochs, "set_epoch": set_epoch,
                    "shards": shards, "orders": orders})
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("samples", [8, 11])
def test_expected_shards_are_distributed_samplers_own(world, samples):
    for epoch in range(2):
        order = sampler_epochs.permutation(samples, 7, epoch)
        for r in range(world):
            real = DistributedSampler(range(samples), num_replicas=world, rank=r, shuffle=True,
                                      seed=7)
            real.set_epoch(epoch)
            assert sampler_epochs.expected_shards(order, world)[r] == list(real)


@pytest.mark.parametrize("world", [2, 4])
def test_sampler_healthy_passes(world):
    result = sampler_epochs.judge(evidence("sampler_epochs", sampler_obs(world)))
    assert result.status == PASS, result.culprits
    assert result.figures["padding_samples"] == 1  # 11 samples on 2 or 4 ranks: 12 slots
    assert len({tuple(o) for o in result.figures["orders"]}) == 3


def test_sampler_missing_set_epoch_is_detected():
    result = sampler_epochs.judge(evidence("sampler_epochs", sampler_obs(4, set_epoch=False)))
    assert result.status == FAIL
    assert blamed(result) == [None]
    assert "set_epoch" in result.culprits[0].reason
    assert "missing set_epoch detected" in result.summary
    assert result.figures["repeated_epochs"] == [[0, 1], [0, 2]]


def test_sampler_rank_with_another_seed_is_named():
    obs = sampler_obs(4)
    obs[2] = sampler_obs(4, seed=99)[2]
    result = sampler_epochs.judge(evidence("sampler_epochs", obs))
    assert result.status == FAIL
    assert blamed(result) == [2]
    assert "another permutation" in result.culprits[0].reason


def test_sampler_rank_loading_wrong_samples_is_named():
    obs = sampler_obs(3)
    obs[1]["shards"][1][0] += 1
    result = sampler_epochs.judge(evidence("sampler_epochs", obs))
    assert blamed(result) == [1]
    assert "epoch 1" in result.culprits[0].reason


def test_partition_problem():
    assert sampler_epochs.partition_problem([[0, 2, 4], [1, 3, 0]], 5) is None  # padding 1
    assert "on no rank" in sampler_epochs.partition_problem([[0, 2], [1, 2]], 4)
    assert "lengths" in sampler_epochs.partition_problem([[0, 2], [1]], 3)


# -- collectives ---------------------------------------------------------------------------

def row(sent=None, wrong=(), skip=None):
    return {"case": 0, "time_s": 0.001, "skip": skip, "sent_wrong": sent, "wrong": list(wrong)}


def wrong(source, index=0):
    return {"source": source, "index": index, "got": 5, "expected": 4, "count": 1}


CASE = {"op": "all_gather", "dtype": "float32", "size_bytes": 256, "count": 64, "block": 16,
        "index": 0}


def test_blame_reduction_names_the_wrong_contributor():
    case = {**CASE, "op": "all_reduce_sum"}
    rows = [row(wrong=[wrong(None)]) for _ in range(4)]
    rows[2]["sent_wrong"] = {"index": 0, "got": 5, "expected": 4, "count": 1}
    assert [r for r, _ in collectives.blame(case, rows)] == [2]


def test_blame_reduction_wrong_everywhere_with_right_inputs_names_no_rank():
    case = {**CASE, "op": "all_reduce_max"}
    found = collectives.blame(case, [row(wrong=[wrong(None)]) for _ in range(4)])
    assert [r for r, _ in found] == [None]
    assert "every contribution was right" in found[0][1]


def test_blame_reduction_wrong_on_one_receiver_names_it():
    case = {**CASE, "op": "reduce_scatter"}
    rows = [row(), row(), row(wrong=[wrong(None)]), row()]
    assert [r for r, _ in collectives.blame(case, rows)] == [2]


def test_blame_block_wrong_at_several_receivers_names_its_source():
    rows = [row(wrong=[wrong(1, 16)]) for _ in range(3)] + [row()]
    found = collectives.blame(CASE, rows)
    assert [r for r, _ in found] == [1]
    assert "arrived wrong at rank(s) [0, 1, 2]" in found[0][1]


def test_blame_block_wrong_at_one_receiver_names_the_receiver():
    rows = [row(), row(), row(), row(wrong=[wrong(1, 16)])]
    found = collectives.blame({**CASE, "op": "all_to_all"}, rows)
    assert [r for r, _ in found] == [3]
    assert "received wrong data from rank 1" in found[0][1]


def test_blame_ring_names_the_sender():
    rows = [row(), row(), row(), row(wrong=[wrong(2)])]
    assert [r for r, _ in collectives.blame({**CASE, "op": "send_recv"}, rows)] == [2]


def collectives_obs(rows_per_rank):
    cases = [CASE, {**CASE, "op": "broadcast", "index": 1}]
    return [{"cases": cases, "rows": rows, "barrier_s": 0.001} for rows in rows_per_rank]


def test_collectives_judge_one_culprit_per_rank_across_cases():
    bad = {"index": 0, "got": 5, "expected": 4, "count": 1}
    obs = collectives_obs([[row(), row()], [row(sent=bad), row(sent=bad)]])
    result = collectives.judge(evidence("collectives", obs))
    assert result.status == FAIL and blamed(result) == [1]
    assert "and 1 more case" in result.culprits[0].reason
    assert [c["status"] for c in result.figures["cases"]] == [FAIL, FAIL]


def test_collectives_judge_skip_is_not_failure():
    obs = collectives_obs([[row(), row(skip="RuntimeError: not supported")]] * 2)
    result = collectives.judge(evidence("collectives", obs))
    assert result.status == PASS
    cases = result.figures["cases"]
    assert [c["status"] for c in cases] == [PASS, SKIP] and "not supported" in cases[1]["reason"]


@pytest.mark.parametrize("dtype", sorted(rules.COLLECTIVE_DTYPES))
@pytest.mark.parametrize("world", [2, 300, 2000])
def test_values_sum_exactly_in_every_dtype(dtype, world):
    case = collectives.Case(3, "all_reduce_sum", dtype, 4096, 256, max(1, 256 // world))
    parts = [collectives.values(0, case, r, world, 0, 256) for r in range(world)]
    assert not torch.equal(parts[0], parts[1])  # rank-distinct data
    exact = sum(p.to(torch.int64) for p in parts)
    # Even with one element corrupted by +1 the sum stays where the dtype is exact ...
    assert 0 < exact.max().item() + 1 <= rules.COLLECTIVE_DTYPES[dtype]
    # ... so the dtype's own sum, in any order, is the exact one.
    in_dtype = parts[0].clone()
    for p in reversed(parts[1:]):
        in_dtype = in_dtype + p
    assert torch.equal(in_dtype.to(torch.int64), exact)


def test_plan_counts_are_multiples_of_world():
    for case in collectives.plan(["float32", "int64"], [256, 4200000], 3):
        assert case.count % 3 == 0 and case.block * 3 == case.count


# -- storage -------------------------------------------------------------------------------

def storage_obs(world, files=None, loads=None):
    files = files or ["ok"] * world
    loads = loads or ["ok"] * world
    out = []
    for r in range(world):
        o = {"dir": "/shared/ddp-smoke-x", "fs_type": "nfs", "file_bytes": 64,
             "write": {"path": f"/shared/ddp-smoke-x/rank{r}.bin", "error": None, "write_s": 0.01},
             "load": {"state": loads[r], "detail": "d", "load_s": 0.01}}
        if r == 0:
            o["save"] = {"error": None, "save_s": 0.01, "checkpoint_bytes": 100}
            o["files"] = [{"rank": q, "state": s, "detail": "d"} for q, s in enumerate(files)]
            o["read_all_s"] = 0.01
        out.append(o)
    return out


def test_storage_healthy_passes():
    result = storage.judge(evidence("storage", storage_obs(4), ["a", "a", "b", "b"]))
    assert result.status == PASS, result.culprits


def test_storage_not_shared_across_hosts():
    obs = storage_obs(4, files=["ok", "ok", "missing", "missing"],
                      loads=["ok", "ok", "missing", "missing"])
    result = storage.judge(evidence("storage", obs, ["a", "a", "b", "b"]))
    assert result.status == FAIL
    assert sorted(blamed(result)) == [2, 2, 3, 3]
    assert all(c.reason.startswith("not shared") for c in result.culprits)
    assert result.summary == "4 not shared"


def test_storage_missing_on_same_host_is_not_called_not_shared():
    obs = storage_obs(4, files=["ok", "missing", "ok", "ok"])
    result = storage.judge(evidence("storage", obs, ["a", "a", "b", "b"]))
    assert blamed(result) == [1] and result.culprits[0].reason.startswith("missing")


def test_storage_one_missing_of_a_host_whose_other_files_arrived_is_missing():
    obs = storage_obs(4, files=["ok", "ok", "ok", "missing"])
    result = storage.judge(evidence("storage", obs, ["a", "a", "b", "b"]))
    assert blamed(result) == [3] and result.culprits[0].reason.startswith("missing")


def test_storage_corrupt_file_names_its_writer():
    result = storage.judge(evidence("storage", storage_obs(3, files=["ok", "ok", "corrupt"])))
    assert blamed(result) == [2] and result.culprits[0].reason.startswith("corrupt")


def test_storage_checkpoint_wrong_everywhere_names_rank_0():
    result = storage.judge(evidence("storage", storage_obs(3, loads=["corrupt"] * 3)))
    assert blamed(result) == [0] and "on ranks [0, 1, 2]" in result.culprits[0].reason


def test_storage_checkpoint_wrong_on_one_reader_names_the_reader():
    result = storage.judge(evidence("storage", storage_obs(3, loads=["ok", "corrupt", "ok"])))
    assert blamed(result) == [1]


def test_storage_unwritable_rank_is_named():
    obs = storage_obs(2, files=["ok", "missing"])
    obs[1]["write"]["error"] = "PermissionError: [Errno 13] Permission denied"
    result = storage.judge(evidence("storage", obs))
    assert blamed(result) == [1] and result.culprits[0].reason.startswith("unwritable")


def test_storage_full_or_read_only_folder_is_the_folder_not_the_rank_that_hit_it():
    # a shared filesystem filling up fails whichever rank writes first (found by the fault
    # campaign: disk_full at storage named rank 1, whose write came after rank 0's)
    obs = storage_obs(2, files=["ok", "missing"])
    obs[1]["write"]["error"] = "OSError: [Errno 28] No space left on device"
    result = storage.judge(evidence("storage", obs))
    assert [c.rank for c in result.culprits] == [None]
    assert "No space left on device" in result.culprits[0].reason
    obs = storage_obs(2)
    obs[0]["refused"] = "OSError: [Errno 30] Read-only file system: '/r/storage'"
    result = storage.judge(evidence("storage", obs))
    assert [c.rank for c in result.culprits] == [None] and "Read-only" in result.culprits[0].reason


def write_rank_file(path, run_id, rank, data, header_data=None):
    header = {"format": storage.FORMAT, "rank": rank, "run_id": run_id,
              "payload_bytes": len(data),
              "sha256": hashlib.sha256(header_data or data).hexdigest()}
    Path(path).write_bytes(json.dumps(header).encode() + b"\n" + data)


def test_verify_reads_real_files(tmp_path):
    good = storage.payload("run", 1, 4096)
    bad = bytes([good[0] ^ 1]) + good[1:]
    cases = {"ok": (1, good, None), "flipped": (1, bad, good), "truncated": (1, good[:-1], None),
             "other-rank": (2, good, None)}
    states = {}
    for name, (rank, data, summed) in cases.items():
        write_rank_file(tmp_path / name, "run", rank, data, summed)
        states[name] = storage.verify(str(tmp_path / name), "run", 1, 4096)
    states["absent"] = storage.verify(str(tmp_path / "absent"), "run", 1, 4096)
    assert {k: v["state"] for k, v in states.items()} == {
        "ok": "ok", "flipped": "corrupt", "truncated": "corrupt", "other-rank": "corrupt",
        "absent": "missing"}
    assert "offset 0" in states["flipped"]["detail"]


# -- real torchrun runs --------------------------------------------------------------------

def torchrun(report_dir: Path, nproc: int, *args: str) -> tuple[int, dict, str]:
    """Run the worker under torchrun (make smoke-local's launcher: the subject here is the
    checks, not the launch); return its exit status, report.json, and its output."""
    run = launch.smoke_local(nproc, "--backend", "gloo", "--timeout", "60", *args,
                             report_dir=report_dir, timeout_s=RUN_TIMEOUT_S,
                             env={"OMP_NUM_THREADS": "1"})
    output = f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert run.report is not None, f"no report; {output[-3000:]}"
    return run.returncode, run.report, output


def checks_by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def healthy(request, tmp_path_factory):
    report_dir = tmp_path_factory.mktemp(f"healthy{request.param}") / "report"
    code, report, output = torchrun(report_dir, request.param, "--checks", MY_CHECKS)
    return request.param, code, report, report_dir, output


@pytest.mark.timeout(150)
def test_healthy_run_passes_every_check(healthy):
    world, _, report, report_dir, _ = healthy
    assert report["verdict"] == "pass", report["checks"]
    assert report["world_size"] == world
    checks = checks_by_name(report)
    assert [c["name"] for c in report["checks"]] == MY_CHECKS.split(",")
    for check in checks.values():
        assert check["status"] == PASS and check["culprits"] == [], check
    cases = checks["collectives"]["figures"]["cases"]
    # torch 2.13's gloo runs every op on CPU: 7 ops x 2 dtypes x 2 sizes, none skipped.
    assert len(cases) == 28 and all(c["status"] == PASS for c in cases)
    assert checks["storage"]["figures"]["file_states"] == ["ok"] * world
    assert not (report_dir / "storage").exists(), "storage left files behind"


@pytest.mark.timeout(150)
def test_healthy_run_exits_0(healthy):
    _, code, _, _, output = healthy
    assert code == 0, output[-3000:]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """4 ranks: the set_epoch demonstration; rank 3 (the broadcast root) corrupts its
    collectives contributions, rank 0 (the checkpoint's writer, every file's reader) what it
    stores."""
    base = tmp_path_factory.mktemp("faulty4")
    config = base / "demo.yaml"
    config.write_text("sampler_epochs: {set_epoch: false}\n" + SMALL_COLLECTIVES)
    code, report, _ = torchrun(base / "report", 4, "--checks", MY_CHECKS, "--config",
                               str(config), "--fault", "3:corrupt@collectives,0:corrupt@storage")
    return code, report, base / "report"


@pytest.mark.timeout(150)
def test_fault_run_fails_and_exits_nonzero(faulty):
    code, report, report_dir = faulty
    assert code != 0 and report["verdict"] == "fail"
    assert report["error"] is None  # judged failures, not an aborted run
    assert not (report_dir / "storage").exists(), "storage left files behind"


@pytest.mark.timeout(150)
def test_missing_set_epoch_demonstration_is_detected(faulty):
    check = checks_by_name(faulty[1])["sampler_epochs"]
    assert check["status"] == FAIL
    assert [c["rank"] for c in check["culprits"]] == [None]
    assert "set_epoch" in check["culprits"][0]["reason"]
    assert check["figures"]["repeated_epochs"] == [[0, 1], [0, 2]]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name,rank", [("collectives", 3), ("storage", 0)])
def test_corrupt_fault_names_the_injected_rank(faulty, name, rank):
    check = checks_by_name(faulty[1])[name]
    assert check["status"] == FAIL
    assert {c["rank"] for c in check["culprits"]} == {rank}, check["culprits"]
    assert all(c["host"] for c in check["culprits"])


@pytest.mark.timeout(150)
def test_corrupt_storage_on_rank_0_spoils_its_file_and_its_checkpoint(faulty):
    reasons = [c["reason"] for c in checks_by_name(faulty[1])["storage"]["culprits"]]
    assert any(r.startswith("corrupt: its file") for r in reasons), reasons
    assert any("checkpoint it saved reads back wrong on ranks [0, 1, 2, 3]" in r
               for r in reasons), reasons


@pytest.mark.timeout(150)
def test_corrupt_collectives_names_only_the_sender_in_every_case(faulty):
    cases = checks_by_name(faulty[1])["collectives"]["figures"]["cases"]
    # Rank 3 feeds every case (it is the broadcast root too), so every case fails.
    assert cases and all(c["status"] == FAIL for c in cases)


def test_ddp_step_says_when_the_sampler_pads_the_shards():
    """8 ranks, 4 samples: DistributedSampler repeats samples 0-3 on ranks 4-7. Issue 25: the
    summary said "shards partition 4 samples"."""
    from ddp_smoke.checks import ddp_step
    from ddp_smoke.checks.api import Evidence

    def judged(world):
        shards = ddp_step.expected_shards(len(ddp_step.FEATURES), world)
        params = ddp_step.reference_params(shards)
        obs = [{"local_rank": r, "samples": s, "batch": len(s), "params": params, "loss": 1.0}
               for r, s in enumerate(shards)]
        return ddp_step.judge(Evidence("ddp_step", obs, [{"host": "h"}] * world, {}))

    assert judged(8).summary.startswith("shards cover 4 samples, 4 repeated as padding "
                                        "(8 ranks); weight ")
    assert judged(2).summary.startswith("shards partition 4 samples; weight ")
