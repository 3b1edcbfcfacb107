# ddp-smoke — the verbs users expect. `make help` lists them.
#
# Set-up is automatic: every verb that needs Python creates .venv/ first when it is missing.
# TORCH_SPEC pins torch for the local venv. Where from is job/torch_choice.sh's decision, said
# when the venv is made (`sh job/torch_choice.sh --dry-run` shows it): PIP_EXTRA as given, else
# pip's own configured wheels/index, else PyPI's CUDA build on a machine with an NVIDIA GPU,
# else the CPU-only wheels.

PYTHON     ?= python3
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA  ?=
# the NVML binding the health check is tested with (pyproject.toml, docker/Dockerfile: the same)
NVML_SPEC  := nvidia-ml-py>=13.580.65,<14
NPROC      ?= 2
# more than 4 ranks per CPU core are refused (memory, time); OVERSUBSCRIBE=1 runs them anyway
OVERSUBSCRIBE ?=
# quick: a verdict in about the time of the bare tutorial (docs/options.md, "Measurement levels")
LEVEL      ?= quick
# empty: reports/<run id>, the run id local-<UTC time>-<random>: every run its own folder
REPORT_DIR ?=
ARGS       ?=
PYTEST_ARGS ?=
# make test's pytest-xdist workers: modules side by side, each real part in one (tests/conftest.py)
TEST_WORKERS ?= 3
BENCH_ROUNDS ?= 5

VENV := .venv
PY   := $(VENV)/bin/python
PIP  := $(PY) -m pip --disable-pip-version-check -q

.DEFAULT_GOAL := help
N          ?= 2
IMAGE      ?= ddp-smoke:0.1.0
BASE_IMAGE ?= pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
WHEELHOUSE ?=
PY_VERSION ?= 3.12
K8S_DIRS   ?=

.PHONY: help venv smoke-local test lint clean sandbox-up sandbox-down slurm-up slurm-try slurm-down \
        image wheelhouse image-test bench gpu-check k8s-check campaign

help:  ## list the verbs
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	args=$$(TORCH_SPEC='$(TORCH_SPEC)' PIP_EXTRA='$(PIP_EXTRA)' PIP='$(PY) -m pip' \
	  sh job/torch_choice.sh) && $(PIP) install $$args numpy pyyaml submitit '$(NVML_SPEC)'
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install $(PIP_EXTRA) -e '.[test,plot]' --no-build-isolation
	touch $@

venv: $(VENV)/.runtime  ## create .venv/ (torch, numpy, pyyaml, submitit, this package)

# torchrun --standalone through ddp_smoke.launch_local: bad input is one line before any rank
# starts, the output ends on the kit's last line, the exit status is the workers' (0/1/2); when
# it is not 0, make adds `make: *** [...] Error N` (N: the kit's status) and exits 2 itself. The
# launcher holds the coordination store itself (not torchrun's agent: a report even when rank 0
# dies) and forks the ranks with the worker imported: a verdict faster than the bare tutorial.
smoke-local: $(VENV)/.runtime  ## two CPU ranks with gloo on this machine (NPROC=2, LEVEL=quick, ARGS=…, OVERSUBSCRIBE=1)
	@$(PY) -m ddp_smoke.launch_local --nproc-per-node=$(NPROC) $(if $(OVERSUBSCRIBE),--oversubscribe) -- \
	  --backend gloo --level $(LEVEL) $(if $(REPORT_DIR),--report-dir $(REPORT_DIR)) $(ARGS)

test: $(VENV)/.test  ## the whole suite (real torchrun, namespaces, Slurm, Docker, manifests; TEST_WORKERS=3)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

