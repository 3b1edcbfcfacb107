#!/usr/bin/env bash
# ddp-smoke 0.1.0 pod script: one pod of a multi-node run on Kubernetes. Shipped in the image
# (/opt/ddp-smoke/pod.sh) and called by every variant in k8s/ with the values its controller
# gives the pod (PyTorchJob: MASTER_*/PET_*; Indexed Job: its own env; TrainJob: PET_*):
#
#   bash /opt/ddp-smoke/pod.sh --nnodes=N --nproc-per-node=P --rdzv-endpoint=HOST:PORT \
#       --node-rank=I --report-dir=DIR [-- WORKER OPTIONS]
#
#   --nnodes          the job's node (pod) count
#   --nproc-per-node  processes (= GPUs) per pod
#   --rdzv-endpoint   the c10d rendezvous host and port: the pod of node rank 0
#   --node-rank       this pod's index among the job's pods (its controller's: it decides only
#                     which pod hosts the stores; torchrun orders ranks by arrival)
#   --report-dir      where this run's report goes (REPORT_DIR/report.json, junit.xml …)
#
# In order: the worker's options checked once (bad input: one line, exit 2), preflight (the
# rendezvous host listens for every pod's hello), the kit's store host on the rendezvous host
# (torchrun its child), torchrun with c10d, then the report as one log line, the one-line
# verdict as the termination message, and that line as the log's last.
#
# Environment read: TERMINATION_LOG (default /dev/termination-log, the kubelet's
# terminationMessagePath); DDP_SMOKE_RUN_ID (required: the run id, the same in every pod: the
# rendezvous id and the report's run_id) and POD_IP (required: the address torchrun
# advertises, needing no DNS); DDP_SMOKE_PREFLIGHT (0: no preflight),
# DDP_SMOKE_PREFLIGHT_TIMEOUT (600 s: image pulls and scheduling included).
# Exit status: torchrun's (0 pass, 1 fail), preflight's, or 2 for bad input (one line).
set -u

msg_file="${TERMINATION_LOG:-/dev/termination-log}"

fail() {  # fail MESSAGE: bad input, said once, on stderr and as the termination message
    echo "ddp-smoke: error: $1" | tee "$msg_file" >&2
    exit 2
}

nnodes="" nproc="" endpoint="" node_rank="" report_dir=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nnodes=*) nnodes="${1#*=}" ;;
        --nproc-per-node=*) nproc="${1#*=}" ;;
        --rdzv-endpoint=*) endpoint="${1#*=}" ;;
        --node-rank=*) node_rank="${1#*=}" ;;
        --report-dir=*) report_dir="${1#*=}" ;;
        --) shift; break ;;
        *) fail "pod.sh: unknown option '$1' (expected --nnodes= --nproc-per-node= \
--rdzv-endpoint= --node-rank= --report-dir= [-- worker options])" ;;
    esac
    shift
done
worker=("$@")
for pair in "nnodes=$nnodes" "nproc-per-node=$nproc" "node-rank=$node_rank"; do
    [[ "${pair#*=}" =~ ^[0-9]+$ ]] || fail "pod.sh: --${pair%%=*} '${pair#*=}': expected a \
whole number (is the controller's variable set in this pod?)"
done
[[ "$endpoint" =~ ^[^:]+:[0-9]+$ ]] || fail "pod.sh: --rdzv-endpoint '$endpoint': expected \
HOST:PORT"
[[ -n "$report_dir" ]] || fail "pod.sh: --report-dir is required"
# Both from the manifest's env: the run id every pod of the run shares, the pod's own address.
[[ -n "${DDP_SMOKE_RUN_ID:-}" ]] || fail "pod.sh: DDP_SMOKE_RUN_ID is not set (the manifest's env)"
[[ -n "${POD_IP:-}" ]] || fail "pod.sh: POD_IP is not set (env from fieldRef status.podIP)"
# An Indexed Job writes the node count twice (completions, NNODES): a pod beyond it says so (a
# pod short: the rendezvous host's preflight names the missing node rank).
if [[ "$node_rank" -ge "$nnodes" ]]; then
    fail "pod of node rank $node_rank but --nnodes=$nnodes: the job starts more pods than its \
node count (Indexed Job: set completions and NNODES to the same number)"
fi
host="${endpoint%:*}" port="${endpoint##*:}"
# The rendezvous host says so (is_host), rather than torchrun deciding by resolving the
# endpoint: a DNS answer not there yet would leave every pod a client of a store nobody runs.
is_host=0
[[ "$node_rank" != 0 ]] || is_host=1

