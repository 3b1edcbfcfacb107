#!/usr/bin/env python3
"""gpu_check.py — everything GPU-side in one prepared run, on one GPU machine, in under 8 minutes.

Needs only Python, torch and the NVIDIA driver: no make, no venv, no network. It finds its own
package (``job/`` beside this file) and starts torchrun as ``python -m torch.distributed.run``
with the same Python::

    python3 bench/gpu_check.py                       # OUT=gpu-check-<time>/
    python3 bench/gpu_check.py --out DIR --wheels wheelhouse   # PyYAML/numpy/nvidia-ml-py offline
    make gpu-check                                   # the same, with the venv's Python

Steps (each bounded; one table row each; CUDA-only steps say why they were skipped):

  deps     torch, PyYAML, numpy and nvidia-ml-py importable (from --wheels DIR if not:
           ``make wheelhouse`` on a machine with network, copied beside the repository)
  nvml     the health readers on this node for 2 s without load, judged with the same rules
           as the health check (``DDP_SMOKE_HEALTH_REPLAY`` serves a recorded node instead)
  health   the health check on one rank under NCCL, compute and bandwidth loading the GPU,
           10 SDC repeats (CUDA)
  sdc      3 CPU ranks with ``--fault 1:sdc@health``: the SDC culprits must be exactly rank 1
           (other health findings of this node do not count here: the nvml step shows them)
  all      one rank with every check under NCCL (CUDA), the training check's MFU against the
           GPU's dense bf16 peak: a profile file that holds only that peak, taken from the
           shipped profile whose name the GPU's name contains (A100, H100, H200, B200)
  training the all step's training check on its own row (no second run): tokens/s per GPU
           and MFU of the ~1.2 B-parameter model, the figures to set beside TorchTitan's
           (docs/training.md); its first step against the reference, step, exposed
           communication, peak memory (CUDA)
  hang     one rank hangs at collectives: the run stops, names it, leaves the Flight Recorder
           dump (CUDA)
  compute  compute against the h200-8gpu profile's bf16 floor (CUDA; another GPU fails it)

Written without a GPU at hand: read its output, not only its exit status. Exit status: the
number of failed steps. Every step's log and report stay under OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "job"))  # the package itself, installed or not
NVML_SPEC = "nvidia-ml-py>=13.580.65,<14"
_MODULES = {"torch": "torch", "yaml": "PyYAML", "numpy": "numpy", "pynvml": NVML_SPEC}
_NO_CUDA = "needs CUDA: torch.cuda.is_available() is False here"
# The shipped profile whose peak_tflops (dense bf16) gives the training check's MFU: the first
# whose key the GPU's name contains (GH200 reads as H200: the same Hopper GPU).
_PEAK_PROFILES = (("B200", "b200-8gpu"), ("H200", "h200-8gpu"), ("H100", "h100-8gpu"),
                  ("A100", "a100-8gpu"))
# TorchTitan's published FSDP figures, to set the training row beside (docs/training.md):
# Llama 3.1 8B, 8 H100, local batch 2, github.com/pytorch/torchtitan,
# benchmarks/llama3_h100_202412_torchtitan.md
_TORCHTITAN = ("TorchTitan, Llama 3.1 8B on 8 H100 with FSDP (its published figures): 5,762 "
               "tokens/s per GPU, 33-39 % MFU; another model (~7.6x the FLOPs per token): "
               "compare MFU, not tokens/s")


class Check:
    """The steps, their rows, and the environment every child process gets."""

    def __init__(self, out: Path, wheels: Path | None):
        self.out, self.wheels, self.rows = out, wheels, []
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO / "job")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                   if p])}
        self.cuda, self.gpu, self.peak_note = None, None, ""

    def row(self, name: str, status: str, seconds: float, what: str) -> None:
        self.rows.append((name, status, seconds, what))
        print(f"  {name:<8} {status:<5} {seconds:7.1f}  {what}", flush=True)

    # -- steps -------------------------------------------------------------------------------

    def deps(self) -> bool:
        t = time.monotonic()
        missing = [m for m in _MODULES if not _importable(m, self.env)]
        if missing and self.wheels:
            target = self.out / "deps"
            done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index",
                                   "--find-links", str(self.wheels), "--target", str(target),
                                   *[_MODULES[m] for m in missing if m != "torch"]],
                                  capture_output=True, text=True, timeout=120)
            (self.out / "deps.log").write_text(done.stdout + done.stderr)
            self.env["PYTHONPATH"] += os.pathsep + str(target)
            missing = [m for m in _MODULES if not _importable(m, self.env)]
        if missing:
            self.row("deps", "FAIL", time.monotonic() - t, "missing: " + ", ".join(
                _MODULES[m] for m in missing) + "; install them, or give --wheels DIR (made by "
                "`make wheelhouse` where there is network)")
            return False
        probe = ("import json, torch, yaml, numpy\nfrom importlib import metadata\n"
                 "v = lambda p: metadata.version(p) if p else None\n"
                 "c = torch.cuda.is_available()\n"
                 "print(json.dumps([torch.__version__, c, v('nvidia-ml-py'), "
                 "torch.cuda.get_device_name(0) if c else None]))")
        torch_v, self.cuda, nvml_v, self.gpu = json.loads(subprocess.run(
            [sys.executable, "-c", probe], env=self.env, capture_output=True, text=True,
            timeout=120).stdout)
        self.row("deps", "PASS", time.monotonic() - t, f"python {sys.version.split()[0]}, torch "
                 f"{torch_v} (CUDA {'available' if self.cuda else 'unavailable'}"
                 f"{', ' + self.gpu if self.gpu else ''}), nvidia-ml-py {nvml_v}")
        return True

    def nvml(self) -> None:
        t = time.monotonic()
        done = self._run("nvml", 30, [sys.executable, "-c", _NVML_STEP,
                                      str(self.out / "nvml.json")])
        status = {0: "PASS", 1: "FAIL"}.get(done, "FAIL")
        lines = (self.out / "nvml.log").read_text().splitlines()
        self.row("nvml", status, time.monotonic() - t, lines[-1] if lines else f"rc {done}")

    def torchrun(self, name: str, limit_s: int, want_rc: int, nproc: int, *args: str,
                 cuda: bool = True, judge=None) -> None:
        t = time.monotonic()
        if cuda and not self.cuda:
            self.row(name, "SKIP", 0.0, _NO_CUDA)
            return
        rdir = self.out / name
        rc = self._run(name, limit_s, [sys.executable, "-m", "torch.distributed.run",
                                       "--standalone", f"--nproc-per-node={nproc}", "-m",
                                       "ddp_smoke", "--report-dir", str(rdir), *args])
        report = _report(rdir)
        ok, what = (rc == want_rc, f"exit {rc} (want {want_rc})")
        if ok and judge is not None:
            ok, what = judge(report, rdir)
        elif report:
            what += "; " + "; ".join(f"{c['name']} {c['status']}" for c in report["checks"])
        self.row(name, "PASS" if ok else "FAIL", time.monotonic() - t, what[:300])

    def peak_profile(self) -> tuple[list[str], str]:
        """``(--profile arguments, what they are)``: a profile file in OUT holding only the
        training peak of the shipped profile that matches this GPU (no floors, no health
        expectations: every other check runs as without a profile); none for another GPU."""
        name = next((p for key, p in _PEAK_PROFILES if key in (self.gpu or "")), None)
        shipped = REPO / "job" / "ddp_smoke" / "config" / "profiles" / f"{name}.yaml"
        found = re.search(r"^training:\s*\n\s+peak_tflops:\s*([0-9.]+)", shipped.read_text(),
                          re.M) if name else None
        if not found:
            return [], f"no shipped profile's peak for {self.gpu!r}: tokens/s only, no MFU"
        path = self.out / f"peak-{name}.yaml"
        path.write_text(f'description: "gpu-check: the dense bf16 peak of {name}, nothing '
                        f'else"\ndevice_name: ""\ntraining:\n  peak_tflops: '
                        f'{found.group(1)}\nsources:\n  - "{shipped.name} in this kit"\n')
        return ["--profile", str(path)], f"profile {name}"

    def training(self, step: str) -> None:
        """The training check of ``step``'s run as its own row: tokens/s per GPU, MFU."""
        if not self.cuda:
            self.row("training", "SKIP", 0.0, _NO_CUDA)
            return
        c = _check(_report(self.out / step), "training")
        if not c:
            self.row("training", "FAIL", 0.0, f"no training check in the {step} step's report "
                     f"(see {step}.log)")
            return
        status = {"pass": "PASS", "skip": "SKIP"}.get(c.get("status"), "FAIL")
        f = c.get("figures") or {}
        what = "" if status == "PASS" else f"training {c.get('status')}: {c.get('summary')}; "
        if f.get("ranks"):
            def med(key: str) -> float:
                return statistics.median(k[key] for k in f["ranks"])
            mfu = f.get("mfu_median")
            what += (f"{med('tokens_per_s'):,.0f} tokens/s per GPU, MFU "
                     + (f"{mfu:.1%} of {f['peak_tflops']:g} TFLOPS ({self.peak_note})"
                        if mfu is not None else f"- ({self.peak_note or 'no peak'})")
                     + f"; {f['model']['params'] / 1e9:.2f} B parameters, "
                     f"{f['flops_per_token'] / 1e9:.2f} GFLOP a token, {f['tokens_per_step']} "
                     f"tokens a GPU a step; step {med('step_s_median') * 1e3:.0f} ms (p90 "
                     f"{med('step_s_p90') * 1e3:.0f}), exposed communication "
                     f"{med('exposed_comm_s') * 1e3:.0f} ms, peak "
                     f"{max(k['peak_memory_bytes'] for k in f['ranks']) / 2**30:.1f} GiB; "
                     f"first step against the reference: gradients "
                     f"{max(k['grad_diff'] or 0 for k in f['ranks']):.2g}, weights "
                     f"{max(k['param_diff'] or 0 for k in f['ranks']):.2g} (tolerance "
                     f"{f['tolerance']:g})")
        self.row("training", status, c.get("duration_s", 0.0), what.rstrip("; ")[:400] or "-")
        if f.get("ranks"):
            print(f"  {'':<8} {'':<5} {'':>7}  ({_TORCHTITAN})", flush=True)

    def _run(self, name: str, limit_s: int, cmd: list[str]) -> int:
        with open(self.out / f"{name}.log", "w") as log:
            try:
                return subprocess.run(cmd, cwd=REPO, env=self.env, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=limit_s,
                                      stdin=subprocess.DEVNULL).returncode
            except subprocess.TimeoutExpired:
                log.write(f"\ngpu-check: {name} stopped after {limit_s} s\n")
                return 124


