#!/usr/bin/env bash
# ddp-smoke image entrypoint: turns `docker run IMAGE [ARGS]` into a torchrun launch of the worker.
#
#   docker run IMAGE                              single-node smoke: torchrun --standalone,
#                                                 one rank per visible GPU (2 ranks on CPU)
#   docker run IMAGE -- --checks ddp_step         the same, with worker options after `--`
#   docker run IMAGE --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
#                    --rdzv-id=JOB --local-addr=ADDR -- --expect-nodes 2
#                                                 launchers: torchrun options, then `--`, then
#                                                 worker options (see `python -m ddp_smoke --help`)
#   docker run IMAGE bash | python … | torchrun … anything not starting with `-` runs as given
#
# Defaults added only when absent (so a launcher's own value always wins):
#   --standalone --local-addr=127.0.0.1   when no torchrun option is given at all
#   --nproc-per-node=gpu|2     unless given or PET_NPROC_PER_NODE is set (torchrun reads it)
#   --report-dir $DDP_SMOKE_REPORT_DIR, else $DDP_SMOKE_REPORT_ROOT/<run id> (image default
#                              /reports/<run id>: one folder per run, never a previous run's
#                              report.json; set both empty to leave the worker's own default or a
#                              --config file's value alone)
# The run id (exported as DDP_SMOKE_RUN_ID, which the worker reports as its run_id): the given
# DDP_SMOKE_RUN_ID, else torchrun's --rdzv-id (shared by every node), else one made here.
#
# Runtime defaults, set here and not as image ENV: under pyxis/enroot and Apptainer an image's
# ENV wins over the job's own environment, so `NCCL_DEBUG=INFO sbatch …` would silently lose.
set -euo pipefail

# 1: an NCCL error or timeout aborts the rank (and so the job) instead of leaving it hanging.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# NCCL_DEBUG stays unset: the worker then logs NCCL at INFO into REPORT_DIR/nccl/ to prove which
# transport NCCL used (see the transport check); a value given here is used as it is.

