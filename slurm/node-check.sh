#!/bin/bash
# ddp-smoke 0.1.0 node tier on Slurm: `ddp-smoke node-check --act slurm-drain` on this node.
# (docs/continuous.md; `python -m ddp_smoke node-check --help` is the manual.)
#
# slurm.conf, on every node (then `scontrol reconfigure`):
#   HealthCheckProgram=/opt/ddp-smoke/slurm/node-check.sh   # EDIT: where this file is
#   HealthCheckInterval=300            # seconds between checks
#   HealthCheckNodeState=IDLE,CYCLE    # idle nodes only (no job to disturb), spread over the
#                                      # interval instead of every node at once
# or before every job, on the job's nodes:
#   Prolog=/opt/ddp-smoke/slurm/node-check.sh
#   PrologFlags=Alloc                  # at allocation, before the job's first step
#
# slurmd runs it as root with an empty environment (SLURMD_NODENAME only), and kills a
# HealthCheckProgram after 60 s: the settings are the variables below, or node-check.conf
# beside this file, a shell fragment sourced last (PYTHON=…, REPORT_ROOT=…, and any variable
# the node needs: export SLURM_CONF=…, export GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=…).
#
# A failing node is drained with Reason="ddp-smoke node-check: <check>: <finding>"; a passing
# one is resumed only when that is its drain reason (never a node drained by hand); more than
# fleet.drain_max_share of the cluster drained by the kit stops it draining (a shared cause).
# Exit status: 0 pass, 1 fail (a Prolog's non-zero status also makes Slurm requeue the job
# elsewhere), 2 bad input.

set -u

PYTHON=/opt/ddp-smoke/venv/bin/python      # EDIT: a python with ddp_smoke installed
REPORT_ROOT=/var/lib/ddp-smoke/node-check  # EDIT: each run's folder; shared by all nodes,
                                           # `ddp-smoke history REPORT_ROOT` sees the fleet
TIMEOUT=45                                 # seconds for the whole check (Slurm's limit: 60)
ARGS=()                                    # more node-check options, then -- worker options,
                                           # e.g. ARGS=(-- --profile h200-8gpu)

conf="$(dirname "$0")/node-check.conf"
# shellcheck source=/dev/null  # the site's own file, beside this one
[ -r "$conf" ] && . "$conf"
export PATH=${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}
mkdir -p "$REPORT_ROOT"

exec "$PYTHON" -m ddp_smoke node-check --act slurm-drain \
  --node "${SLURMD_NODENAME:-$(hostname -s)}" --report-root "$REPORT_ROOT" \
  --timeout "$TIMEOUT" "${ARGS[@]}"