def _importable(module: str, env: dict) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=env,
                          capture_output=True, timeout=120).returncode == 0


def _report(rdir: Path) -> dict | None:
    try:
        return json.loads((rdir / "report.json").read_text())
    except (OSError, ValueError):
        return None


def _check(report: dict | None, name: str) -> dict:
    return next((c for c in (report or {}).get("checks", []) if c["name"] == name), {})


def _sdc(report, rdir):
    ranks = _check(report, "health").get("figures", {}).get("sdc_culprits")
    return ranks == [1], f"SDC culprits {ranks} (want [1])"


def _hang(report, rdir):
    failed = [c["name"] for c in (report or {}).get("checks", []) if c["status"] == "fail"]
    dump = (rdir / "flight" / "rank0.json").is_file()
    return failed == ["collectives"] and dump, (
        f"failed checks {failed} (want ['collectives']); Flight Recorder dump "
        f"{'written' if dump else 'missing'}")


def _health(report, rdir):
    c = _check(report, "health")
    return c.get("status") == "pass", f"health {c.get('status')}: {c.get('summary', '')}"


def _compute(report, rdir):
    c = _check(report, "compute")
    return c.get("status") == "pass", f"compute {c.get('status')}: {c.get('summary', '')}"


# The nvml step, run in a child with the package on its path: the node's readers for 2 s and
# the health check's own families on the reading. Exit 0: nothing failed; 1: findings.
_NVML_STEP = """
import json, sys, time
from ddp_smoke import config
from ddp_smoke.checks import health
from ddp_smoke.checks.health.finding import FAIL, Limits
from ddp_smoke.checks.health.readers import Node
node = Node(0.1)
t = time.perf_counter()
node.start()
start_s = time.perf_counter() - t
time.sleep(2.0)
t = time.perf_counter()
reading = node.finish()
read_s = start_s + time.perf_counter() - t
node.close()
findings = health.judge_node(reading, Limits(config.defaults()["health"], {}))
json.dump({"reading": reading, "findings": [f.as_dict() for f in findings]},
          open(sys.argv[1], "w"), indent=1)
gpus = (reading.get("gpu", {}).get("end") or {}).get("gpus", [])
for g in gpus:
    print(f"GPU {g['index']} {g.get('name')} bus {g.get('bus_id')} serial {g.get('serial')}")
for f in findings:
    print(f"{f.level}: {f.line()}")
failed = [f for f in findings if f.level == FAIL]
why = (reading.get("gpu") or {}).get("unavailable")
print(f"{len(gpus)} GPU(s) read in {read_s:.3f} s (start + end readings)"
      + (f" (replayed from {reading['replay']})" if reading["replay"] else "")
      + (f"; NVML: {why['cause']}" if why else "") + f"; {len(failed)} failure(s)"
      + (f": {failed[0].line()[:160]}" if failed else ""))
sys.exit(1 if failed or why else 0)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path,
                        default=Path(f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"))
    parser.add_argument("--wheels", type=Path, default=None,
                        help="a folder of wheels for what the Python lacks (offline)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    check, t0 = Check(out, args.wheels.resolve() if args.wheels else None), time.monotonic()
    (out / "health.yaml").write_text("health:\n  sdc_repeats: 10\n")
    print(f"# gpu-check: {sys.executable}; output in {out}")
    print(f"  {'step':<8} {'state':<5} {'time_s':>7}  result")
    if check.deps():
        check.nvml()
        nccl = ("--backend", "nccl")
        check.torchrun("health", 90, 0, 1, *nccl, "--config", str(out / "health.yaml"),
                       "--checks", "environment,compute,bandwidth,health", judge=_health)
        check.torchrun("sdc", 60, 1, 3, "--backend", "gloo", "--checks", "health", "--fault",
                       "1:sdc@health", cuda=False, judge=_sdc)
        # all: 150 s for the other checks, and the training check's own bound, the 90 s
        # timeout (its ~1.2 B-parameter model is drawn on the CPU first: docs/training.md)
        peak, check.peak_note = check.peak_profile() if check.cuda else ([], "")
        check.torchrun("all", 240, 0, 1, *nccl, *peak)
        check.training("all")
        check.torchrun("hang", 75, 1, 1, *nccl, "--checks", "environment,collectives",
                       "--fault", "0:hang@collectives", "--timeout", "20", judge=_hang)
        check.torchrun("compute", 60, 0, 1, *nccl, "--checks", "compute", "--profile",
                       "h200-8gpu", judge=_compute)
    failed = sum(r[1] == "FAIL" for r in check.rows)
    counts = ", ".join(f"{sum(r[1] == s for r in check.rows)} {s.lower()}"
                       for s in ("PASS", "FAIL", "SKIP"))
    print(f"gpu-check: {counts} in {time.monotonic() - t0:.0f} s; output in {out}")
    (out / "summary.json").write_text(json.dumps(
        [dict(zip(("step", "status", "seconds", "result"), r)) for r in check.rows], indent=1))
    return failed


if __name__ == "__main__":
    sys.exit(main())