# A command, not options: run it as is (shells, debugging, Kubernetes `command:` overrides).
if [[ $# -gt 0 && "$1" != -* ]]; then
    exec "$@"
fi

torchrun_args=()
worker_args=()
while [[ $# -gt 0 ]]; do
    if [[ "$1" == "--" ]]; then
        shift
        worker_args=("$@")
        break
    fi
    torchrun_args+=("$1")
    shift
done

has_option() {  # has_option NAME ARGS…: true when ARGS contain --NAME or --NAME=…
    local name="$1" arg
    shift
    for arg in "$@"; do
        [[ "$arg" == "--$name" || "$arg" == "--$name="* ]] && return 0
    done
    return 1
}

# One node: everything stays on loopback. Without --local-addr torchrun advertises the hostname,
# which does not resolve in every container (`--network none` has no entry for it) and then
# stalls for the store's 300 s connect timeout.
if [[ ${#torchrun_args[@]} -eq 0 ]]; then
    torchrun_args=(--standalone --local-addr=127.0.0.1)
    # The run's signing secret (every store record is signed with it). One node: made here.
    # Several containers: the launcher gives every one the same DDP_SMOKE_SECRET.
    DDP_SMOKE_SECRET="${DDP_SMOKE_SECRET:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}"
    export DDP_SMOKE_SECRET
fi

# nvidia-smi is mounted by the NVIDIA container toolkit only when GPUs are given (--gpus);
# torchrun's "gpu" then counts the devices torch can use (CUDA_VISIBLE_DEVICES included).
if ! has_option nproc-per-node "${torchrun_args[@]}" \
        && ! has_option nproc_per_node "${torchrun_args[@]}" \
        && [[ -z "${PET_NPROC_PER_NODE:-}" ]]; then
    if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2> /dev/null | grep -q '^GPU '; then
        torchrun_args+=(--nproc-per-node=gpu)
    else
        torchrun_args+=(--nproc-per-node=2)
    fi
fi

option_value() {  # option_value NAME ARGS…: the value of --NAME=V or --NAME V, else nothing
    local name="$1"
    shift
    while [[ $# -gt 0 ]]; do
        case "$1" in
            "--$name="*) echo "${1#*=}"; return 0 ;;
            "--$name") echo "${2:-}"; return 0 ;;
        esac
        shift
    done
}

run_id="${DDP_SMOKE_RUN_ID:-$(option_value rdzv-id "${torchrun_args[@]}")}"
run_id="${run_id:-$(option_value rdzv_id "${torchrun_args[@]}")}"
export DDP_SMOKE_RUN_ID="${run_id:-$(date -u +%Y%m%dT%H%M%SZ)-${HOSTNAME:-host}-$$}"

report_dir="${DDP_SMOKE_REPORT_DIR:-}"
if [[ -z "$report_dir" && -n "${DDP_SMOKE_REPORT_ROOT:-}" ]]; then
    report_dir="$DDP_SMOKE_REPORT_ROOT/$DDP_SMOKE_RUN_ID"
fi
# The worker's own --report-dir, when given, is where its report is looked for: the launcher's
# (a failed preflight, a torchrun that ended without one) goes there too.
given="$(option_value report-dir "${worker_args[@]}")"
report_dir="${given:-${report_dir}}"
added_report_dir=0
if [[ -n "$report_dir" ]] \
        && ! has_option report-dir "${worker_args[@]}" \
        && ! has_option report_dir "${worker_args[@]}"; then
    worker_args+=(--report-dir "$report_dir")
    added_report_dir=1
fi

# Bad input (a misspelt check or flag, a fault for a rank the run does not have, a report folder
# that cannot be written) is said here once, in one line, with exit 2, before anything starts:
# the worker's own checks (python -m ddp_smoke.launch_local --check), not every rank's after
# torchrun started them, whose agent then exits 1 under its own traceback. Any other failure of
# the check (the kit does not run here) is preflight's to name, below.
# (the worker's --help or --version: said once, nothing launched)
if has_option help "${worker_args[@]}" || has_option version "${worker_args[@]}" \
        || [[ " ${worker_args[*]} " == *" -h "* ]]; then
    exec python -m ddp_smoke "${worker_args[@]}"
fi
nproc=$(option_value nproc-per-node "${torchrun_args[@]}")
nproc="${nproc:-$(option_value nproc_per_node "${torchrun_args[@]}")}"
nnodes=$(option_value nnodes "${torchrun_args[@]}")
status=0
python -m ddp_smoke.launch_local --check --nproc-per-node="${nproc:-${PET_NPROC_PER_NODE:-gpu}}" \
    --nnodes="${nnodes:-${PET_NNODES:-1}}" -- "${worker_args[@]}" || status=$?
[[ $status -ne 2 ]] || exit 2
[[ $added_report_dir == 0 ]] || echo "ddp-smoke: run $DDP_SMOKE_RUN_ID, report $report_dir/report.json" >&2

# The launcher's side of the verdict, for this node (ddp_smoke/outputs/launch_report.py): when
# preflight fails or torchrun ends without this run's report, it writes one naming this node
# and the first error printed here, and its line is the log's last.
node="${NODE_NAME:-${HOSTNAME:-$(hostname)}}"
verdict() {  # verdict STAGE STATUS
    [[ -n "$report_dir" ]] || return 0  # no folder of our own: the worker's default applies
    python -m ddp_smoke launch-report --launcher docker --stage "$1" --exit "$2" \
        --report-dir "$report_dir" --nodes "$node" || true
}
[[ -z "$report_dir" ]] || mkdir -p "$report_dir/launch"

# Where torchrun's rendezvous host is (store_host --plan decides it as torchrun does: "host" on
# that node, else "join"; the address is the kit's store's, the endpoint's port + 1): read once,
# for preflight's hello and for the store host below. A store asked for where the options name
# no endpoint is bad input there; preflight then says no hello.
count="${nnodes:-${PET_NNODES:-1}}"
hellos=0
[[ "${DDP_SMOKE_PREFLIGHT:-1}" == 0 || ! "$count" =~ ^[0-9]+$ || "$count" -le 1 ]] || hellos=1
role="" address="" plan=""
if [[ $hellos == 1 || "${DDP_SMOKE_STORE:-}" == auto \
        || " ${torchrun_args[*]} " == *" --standalone "* ]]; then
    plan=$(python -m ddp_smoke.store_host --plan "${torchrun_args[@]}" 2>&1) \
        && read -r role address <<< "$plan"
fi

# Preflight: in seconds, can this node run the worker at all (kit and torch import, CUDA and
# its GPUs, the interfaces named in NCCL_/GLOO_SOCKET_IFNAME, the report folder)? With a fixed
# count of several nodes, each also says hello to the rendezvous host (the node torchrun makes
# it, as store_host --plan decides), trying as long as torchrun's rendezvous would (600 s, or
# --rdzv-conf's join_timeout: nodes started by hand start minutes apart). The host's preflight
# listens on the rendezvous port meanwhile, DDP_SMOKE_HELLO_WAIT (20) s at most: a node whose
# hello failed, or whose path drops large packets (the 64 KiB after it), is named there and by
# the host before torchrun's rendezvous would wait out its join timeout; a node that never
# says hello (started later, or torchrun without preflight) is not waited for longer.
HELLO_WAIT_S="${DDP_SMOKE_HELLO_WAIT:-20}"
# DDP_SMOKE_PREFLIGHT=0 leaves it out; DDP_SMOKE_PREFLIGHT_TIMEOUT bounds it (60 s, one node).
if [[ "${DDP_SMOKE_PREFLIGHT:-1}" != 0 ]]; then
    gpus=0
    if command -v nvidia-smi > /dev/null 2>&1; then
        gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ' || true)
    fi
    hello=()
    if [[ $hellos == 1 && -n "$address" ]]; then
        hello=(--rdzv "${address%:*}:$(( ${address##*:} - 1 ))" --nodes "$count")
        [[ "$role" != host ]] || hello+=(--serve --hello-wait "$HELLO_WAIT_S")
    fi
    # (the rendezvous' join timeout when --rdzv-conf gives one, at least the 60 s a torch
    # import and CUDA initialisation may take)
    conf="$(option_value rdzv-conf "${torchrun_args[@]}"),$(option_value rdzv_conf \
                                                               "${torchrun_args[@]}")"
    joins=$(grep -oE '(^|,)join_timeout=[0-9]+' <<< "$conf" | grep -oE '[0-9]+$' || true)
    wait_s=60
    [[ ${#hello[@]} == 0 ]] || wait_s=$(( ${joins:-600} > 60 ? ${joins:-600} : 60 ))
    preflight=(python -m ddp_smoke preflight --node "$node" --gpus "$gpus" "${hello[@]}"
               --timeout "${DDP_SMOKE_PREFLIGHT_TIMEOUT:-$wait_s}")
    [[ -z "$report_dir" ]] || preflight+=(--report-dir "$report_dir")
    status=0
    "${preflight[@]}" || status=$?
    if [[ $status -ne 0 ]]; then
        verdict preflight "$status"
        exit "$status"
    fi
fi

# The coordination store in a process of its own (python -m ddp_smoke.store_host),
# so that rank 0's death does not take it down: a survivor writes the report, or the store host
# when every rank is gone. One node: always. Several: when the launcher sets
# DDP_SMOKE_STORE=auto on every node; the node that hosts torchrun's rendezvous (is_host, or
# the --rdzv-endpoint names it) runs it on the endpoint's port + 1, and every node derives the
# same address from the same endpoint (nodes started otherwise must then set it too).
store=()
if [[ "${DDP_SMOKE_STORE:-}" == auto || " ${torchrun_args[*]} " == *" --standalone "* ]]; then
    [[ -n "$address" ]] || { echo "$plan" >&2; exit 2; }
    export DDP_SMOKE_STORE="$address"
    if [[ "$role" == host ]]; then
        # (its report of last resort goes where the ranks said they write theirs)
        store=(python -m ddp_smoke.store_host --host "${address%:*}" --port "${address##*:}" --)
    fi
fi

# Printed so that a pod or job log shows exactly what ran.
echo "+ ${store[*]:+${store[*]} }torchrun ${torchrun_args[*]} -m ddp_smoke ${worker_args[*]}" >&2
if [[ -z "$report_dir" ]]; then
    exec "${store[@]}" python -m torch.distributed.run "${torchrun_args[@]}" -m ddp_smoke \
        "${worker_args[@]}"
fi
# torchrun as a child, its stderr kept for the verdict. As PID 1 bash ignores SIGTERM (docker
# stop, the kubelet): the trap passes it on; torchrun stops its workers.
exec {err}> >(tee "$report_dir/launch/$node.run.err" >&2 2> /dev/null)  # (as the sbatch's)
kept=$!
"${store[@]}" python -m torch.distributed.run "${torchrun_args[@]}" -m ddp_smoke \
    "${worker_args[@]}" 2>&"$err" &
pid=$!
exec {err}>&-  # the pipe is theirs alone now: it closes when the last of them has ended
trap 'kill -TERM "$pid" 2> /dev/null' TERM INT
status=0
wait "$pid" || status=$?
while kill -0 "$pid" 2> /dev/null; do status=0; wait "$pid" || status=$?; done
# The store host killed (the OOM killer, an operator): its torchrun and ranks live on, orphans
# of this shell, and say what they know (lost/) once they see the store gone; leaving now, as
# PID 1, would kill them first. They hold the pipe until they end, each by its own deadline
# (torchrun gives its workers 30 s after SIGTERM); a frozen one is not waited for past that.
timeout=$(option_value timeout "${worker_args[@]}")
timeout="${timeout:-90}"  # (the worker's default)
linger=$(( ${timeout%.*} + 60 ))
for (( s = 0; s < linger; s++ )); do kill -0 "$kept" 2> /dev/null || break; sleep 1; done
# A worker that ran and failed shows in torchrun's failure block ("exitcode : …"), printed after
# the worker's verdict: the run's line comes again after it, as the output's last line (its
# report here; without one, rank 0's node holds it). Only a torchrun that started no worker
# (the rendezvous failed, torch did not import) leaves the verdict to this node.
if [[ $status -ne 0 ]] && ! grep -qs 'exitcode' "$report_dir/launch/$node.run.err"; then
    verdict run "$status"
elif [[ $status -ne 0 ]]; then
    python -m ddp_smoke last-line --dir "$report_dir" --run-id "$DDP_SMOKE_RUN_ID" 2> /dev/null \
        || echo "ddp-smoke: torchrun exit $status on $node; no report here: rank 0's node" \
                "holds it ($report_dir/report.json there)"
fi
exit "$status"
