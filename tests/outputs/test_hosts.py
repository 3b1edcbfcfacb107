"""Good and bad hosts: the status rules on recorded reports, and on real torchrun runs."""
from __future__ import annotations

import json
import os
import shlex
import socket

import pytest

from ddp_smoke.outputs.fleet import REASON_CHARS, drain_reason
from ddp_smoke.outputs.hosts import (DRAIN_BUDGET_S, drain, drain_argv, held_by_breaker,
                                     host_lists, hosts_section, next_commands, render)
from ddp_smoke.outputs.report import as_dict
from ddp_smoke.model import FAIL, PASS, CheckResult, Culprit, Report
from tests.launch import torchrun

RANKS = [{"rank": r, "local_rank": 0, "host": f"node{r + 1}", "slurm_node": f"gpu{r + 1:02d}"}
         for r in range(4)]


def _report(*checks: CheckResult) -> Report:
    return Report("0", "t", "gloo", 4, RANKS, list(checks), {"timeout": 9, "checks": []})


def _link(a: int, b: int, why: str = "slow link") -> Culprit:
    """A link culprit: both ends, no single rank."""
    return Culprit(None, None, why, ranks=[a, b], hosts=[RANKS[a]["host"], RANKS[b]["host"]])


def _statuses(report) -> dict[str, str]:
    return {h["host"]: h["status"] for h in hosts_section(report)}


def test_every_host_is_listed_good_when_nothing_names_it():
    hosts = hosts_section(_report(CheckResult("environment", PASS)))
    assert hosts == [{"host": f"node{r + 1}", "status": "good", "ranks": [r],
                      "slurm_node": f"gpu{r + 1:02d}", "reasons": []} for r in range(4)]


def test_a_named_rank_makes_its_host_bad_with_every_reason_kept():
    report = _report(CheckResult("compute", FAIL, culprits=[Culprit(2, "node3", "slow GPU")]),
                     CheckResult("storage", FAIL, culprits=[Culprit(2, "node3", "file missing"),
                                                            Culprit(0, "node1", "corrupt")]))
    assert _statuses(report) == {"node1": "bad", "node2": "good", "node3": "bad",
                                 "node4": "good"}
    node3 = hosts_section(report)[2]
    assert node3["reasons"] == [{"check": "compute", "reason": "slow GPU", "rank": 2},
                                {"check": "storage", "reason": "file missing", "rank": 2}]


def test_a_link_makes_both_ends_suspect_unless_other_evidence_convicts_one():
    only_link = _report(CheckResult("bandwidth", FAIL, culprits=[_link(0, 3)]))
    assert _statuses(only_link) == {"node1": "suspect", "node2": "good", "node3": "good",
                                    "node4": "suspect"}
    assert hosts_section(only_link)[0]["reasons"] == [
        {"check": "bandwidth", "reason": "slow link", "link": ["node1", "node4"],
         "ranks": [0, 3]}]
    convicted = _report(CheckResult("bandwidth", FAIL, culprits=[_link(0, 3)]),
                        CheckResult("compute", FAIL, culprits=[Culprit(3, "node4", "slow")]))
    assert _statuses(convicted) == {"node1": "suspect", "node2": "good", "node3": "good",
                                    "node4": "bad"}


def test_link_ends_given_as_ranks_only_are_found_through_the_rank_records():
    culprit = Culprit(None, None, "slow link", ranks=[1, 2])
    report = _report(CheckResult("bandwidth", FAIL, culprits=[culprit]))
    assert _statuses(report) == {"node1": "good", "node2": "suspect", "node3": "suspect",
                                 "node4": "good"}


def test_a_link_inside_one_host_convicts_that_host():
    culprit = Culprit(None, None, "NVLink 0<->1 slow", ranks=[1, 1], hosts=["node2", "node2"])
    assert _statuses(_report(CheckResult("bandwidth", FAIL, culprits=[culprit])))["node2"] == \
        "bad"


def test_culprits_naming_no_host_blame_no_host():
    report = _report(CheckResult("bandwidth", FAIL,
                                 culprits=[Culprit(None, None, "all_reduce below the floor")]))
    assert set(_statuses(report).values()) == {"good"}
    assert render(hosts_section(report), "7", "/r", None) == []


