"""report.schema.json itself: a valid draft 2020-12 schema, shipped in the package, that
accepts what the kit writes and refuses a report that breaks the contract.

Real reports are checked wherever the suite produces one (tests/report_schema.py); here the
samples are built with the kit's own classes, so a field the code adds or drops shows here too.
"""
import copy
import fnmatch
import json
import tomllib
from importlib import resources

import jsonschema
import pytest

from ddp_smoke import checks
from ddp_smoke.model import FAIL, PASS, SKIP, CheckResult, Culprit, Report
from ddp_smoke.outputs.report import to_json
from tests import report_schema
from tests.launch import REPO

RANKS = [{"rank": 0, "local_rank": 0, "group_rank": 0, "host": "node1", "pid": 11,
          "device": "cpu", "route_address": "10.0.0.1", "hostname_addresses": ["10.0.0.1"],
          "addresses": {"eth0": "10.0.0.1"}, "slurm_node": "n1",
          "identity": {"machine_id": "3d12", "macs": {"eth0": "02:00:00:00:00:01"}}},
         {"rank": 1, "local_rank": 0, "group_rank": 1, "host": "node2", "pid": 12,
          "device": "cpu", "route_address": None, "hostname_addresses": [], "addresses": {},
          "identity": {"unreadable": "OSError: x"}},
         {"rank": 2, "local_rank": None, "host": None, "missing": "never connected to the store"}]


def _aborted() -> dict:
    """An aborted run with every kind of culprit, forensics and an error."""
    link = Culprit(None, None, "link 0-1: 12 % of the median", ranks=[0, 1],
                   hosts=["node1", "node2"])
    hung = Culprit(1, "node2", "never entered all_reduce #3", where="in _measure, compute.py:50")
    figures = {"victims": [{"rank": 0, "host": "node1",
                                               "state": "blocked in all_reduce #3"}],
               "arrived": [0, 1], "finished": [], "dead": [], "progress": {"0": {"seq": 3}},
               "aborts": [{"kind": "timeout", "at": 1.0, "stage": "compute"}]}
    report = Report(
        version="0.1.0", started_at="2026-11-30T23:22:51+00:00", backend="gloo", world_size=3,
        ranks=copy.deepcopy(RANKS), config={"timeout": 9.0, "checks": ["bandwidth", "compute"]},
        checks=[CheckResult("bandwidth", FAIL, summary="slow link", culprits=[link]),
                CheckResult("compute", FAIL, summary="stopped at compute", culprits=[hung],
                            figures=figures, duration_s=9.1),
                CheckResult("storage", SKIP, summary="not run: the run stopped at compute")],
        timings={"load_checks_s": 1.2, "connect_store_s": 0.1, "rendezvous_s": 0.3,
                 "checks_s": 9.5, "iterations": 1, "total_s": 11.0},
        error={"rank": None, "host": None, "type": "Aborted", "message": "run aborted at compute",
               "stage": "compute"},
        forensics=[{"rank": 1, "host": "node2", "where": "in _measure, compute.py:50",
                    "stacks": "r/stacks/rank1.txt", "flight_recorder_error": "RuntimeError: x"}],
        run_id="local-5f1c09ab", written_by="rank 1 (took over from rank 0)")
    return json.loads(to_json(report))


def _passed() -> dict:
    report = Report("0.1.0", "2026-11-30T23:22:51+00:00", "nccl", 2, copy.deepcopy(RANKS[:2]),
                    [CheckResult("environment", PASS, summary="ok", notes=["rank=0 …"])], {},
                    {"total_s": 2.0}, run_id="job-1", written_by="rank 0")
    return json.loads(to_json(report))


def test_the_schema_is_a_valid_draft_2020_12_schema_shipped_with_the_package():
    text = resources.files("ddp_smoke.outputs").joinpath("report.schema.json").read_text()
    jsonschema.Draft202012Validator.check_schema(json.loads(text))
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert any(fnmatch.fnmatch("outputs/report.schema.json", pattern)
               for pattern in data["package-data"]["ddp_smoke"])


def test_what_the_kit_writes_conforms():
    assert report_schema.problems(_aborted()) == []
    assert report_schema.problems(_passed()) == []


def test_the_checks_it_names_are_the_registered_ones():
    names = set(report_schema.validator().schema["$defs"]["check"]["properties"]["name"]["enum"])
    assert names == set(checks.REGISTRY) | {"launch", "preflight"}, \
        "a check was added or renamed: list it in report.schema.json's check name enum"


@pytest.mark.parametrize("breaks, where", [
    (lambda r: r.pop("verdict"), "(top): 'verdict' is a required property"),
    (lambda r: r.update(verdict="unknown"), "verdict: 'unknown' is not one of"),
    (lambda r: r["checks"][0].update(status="error"), "checks/0/status: 'error' is not one of"),
    (lambda r: r["checks"][0]["culprits"][0].update(rank=0), "checks/0/culprits/0"),
    (lambda r: r["checks"][1]["culprits"][0].pop("where"), "'where' is a required property"),
    (lambda r: r["checks"][1]["culprits"][0].update(hosts=["node2", "node1"]),
     "checks/1/culprits/0"),
    (lambda r: r.update(extra=1), "Additional properties are not allowed ('extra'"),
    (lambda r: r["timings"].update(load_s=1.0), "timings: Additional properties"),
    (lambda r: r["error"].pop("stage"), "error"),
    (lambda r: r["hosts"][0].update(status="good"), "hosts/0"),
    (lambda r: r["hosts"][0].update(status="bad"), "hosts/0"),
    (lambda r: r.update(started_at="yesterday"), "started_at"),
], ids=["no verdict", "bad verdict", "bad status", "link culprit convicts a rank",
        "culprit without where", "rank culprit with hosts", "unknown key", "unknown timing",
        "error without stage", "good host with reasons", "bad host on link evidence only",
        "started_at not ISO 8601"])