lint: $(VENV)/.test  ## shellcheck the scripts, hadolint the Dockerfile, parse the manifests
	$(VENV)/bin/shellcheck slurm/*.sbatch slurm/*.sh docker/*.sh .ci/run job/torch_choice.sh
	$(VENV)/bin/hadolint docker/Dockerfile
	$(VENV)/bin/kubectl label --local -f k8s x=y -o name >/dev/null

k8s-check: $(VENV)/.test  ## check the manifests in k8s/ (or K8S_DIRS="…") offline: kubectl's parser, Kubernetes' schemas, the operators' CRDs
	@$(PY) -m tests.k8s_check $(K8S_DIRS)

# The fault campaign (tests/campaign/): real faults x where x stage x launcher x shape, each cell
# run for real against its exact expected outcome; the table goes to docs/campaign.md.
campaign: $(VENV)/.test  ## the fault campaign's covering set for real, ~2 h, root (SLICE=kind=sigkill+oom, PART=3/14, CELL=id)
	$(PY) -m tests.campaign $(if $(SLICE),--slice '$(SLICE)') $(if $(PART),--part $(PART)) \
	  $(if $(CELL),--cell $(CELL)) || rc=$$?; $(PY) -m tests.campaign --table; exit $${rc:-0}

image:  ## build the worker image (IMAGE=…, BASE_IMAGE=…, WHEELHOUSE=wheelhouse: offline)
	docker build -f docker/Dockerfile --build-arg BASE_IMAGE=$(BASE_IMAGE) \
	  --build-arg WHEELHOUSE=$(WHEELHOUSE) -t $(IMAGE) .

wheelhouse:  ## wheels for an offline `make image WHEELHOUSE=wheelhouse` (PY_VERSION = the base's Python)
	$(PYTHON) -m pip download --only-binary=:all: --python-version $(PY_VERSION) \
	  --platform manylinux_2_28_x86_64 -d wheelhouse numpy pyyaml submitit '$(NVML_SPEC)' setuptools

image-test: $(VENV)/.test  ## build and run the image on a private Docker engine (root)
	$(PY) -m pytest tests/launchers/test_docker.py $(PYTEST_ARGS)

bench: $(VENV)/.runtime  ## ratios, never absolute asserts: time to verdict vs the tutorial, busbw vs a loop, phases, pair planner, coordination at 16,384 ranks, the join's identity read, preflight's, health's and node-check's cost, rails' pairs, the link probe's, the training check's
	@echo "# bench on $$(nproc) CPUs; load average now: $$(cut -d' ' -f1-3 /proc/loadavg)"
	$(PY) bench/smoke_vs_tutorial.py $(BENCH_ROUNDS)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node=2 bench/bandwidth_vs_loop.py --rounds 7
	$(PY) bench/phases.py 3
	$(PY) bench/pairs_plan.py
	$(PY) bench/coordination_scale.py --quick --signing-cost 1 --signing-at 16384
	$(PY) bench/join_read.py
	$(PY) bench/preflight_cost.py 3
	$(PY) bench/health_cost.py 3
	$(PY) bench/node_check.py 3
	$(PY) bench/rails_pairs.py 3
	$(PY) bench/link_probe.py 3
	$(PY) bench/training_cost.py 3

gpu-check: $(VENV)/.runtime  ## on a GPU machine (CUDA torch: TORCH_SPEC/PIP_EXTRA): NVML + health, SDC, every check on NCCL, a hang's Flight Recorder, compute vs h200 (<= 8 min)
	$(PY) bench/gpu_check.py

sandbox-up:  ## N network-namespace "nodes" (dsh-node1 …) on a private bridge, to try multi-node by hand (root)
	$(PYTHON) -m tests.sandbox.hosts up $(N)

sandbox-down:  ## remove them: processes (by PID), namespaces, bridge, /etc/hosts lines
	$(PYTHON) -m tests.sandbox.hosts down

slurm-up:  ## a throw-away Slurm cluster of N nodes in namespaces (root; apt-installs slurm-wlm, munge)
	$(PYTHON) -m tests.sandbox.slurm up $(N)

slurm-try: $(VENV)/.runtime  ## sbatch slurm/ddp_smoke.sbatch on the slurm-up cluster, CPU only (NPROC=2, ARGS=…)
	mkdir -p reports
	SLURM_CONF=$(CURDIR)/.sandbox/slurm/slurm.conf sbatch --wait --gpus-per-node=0 --cpus-per-task=2 \
	  --output=reports/%x-%j.out --export=ALL,NPROC_PER_NODE=$(NPROC) slurm/ddp_smoke.sbatch $(ARGS)

slurm-down:  ## stop the Slurm sandbox (by PID) and remove everything it made
	$(PYTHON) -m tests.sandbox.slurm down

clean:  ## remove .venv/ and reports/
	rm -rf $(VENV) reports