# What torchrun gives every rank after the ConfigMap's options (the derived ones win).
worker+=(--report-dir="$report_dir" --expect-nodes="$nnodes"
         --expect-world-size="$((nnodes * nproc))")

# Bad input (a misspelt key or check in the ConfigMap, a fault for a rank the run does not
# have, a report folder that cannot be written) is said here once, in one line, with exit 2,
# before anything starts: the worker's own checks, not every rank's after torchrun started them
# (each under torchrun's traceback, the pod's exit status then 1).
status=0
said=$(python3 -m ddp_smoke.launch_local --check --nproc-per-node="$nproc" --nnodes="$nnodes" \
    -- "${worker[@]}" 2>&1 > /dev/null) || status=$?
[[ -z "$said" ]] || echo "$said" >&2
if [[ $status == 2 ]]; then
    tail -n 1 <<< "$said" > "$msg_file" 2> /dev/null || true
    exit 2
fi

# A report left by an earlier job of this run id (on a shared volume) is never this run's: it
# goes before any rank of this run can write one.
rm -f "$report_dir/report.json" "$report_dir/junit.xml"
echo "ddp-smoke: run $DDP_SMOKE_RUN_ID, report $report_dir/report.json"

# Preflight (python -m ddp_smoke preflight): this pod can run the worker and reaches the
# rendezvous endpoint. The rendezvous host listens there meanwhile and waits for every pod to
# say hello: a pod that never starts (Pending, no image) is named by node rank in its
# termination message, instead of torchrun waiting out join_timeout.
if [[ "${DDP_SMOKE_PREFLIGHT:-1}" != 0 ]]; then
    # each pod's own file: /reports may be one volume that every pod shares (a PVC)
    err="$report_dir/launch/$HOSTNAME.preflight.err"
    mkdir -p "$report_dir/launch"
    serve=()
    [[ $is_host == 0 ]] || serve=(--serve)
    gpus=0
    if command -v nvidia-smi > /dev/null 2>&1; then gpus="$nproc"; fi
    status=0
    python3 -m ddp_smoke preflight --rdzv "$endpoint" --nodes "$nnodes" --gpus "$gpus" \
        --report-dir "$report_dir" --timeout "${DDP_SMOKE_PREFLIGHT_TIMEOUT:-600}" "${serve[@]}" \
        2> "$err" || status=$?
    cat "$err" >&2
    if [[ $status != 0 ]]; then
        tail -n 1 "$err" > "$msg_file" 2> /dev/null || true
        exit "$status"
    fi
fi

# The kit's coordination store in a process of its own on the rendezvous host, at the
# rendezvous port + 1 (python -m ddp_smoke.store_host; every pod finds it through
# DDP_SMOKE_STORE). torchrun's own store lives in that pod's torchrun agent, which leaves when
# its worker dies: with the store elsewhere, rank 0's worker dying takes nothing with it. A
# survivor then writes the report, or, when no rank can, the store host writes it from what the
# store holds, into this pod's report folder. It runs torchrun as its child, passes SIGTERM on,
# and exits once the run is final, with torchrun's status.
export DDP_SMOKE_STORE="$host:$((port + 1))"
store=()
if [[ $is_host == 1 ]]; then
    store=(python3 -m ddp_smoke.store_host --host "$host" --port "$((port + 1))"
           --report-dir "$report_dir" --)