def test_a_report_that_breaks_the_contract_is_refused(breaks, where):
    report = _aborted()
    breaks(report)
    found = report_schema.problems(report)
    assert any(p.startswith(where) or where in p for p in found), found


def test_a_figure_no_schema_names_is_refused_and_victims_keep_their_shape():
    """Issue 31: the schema is the one description, figures included: a writer that emits a
    key the schema does not name fails every test that leaves a report (tests/conftest.py)."""
    report = _aborted()
    report["checks"][1]["figures"]["anything_new_gbps"] = [1, None, {"x": "y"}]
    assert any("anything_new_gbps" in p for p in report_schema.problems(report))
    report = _aborted()
    report["checks"][1]["figures"]["victims"][0].pop("state")
    assert report_schema.problems(report)


def test_every_check_and_the_harness_have_their_figures_named():
    schema = report_schema.validator().schema
    named = {k.removeprefix("figures_") for k in schema["$defs"] if k.startswith("figures_")}
    assert named == set(checks.REGISTRY) | {"launch", "preflight"}
    assert set(schema["$defs"]["check"]["properties"]["name"]["enum"]) == named


def test_the_config_keys_the_schema_names_are_defaults_yamls():
    from ddp_smoke import config
    schema = report_schema.validator().schema
    assert schema["properties"]["config"]["propertyNames"]["enum"] == sorted(config.defaults())


def _training(gpu: bool = False, change: dict | None = None) -> CheckResult:
    """The training check's judgement of made-up observations (checks/training.py judge)."""
    from ddp_smoke import config
    from ddp_smoke.checks import training
    from ddp_smoke.checks.api import Evidence
    from ddp_smoke.config import profiles
    ref = [6.279, 12.5, 301.25]
    one = {"device_type": "cuda" if gpu else "cpu", "layout": "fsdp", "mesh": [2],
           "layout_note": "", "model": {"vocab": 512, "dim": 192, "layers": 4, "heads": 4,
                                        "ffn": 512, "seq_len": 64, "micro_batch": 2,
                                        "params": 1967808, "params_non_embedding": 1869504},
           "flops_per_token": 11806848, "tokens_per_step": 128, "step_s": [0.1, 0.12, 0.1],
           "compute_s": [0.02] * 3, "job_losses": [6.28, 6.0, 5.5], "peak_memory_bytes": 1 << 28,
           "checked": {"loss": ref[0], "reference": ref, "grad_diff": 0.0, "param_diff": 0.0},
           "threads": 1, "cores": 8, "profile": profiles.load("h100-8gpu" if gpu else "cpu")}
    obs = [{**copy.deepcopy(one), **(change or {}).get(r, {})} for r in range(2)]
    return training.judge(Evidence("training", obs, RANKS[:2], config.resolve({}, {})))


def test_the_training_checks_figures_conform_run_skipped_or_failed():
    """Its judge's figures on CPU (no MFU) and on a GPU (MFU), a rank whose shards were not
    measured (grad_diff None) and a loss gone NaN; the quick level's skip has none."""
    nan = {"job_losses": [6.2, float("nan")],
           "checked": {"loss": 6.279, "reference": [6.279, 12.5, 301.25], "grad_diff": None,
                       "param_diff": float("inf")}}
    results = [_training(), _training(gpu=True), _training(change={1: nan}),
               CheckResult("training", SKIP, summary="not run at the quick level",
                           figures={"waits": {"collectives": 0}})]
    assert [results[0].status, results[2].status, results[3].status] == [PASS, FAIL, SKIP]
    assert results[1].figures["ranks"][0]["mfu"] > 0 and results[0].figures["mfu_median"] is None
    for result in results:
        report = _passed()
        report["checks"].append(json.loads(to_json(Report(
            "0.1.0", "2026-11-30T23:22:51+00:00", "gloo", 2, [], [result], {}, {})))
            ["checks"][0])
        assert report_schema.problems(report) == [], result.summary


@pytest.mark.parametrize("breaks, where", [
    (lambda f: f["ranks"][0].update(tokens_per_second=1.0), "figures/ranks/0"),
    (lambda f: f["ranks"][1].pop("step_s_p90"), "figures/ranks/1"),
    (lambda f: f.update(layout="ddp"), "figures/layout"),
    (lambda f: f["model"].update(params="2M"), "figures/model/params"),
    (lambda f: f.update(tokens_per_s_total=1.0), "tokens_per_s_total"),
], ids=["unnamed rank key", "rank without p90", "unknown layout", "params not a count",
        "unnamed figure"])
def test_training_figures_that_break_the_contract_are_refused(breaks, where):
    report = _passed()
    report["checks"].append(json.loads(to_json(Report(
        "0.1.0", "2026-11-30T23:22:51+00:00", "gloo", 2, [], [_training()], {}, {})))
        ["checks"][0])
    breaks(report["checks"][1]["figures"])
    assert any(where in p for p in report_schema.problems(report)), report_schema.problems(report)
