#!/usr/bin/env bash
# Multi-node training through the DeepSpeed launcher (pdsh over ssh), the way users run it:
#
#   launch/multinode.sh HOSTFILE CONFIG [a.b=value ...]
#
# runs, from the first node of HOSTFILE:
#   deepspeed --hostfile HOSTFILE --master_addr <first host> --master_port 29500 \
#             --module moe_train train --config CONFIG [a.b=value ...]
# Set MASTER_PORT to change the port; NUM_NODES / NUM_GPUS to use fewer than the hostfile lists.
# On CPU-only nodes each slot is one process on the gloo backend.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 HOSTFILE CONFIG [a.b=value ...]" >&2
  exit 2
fi
hostfile=$1; config=$2; shift 2
[ -f "$hostfile" ] || { echo "error: $hostfile: hostfile not found" >&2; exit 2; }
[ -f "$config" ] || { echo "error: $config: config not found" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
master=$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$hostfile")
[ -n "$master" ] || { echo "error: $hostfile: no host lines (expected 'host slots=N')" >&2; exit 2; }
extra=()
[ -n "${NUM_NODES:-}" ] && extra+=(--num_nodes "$NUM_NODES")
[ -n "${NUM_GPUS:-}" ] && extra+=(--num_gpus "$NUM_GPUS")
cd "$here"
exec "$here/.venv/bin/deepspeed" --hostfile "$hostfile" --master_addr "$master" \
  --master_port "${MASTER_PORT:-29500}" "${extra[@]}" \
  --module moe_train train --config "$config" "$@"
