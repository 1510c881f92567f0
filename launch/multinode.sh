#!/usr/bin/env bash
# Multi-node training through the DeepSpeed launcher (pdsh over ssh), the way users run it:
#
#   launch/multinode.sh HOSTFILE CONFIG [a.b=value ...]
#
# runs, from the current directory (which every node must also have: a shared file system):
#   deepspeed --hostfile HOSTFILE --master_addr <first host> --master_port 29500 \
#             --module moe_train train --config CONFIG [a.b=value ...]
# pdsh starts one launcher per node over ssh; each does `cd <this directory>` and runs this
# checkout's .venv python (the same absolute path must exist on every node).
#
# Environment: MASTER_PORT (default 29500; the master is the first host of HOSTFILE);
# NUM_NODES / NUM_GPUS to use fewer nodes / slots than HOSTFILE lists; DEEPSPEED, the launcher
# to run (default: this checkout's .venv/bin/deepspeed, else the one on PATH). Remote nodes get
# PYTHON* variables and those listed in ./.deepspeed_env or ~/.deepspeed_env (KEY=value lines).
# On CPU-only nodes each slot is one process on the gloo backend. See launch/README.md.
set -euo pipefail
prog=${0##*/}
die() { echo "$prog: error: $*" >&2; exit 2; }
if [ $# -lt 2 ]; then
  echo "usage: $prog HOSTFILE CONFIG [a.b=value ...]" >&2
  exit 2
fi
hostfile=$1; config=$2; shift 2
[ -f "$hostfile" ] || die "$hostfile: hostfile not found"
[ -f "$config" ] || die "$config: config not found"
abspath() { printf '%s/%s\n' "$(cd "$(dirname "$1")" && pwd)" "$(basename "$1")"; }
# Absolute, so that they name the same files whatever directory the launcher runs in.
hostfile=$(abspath "$hostfile"); config=$(abspath "$config")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Hosts as DeepSpeed reads them: "host slots=N" lines; '#' comments and blank lines skipped.
hosts=()
while read -r host slots _ || [ -n "${host:-}" ]; do
  slots=${slots%$'\r'}; host=${host%$'\r'}
  case $host in ''|'#'*) continue ;; esac
  [[ $slots =~ ^slots=[0-9]+$ ]] || die "$hostfile: bad line '$host${slots:+ $slots}' (expected 'host slots=N')"
  for seen in ${hosts[@]+"${hosts[@]}"}; do
    [ "$seen" != "$host" ] || die "$hostfile: host '$host' listed twice (expected one 'host slots=N' line per host)"
  done
  hosts+=("$host")
done < "$hostfile"
[ ${#hosts[@]} -gt 0 ] || die "$hostfile: no host lines (expected 'host slots=N')"
nodes=${#hosts[@]}
if [ -n "${NUM_NODES:-}" ]; then
  [[ $NUM_NODES =~ ^[1-9][0-9]*$ ]] || die "NUM_NODES=$NUM_NODES: expected a positive integer"
  [ "$NUM_NODES" -le "$nodes" ] || die "NUM_NODES=$NUM_NODES but $hostfile lists $nodes host(s)"
  nodes=$NUM_NODES
fi
[ -z "${NUM_GPUS:-}" ] || [[ $NUM_GPUS =~ ^[1-9][0-9]*$ ]] || die "NUM_GPUS=$NUM_GPUS: expected a positive integer"

deepspeed=${DEEPSPEED:-$here/.venv/bin/deepspeed}
if [ ! -x "$deepspeed" ]; then
  [ -z "${DEEPSPEED:-}" ] && deepspeed=$(command -v deepspeed || true)
  [ -n "$deepspeed" ] && [ -x "$deepspeed" ] \
    || die "deepspeed launcher not found (${DEEPSPEED:-$here/.venv/bin/deepspeed}): run 'make setup' or set DEEPSPEED"
fi

# DeepSpeed turns each line of .deepspeed_env into 'export KEY=value;' in the remote command:
# a blank line crashes it and a '#' line comments out the rest of the remote command.
envfiles=("$HOME/${DS_ENV_FILE:-.deepspeed_env}" "./${DS_ENV_FILE:-.deepspeed_env}")
case ${DS_ENV_FILE:-} in /*) envfiles=("$DS_ENV_FILE") ;; esac  # DeepSpeed reads it as given
for envfile in "${envfiles[@]}"; do
  [ -f "$envfile" ] || continue
  bad=$(grep -nvE '^[A-Za-z_][A-Za-z0-9_]*=' "$envfile" | head -n 1 || true)
  [ -z "$bad" ] || die "$envfile:${bad%%:*}: expected KEY=value lines only (no blank or comment lines)"
done

# One host that is not this machine is also reached over pdsh (--force_multi): DeepSpeed would
# otherwise train here, the launching machine, with the master address of that host.
local_host() {
  case $1 in localhost|127.*|"$(hostname)"|"$(hostname -f 2>/dev/null)"|"$(hostname -s 2>/dev/null)") return 0 ;; esac
  return 1
}
over_pdsh=0
[ "$nodes" -gt 1 ] && over_pdsh=1
[ "$nodes" -eq 1 ] && ! local_host "${hosts[0]}" && over_pdsh=1

args=("$config" "$@")
if [ "$over_pdsh" -eq 1 ]; then
  command -v pdsh >/dev/null || die "pdsh not found: the multi-node launch runs 'pdsh -w HOSTS' (install pdsh)"
  # pdsh hands the remote login shell one command line: DeepSpeed double-quotes arguments that
  # contain spaces and passes the others as they are, so the remote shell would glob or expand
  # a.b=[x,y] (zsh: "no matches found"), $VAR, quotes, ';'. Quote them for that shell; and pdsh
  # itself replaces %h, %n, %u (per node), so every % is doubled to reach the node as typed.
  for i in "${!args[@]}"; do
    a=${args[$i]}
    if [[ $a == *" "* ]]; then         # DeepSpeed adds "..." and escapes '"'; escape the rest
      a=${a//\\/\\\\}; a=${a//\$/\\\$}; a=${a//\`/\\\`}
    elif [[ $a =~ [^A-Za-z0-9_@%+=:,./-] ]]; then
      a="'${a//\'/\'\\\'\'}'"
    fi
    args[$i]=${a//%/%%}
  done
fi
config=${args[0]}; args=(${args[@]+"${args[@]:1}"})

extra=()
[ "$over_pdsh" -eq 1 ] && [ "$nodes" -eq 1 ] && extra+=(--force_multi)
[ -n "${NUM_NODES:-}" ] && extra+=(--num_nodes "$NUM_NODES")
[ -n "${NUM_GPUS:-}" ] && extra+=(--num_gpus "$NUM_GPUS")
# ${a[@]+"${a[@]}"}: empty arrays are "unbound" under set -u in bash < 4.4.
exec "$deepspeed" --hostfile "$hostfile" --master_addr "${hosts[0]}" \
  --master_port "${MASTER_PORT:-29500}" ${extra[@]+"${extra[@]}"} \
  --module moe_train train --config "$config" ${args[@]+"${args[@]}"}