def test_a_report_json_dict_gives_the_same_section_as_the_report():
    report = _report(CheckResult("compute", FAIL, culprits=[Culprit(1, "node2", "slow")]),
                     CheckResult("bandwidth", FAIL, culprits=[_link(0, 3)]))
    data = json.loads(json.dumps({**as_dict(report), "checks": [
        {**c.__dict__, "culprits": [vars(k) for k in c.culprits]} for c in report.checks]}))
    assert hosts_section(data) == hosts_section(report) == data["hosts"]


def test_host_lists_and_next_commands():
    report = _report(CheckResult("compute", FAIL, culprits=[Culprit(1, "node2", 'slow "$(rm)"')]),
                     CheckResult("bandwidth", FAIL, culprits=[_link(0, 3), _link(1, 2)]))
    hosts = hosts_section(report)
    assert host_lists(hosts) == {"bad_hosts.txt": "node2\n",
                                        "suspect_hosts.txt": "node1\nnode3\nnode4\n",
                                        "good_hosts.txt": "", "bad_rails.txt": ""}
    lines = next_commands(hosts, "job 42")
    assert lines == [
        'scontrol update NodeName=gpu02 State=DRAIN Reason="ddp-smoke job 42: compute: '
        'slow (rm) (+1 more)"',
        "sbatch --exclude=gpu02 slurm/ddp_smoke.sbatch",
        # node2's link to node3 needs no re-test of its own: node2 is drained anyway
        "sbatch --nodes=2 --nodelist=gpu01,gpu04 slurm/ddp_smoke.sbatch --checks bandwidth"
        "   # re-test the link"]  # no good host left to take along as a reference
    # no kubectl lines: no rank ran in a pod (none recorded NODE_NAME)
    # The printed drain line is one shell word per argument: what --act runs, exactly.
    assert shlex.split(lines[0]) == drain_argv(hosts[1], "job 42")


def test_next_steps_fit_the_launcher_that_ran():
    """Slurm lines only for Slurm nodes, kubectl lines only for pods' nodes; a run under
    neither (a laptop, plain torchrun) gets a sentence, not commands for a scheduler it has
    not got; an injected fault gets none (issue 25, item 7)."""
    bad = [CheckResult("compute", FAIL, culprits=[Culprit(1, "node2", "slow")])]
    pods = [{**r, "slurm_node": None, "k8s_node": f"k8s-{r['host']}"} for r in RANKS]
    hosts = hosts_section(Report("0", "t", "gloo", 4, pods, bad, {"checks": []}))
    assert next_commands(hosts, "1") == [
        "kubectl cordon k8s-node2", "kubectl label node k8s-node2 ddp-smoke/result=fail "
        "--overwrite"]
    laptop = [{k: v for k, v in r.items() if k != "slurm_node"} for r in RANKS]
    hosts = hosts_section(Report("0", "t", "gloo", 4, laptop, bad, {"checks": []}))
    assert next_commands(hosts, "1") == []
    printed = render(hosts, "1", "/r", None)
    assert printed[-1].startswith("# next steps: take the bad hosts out of service") and \
        not [line for line in printed if "scontrol" in line or "kubectl" in line], printed
    hosts = hosts_section(_report(*bad))  # Slurm nodes, but the fault was injected
    printed = render(hosts, "1", "/r", None, injected="1:slow@compute")
    assert printed[-1] == ("# next steps: none; the failures were injected (--fault "
                           "1:slow@compute), the alerting path is what was tested"), printed


def test_a_suspect_link_is_re_tested_with_a_good_host_as_reference():
    hosts = hosts_section(_report(CheckResult("bandwidth", FAIL, culprits=[_link(0, 3)])))
    assert next_commands(hosts, "1") == [
        "sbatch --nodes=3 --nodelist=gpu01,gpu04,gpu02 slurm/ddp_smoke.sbatch --checks "
        "bandwidth   # re-test the link"]
    printed = render(hosts, "1", "/r", None)
    assert printed[0] == ("# hosts: 0 bad, 2 suspect, 2 good; lists (bad_hosts.txt, "
                          "suspect_hosts.txt, good_hosts.txt) in /r")
    assert printed[3] == "# next steps, not run:"  # nothing to drain: --act would do nothing


