#!/usr/bin/env bash
# gpu_check.sh — everything GPU-side in one prepared run, on one GPU machine, in under 8 minutes.
#
#   make gpu-check                  # OUT=gpu-check-<time>/ by default; PY=.venv/bin/python
#   OUT=/some/dir bash bench/gpu_check.sh
#
# Steps (each bounded by `timeout`, each one line of PASS/FAIL in OUT/summary.txt):
#   1. nvml      NVML readings of every GPU and the health rules on them (no load): OUT/nvml.json
#   2. health    the health check on one rank, NCCL, 10 SDC repeats on the GPU
#   3. sdc       3 CPU ranks with --fault 1:sdc@health: the culprit must be exactly rank 1
#   4. all       one rank with every check on NCCL (the default selection, profile cpu: figures)
#   5. hang      one rank hangs at collectives: the run stops, forensics and Flight Recorder dump
#   6. compute   compute against the h200-8gpu profile's bf16 floor (636 TFLOPS) and device name
# Written without a GPU at hand (no GPU was lent to the session that wrote it): expect to read
# its output, not only its exit status. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 99
PY=${PY:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-$(dirname "$PY")/torchrun}
OUT=${OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
failed=0
started=$(date +%s)

step() {  # step NAME SECONDS EXPECTED_RC CMD…: run, log, judge by exit status
    local name=$1 limit=$2 want=$3
    shift 3
    local t0 rc
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    local verdict=PASS
    if [ "$rc" != "$want" ]; then verdict=FAIL; failed=$((failed + 1)); fi
    printf '%-8s %s rc=%s (want %s) %ss\n' "$name" "$verdict" "$rc" "$want" \
        "$(($(date +%s) - t0))" | tee -a "$OUT/summary.txt"
}

report_field() {  # report_field DIR PYTHON-EXPR-ON-r: print a value from DIR/report.json
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[1]+'/report.json')); print($2)" "$1" \
        2>/dev/null
}

{ nvidia-smi || true; nvidia-smi -q -d ECC,PERFORMANCE,PCIE || true; } >"$OUT/nvidia-smi.txt" 2>&1

# 1. NVML readings and the rules, without load (the under-load rules need step 2's sampler)
step nvml 30 0 "$PY" - "$OUT/nvml.json" <<'EOF'
import json, sys, time
from ddp_smoke import config
from ddp_smoke.checks import _gpu, _hca
from ddp_smoke.checks._health_rules import judge_node
t = time.monotonic()
nv = _gpu.open_nvml()
snap = _gpu.snapshot(nv)
sampler = _gpu.Sampler(nv, 0.1)
sampler.sample()
xids, why = _gpu.kernel_xids()
node = {"gpu": {"start": snap, "end": _gpu.snapshot(nv), "window_s": time.monotonic() - t,
                **sampler.take(), "kernel_xids": xids, "kernel_xids_why": why},
        "hca": {"absent": "not read in this step"}}
read_s = time.monotonic() - t
out = judge_node(node, config.defaults()["health"], {})
json.dump({"readings": node, "judged": out, "read_s": read_s}, open(sys.argv[1], "w"), indent=1)
print(f"read {snap['count']} GPU(s) in {read_s:.3f} s; driver {snap['driver']}")
for g in snap["gpus"]:
    print(f"GPU {g['index']} {g.get('name')} bus {g.get('bus_id')} serial {g.get('serial')} "
          f"rows {g.get('remapped_rows')} pcie max Gen{g.get('pcie_max_gen')} "
          f"x{g.get('pcie_max_width')} links {len(g.get('nvlink_up') or {})} "
          f"fabric {g.get('fabric')} recovery {g.get('recovery_action')}")
for key in ("findings", "warnings", "not_measured", "checked"):
    for item in out[key]:
        print(f"{key}: {item}")
EOF

# 2. health on one GPU rank under NCCL; SDC repeats on the GPU must agree bit for bit
cat >"$OUT/health.yaml" <<'EOF'
health:
  sdc_repeats: 10
EOF
step health 90 0 "$TORCHRUN" --standalone --nproc-per-node=1 -m ddp_smoke --backend nccl \
    --config "$OUT/health.yaml" --checks environment,compute,bandwidth,health \
    --report-dir "$OUT/health"
report_field "$OUT/health" \
    "[(c['name'], c['status'], c['summary'], c['duration_s']) for c in r['checks']]" \
    >>"$OUT/summary.txt"

# 3. SDC names the perturbed rank (CPU ranks: NCCL needs one GPU per rank)
step sdc 60 1 "$TORCHRUN" --standalone --nproc-per-node=3 -m ddp_smoke --backend gloo \
    --checks health --fault 1:sdc@health --report-dir "$OUT/sdc"
culprits=$(report_field "$OUT/sdc" \
    "[c['rank'] for c in r['checks'] if c['name'] == 'health' for c in c['culprits']]")
echo "sdc culprits: $culprits (want [1])" | tee -a "$OUT/summary.txt"
[ "$culprits" = "[1]" ] || failed=$((failed + 1))

# 4. every check on one rank under NCCL
step all 150 0 "$TORCHRUN" --standalone --nproc-per-node=1 -m ddp_smoke --backend nccl \
    --report-dir "$OUT/all"

# 5. a hang: stopped by the deadline, forensics and the Flight Recorder dump left
step hang 75 1 "$TORCHRUN" --standalone --nproc-per-node=1 -m ddp_smoke --backend nccl \
    --checks environment,collectives --fault 0:hang@collectives --timeout 20 \
    --report-dir "$OUT/hang"
report_field "$OUT/hang" "r['forensics']" | tee -a "$OUT/summary.txt"
stopped=$(report_field "$OUT/hang" "[c['name'] for c in r['checks'] if c['status'] == 'fail']")
echo "hang: failed checks $stopped (want ['collectives'])" | tee -a "$OUT/summary.txt"
[ "$stopped" = "['collectives']" ] || failed=$((failed + 1))
ls -la "$OUT/hang/flight" >>"$OUT/summary.txt" 2>&1
if [ ! -s "$OUT/hang/flight/rank0.json" ]; then
    echo "hang: no Flight Recorder dump (flight/rank0.json)" | tee -a "$OUT/summary.txt"
    failed=$((failed + 1))
fi

# 6. compute against the H200 profile (floor bf16 636 TFLOPS; measured 720 on one H200)
step compute 75 0 "$TORCHRUN" --standalone --nproc-per-node=1 -m ddp_smoke --backend nccl \
    --checks compute --profile h200-8gpu --report-dir "$OUT/compute"
report_field "$OUT/compute" \
    "[(c['summary'], c['figures']['ranks'][0]['matmul']) for c in r['checks']]" \
    | tee -a "$OUT/summary.txt"

echo "gpu-check: $failed failed step(s) in $(($(date +%s) - started)) s; output in $OUT" \
    | tee -a "$OUT/summary.txt"
exit "$failed"