fi
# c10d rendezvous; node ranks follow arrival order, so rank 0 may run in any pod.
# join_timeout bounds the wait for the last pod (image pulls differ per node), read_timeout each
# store connection (60 s by default: too short for such pulls); no reruns. Their stderr goes
# through a pipe they alone hold: it closes when the last of them has ended (see below).
exec {err}> >(cat >&2)
kept=$!
"${store[@]}" torchrun \
    --nnodes="$nnodes" \
    --nproc-per-node="$nproc" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$endpoint" \
    --rdzv-id="$DDP_SMOKE_RUN_ID" \
    --rdzv-conf="join_timeout=600,read_timeout=600,is_host=$is_host" \
    --max-restarts=0 \
    --local-addr="$POD_IP" \
    -m ddp_smoke \
    "${worker[@]}" 2>&"$err" &
pid=$!
exec {err}>&-
# The report into the log as soon as it is written, not only at the pod's end: torchrun's
# agents may wait minutes more (a node cut off waits out their rendezvous and exit-barrier
# timeouts: the campaign's blackhole.store_node.join.trainjob.3x1 logged nothing in 120 s, its
# report written after 28 s), and a TrainJob's users read it nowhere else. Once per pod.
logged="$report_dir/launch/$HOSTNAME.logged"
rm -f "$logged"
log_report() {
    local json
    [[ ! -e "$logged" && -s "$report_dir/report.json" ]] || return 1
    json=$(python3 -m json.tool --compact "$report_dir/report.json" 2> /dev/null) || return 1
    printf 'ddp-smoke-report.json: %s\n' "$json"
    mkdir -p "$report_dir/launch" && : > "$logged"
}
(while ! log_report && kill -0 "$pid" 2> /dev/null; do sleep 1; done) &
watcher=$!
# As PID 1 bash ignores SIGTERM (no default action there): the trap passes pod deletion and
# activeDeadlineSeconds on to torchrun, which stops the workers.
trap 'kill -TERM "$pid" 2> /dev/null' TERM INT
rc=0
wait "$pid" || rc=$?
# wait returns early when the trap ran: wait on until torchrun has exited.
while kill -0 "$pid" 2> /dev/null; do rc=0; wait "$pid" || rc=$?; done
# The store host killed (the OOM killer, an operator): its torchrun and ranks live on, orphans
# of this shell, and say what they know (lost/) once they see the store gone; leaving now, as
# PID 1, would kill them first. They hold the pipe until they end, each by its own deadline
# (the worker's --timeout, 90 s unless given, and torchrun's 30 s after SIGTERM); a frozen one
# is not waited for past that.
timeout=90
for (( i = 0; i < ${#worker[@]}; i++ )); do
    case "${worker[i]}" in
        --timeout=*) timeout="${worker[i]#*=}" ;;
        --timeout) timeout="${worker[i + 1]:-90}" ;;
    esac
done
for (( s = 0; s < ${timeout%.*} + 60; s++ )); do
    kill -0 "$kept" 2> /dev/null || break
    sleep 1
done

# The pod whose rank wrote the report holds report.json (rank 0's pod, a survivor's, or, when
# the store host wrote it, the rendezvous host); every pod does, on a shared volume. The report
# as one log line (`kubectl logs … | grep '^ddp-smoke-report.json: '`), once (the watcher's,
# else now), then the verdict line, which is also the termination message (`kubectl describe
# pod`) and the log's last line.
wait "$watcher" 2> /dev/null
if [[ -s "$report_dir/report.json" ]]; then
    log_report || true
    line=$(python3 -m ddp_smoke last-line "$report_dir/report.json" 2> /dev/null) \
        || line="ddp-smoke: torchrun exit $rc; $report_dir/report.json is unreadable"
else  # ranks here that lost the store left lost/<rank>.json: who went silent
    line=$(python3 -m ddp_smoke last-line --dir "$report_dir" \
               --run-id "$DDP_SMOKE_RUN_ID" 2> /dev/null) \
        || line="ddp-smoke: torchrun exit $rc; no report in this pod: the pod that wrote it logs it"
fi
echo "$line" > "$msg_file" 2> /dev/null || true
echo "$line"
exit "$rc"