def test_next_steps_say_whether_act_ran_the_drains_or_the_circuit_breaker_held():
    """Every host bad (more than fleet.drain_max_share): --act drains none, so the commands stay
    for a person and the line above them says so; one bad host of four is drained."""
    quota = "CPU quota: held back in 100% of the periods they could run"
    every = hosts_section(_report(CheckResult("health", FAIL, culprits=[
        Culprit(None, f"node{r + 1}", quota) for r in range(4)])))
    tripped = held_by_breaker(every, 0.5)
    assert tripped["failing"] == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert tripped["kind"] == "the nodes' set-up", tripped
    printed = render(every, "1", "/r", "slurm-drain", held=True)
    assert "# next steps, not run (--act slurm-drain ran none: the circuit breaker held):" in \
        printed, printed
    one = hosts_section(_report(CheckResult("compute", FAIL,
                                            culprits=[Culprit(1, "node2", "slow")])))
    assert held_by_breaker(one, 0.5) is None
    assert "# next steps, not run (--act slurm-drain ran the scontrol lines):" in render(
        one, "1", "/r", "slurm-drain")


def test_drain_reason_is_one_bounded_shell_safe_line():
    host = {"host": "n", "reasons": [{"check": "c", "reason": "x`id`\n$HOME\\ " * 40},
                                     {"check": "d", "reason": "also"}]}
    reason = drain_reason(host, "7")
    assert len(reason) <= REASON_CHARS and reason.endswith("... (+1 more)")
    assert not set(reason) & set('`$\\"\n!')


def test_a_long_drain_reason_keeps_its_cause_at_the_end():
    """A finding that names a long path says why last (the OS's error): cut in the middle, the
    drain reason keeps both what failed and why (measured: node-check's drain for a full
    report folder ended inside the folder's path, its "No space left on device" cut off)."""
    folder = "/var/lib/ddp-smoke/node-check/node-check-gpu-node-017-20261206-204221-a1b2c3"
    host = {"host": "n", "reasons": [{"check": "preflight", "reason": (
        f"report_dir: report folder {folder} not writable: No space left on device")}]}
    reason = drain_reason(host, "node-check")
    assert len(reason) <= REASON_CHARS, reason
    assert reason.startswith("ddp-smoke node-check: preflight: report_dir: report folder /var")
    assert reason.endswith("No space left on device") and "..." in reason, reason
    # words are kept whole where the reason is long for its words (a GPU's finding)
    gpu = {"host": "n", "reasons": [{"check": "health", "reason": (
        "GPU 0 (bus 00000000:1B:00.0, serial 1641824000241): row remap pending on an "
        "uncorrectable ECC error: drain the node and reset the GPU (the remap happens at "
        "the next reset)")}] * 2}
    reason = drain_reason(gpu, "node-check")
    assert "row remap pending" in reason and reason.endswith("... (+1 more)"), reason


def test_drain_outside_slurm_or_without_node_names_drains_nothing():
    bad = [{"host": "node2", "status": "bad", "reasons": [{"check": "c", "reason": "r"}]}]
    assert drain(bad, "1", environ={}) == [
        "--act slurm-drain: not inside a Slurm job (no SLURM_JOB_ID); nothing drained"]
    assert drain(bad, "1", environ={"SLURM_JOB_ID": "5"}) == [
        "--act slurm-drain: node2 not drained: its ranks recorded no SLURMD_NODENAME"]
    assert drain([{**bad[0], "status": "good"}], "1", environ={"SLURM_JOB_ID": "5"}) == []


def _program(directory, name: str, body: str) -> None:
    path = directory / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.mark.timeout(60)
def test_drain_reports_a_refusing_or_silent_scontrol_and_the_command_to_run(tmp_path):
    """Real processes standing in for scontrol: one that refuses (as for a user without the
    privilege), one that never answers (a stuck slurmctld): named, bounded, with the command."""
    bad = [{"host": f"node{i}", "slurm_node": f"gpu0{i}", "status": "bad",
            "reasons": [{"check": "compute", "reason": "slow", "rank": i}]} for i in (1, 2)]
    refuses, silent = tmp_path / "refuses", tmp_path / "silent"
    refuses.mkdir()
    silent.mkdir()
    _program(refuses, "scontrol", 'echo "slurm_update error: Invalid user id" >&2; exit 1')
    _program(silent, "scontrol", "exec /bin/sleep 60")
    env = {"SLURM_JOB_ID": "9"}
    assert drain(bad[:1], "9", {**env, "PATH": str(refuses)}) == [
        "--act slurm-drain: gpu01 NOT drained (slurm_update error: Invalid user id); run by "
        "hand: scontrol update NodeName=gpu01 State=DRAIN 'Reason=ddp-smoke 9: compute: slow'"]
    lines = drain(bad, "9", {**env, "PATH": str(silent)})
    assert [line.split(" (")[0] for line in lines] == [
        "--act slurm-drain: gpu01 NOT drained", "--act slurm-drain: gpu02 NOT drained"]
    assert all(f"no answer within {DRAIN_BUDGET_S:g} s" in line for line in lines)


# -- real runs ---------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_real_run_with_a_corrupting_rank_judges_the_host_and_lists_nothing(tmp_path):
    """Two ranks on this host, rank 1 corrupts: the report judges the host bad; the fault was
    injected on purpose, so the lists stay empty (a script drains from bad_hosts.txt) and no
    drain or cordon line is printed (issues 25, 35); the verdict is still the last line."""
    run = torchrun(2, "--checks", "environment,collectives", "--fault", "1:corrupt@collectives",
                   report_dir=tmp_path, env={"SLURM_JOB_ID": ""})
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    host = socket.gethostname()
    [entry] = run.report["hosts"]
    assert (entry["host"], entry["status"], entry["ranks"]) == (host, "bad", [0, 1])
    assert {r["check"] for r in entry["reasons"]} == {"collectives"}
    assert {r["rank"] for r in entry["reasons"]} == {1}
    for name in ("bad_hosts.txt", "good_hosts.txt", "suspect_hosts.txt"):
        assert (tmp_path / name).read_text() == "", name
    out = run.stdout
    assert "scontrol" not in out and "kubectl" not in out and "sbatch" not in out, out
    assert "# injected on purpose (--fault 1:corrupt@collectives)" in out
    assert "# next steps: none; the failures were injected (--fault 1:corrupt@collectives)" \
        in out
    # the host a failure made on purpose names is "practice", never "bad" (issue 49), in the
    # terminal and on the page; report.json keeps the judgement with "injected" beside it
    assert f"# hosts: 1 practice, 0 good; practice run: lists (bad_hosts.txt, " \
        f"suspect_hosts.txt, good_hosts.txt) left empty in {tmp_path}" in out
    assert f"#   practice {host}" in out and "#   bad " not in out, out
    page = (tmp_path / "report.html").read_text()
    hosts = page.split('<section id="hosts">', 1)[1].split("</section>", 1)[0]
    assert '<span class="chip practice">practice</span>' in hosts and "1 practice" in hosts
    assert "chip bad" not in hosts and "1 bad" not in hosts, hosts
    assert run.report["injected"] == "1:corrupt@collectives"
    assert out.splitlines()[-1].startswith(
        "verdict: FAIL (PRACTICE: --fault 1:corrupt@collectives) — "), out
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


@pytest.mark.timeout(180)
def test_real_passing_run_lists_the_host_good_and_prints_nothing_after_the_verdict(tmp_path):
    run = torchrun(2, "--checks", "environment", report_dir=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    host = socket.gethostname()
    assert run.report["hosts"] == [{"host": host, "status": "good", "ranks": [0, 1],
                                    "reasons": []}]
    assert (tmp_path / "good_hosts.txt").read_text() == f"{host}\n"
    assert (tmp_path / "bad_hosts.txt").read_text() == ""
    assert run.stdout.splitlines()[-1].startswith("verdict: PASS")


def test_bad_act_is_one_line_and_exit_2(tmp_path):
    run = torchrun(1, "--act", "drain-everything", report_dir=tmp_path, timeout_s=60)
    assert run.returncode != 0
    assert "ddp-smoke: error: argument --act: invalid choice: 'drain-everything' (choose from 'slurm-drain')" in \
        run.stderr
    assert "Traceback" not in run.stderr.split("ddp-smoke: error")[0][-200:]
