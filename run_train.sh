#!/usr/bin/env bash
# Train from a recipe: ./run_train.sh [RECIPE.toml] [--section.field=VALUE ...]
#
# Launch variables (the only environment that matters; the recipe holds everything computed):
#   NGPU           processes on this node (default: the GPU count, else 1 CPU process)
#   NNODES         nodes in the job (default 1)
#   RDZV_ENDPOINT  host:port of the c10d rendezvous (node 0), required when NNODES > 1
#   RDZV_ID        the job's name at that rendezvous (default nsa_titan): two jobs sharing an endpoint need two
# Other commands of the nsa-titan tool (inspect, doctor, ...) run as: ./run_train.sh COMMAND ARGS, exactly as
# `nsa-titan COMMAND ARGS` (train alone defaults to recipes/debug.toml).
set -euo pipefail
# A scheduler's stop or a terminal's Ctrl-C before the ranks start ends the launch (once the set-up or recipe check
# under way is done), saying so: a Ctrl-C during the set-up ended it in silence. The launch replaces these traps.
stopped_early() { echo "error: stopped before any rank started; nothing ran." >&2; exit $((128 + $1)); }
trap 'stopped_early 15' TERM
trap 'stopped_early 1' HUP
trap 'stopped_early 2' INT
root=$(cd "$(dirname "$0")" && pwd)
py=$("$root/scripts/ensure_env.sh")
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

command=train
case "${1:-}" in
  train|inspect|doctor|export|sample|plot|eval|recipes) command=$1; shift ;;
  ''|-*|*.toml) ;;
  # Neither a command nor a recipe file: the CLI names the commands (e.g. for 'evaluate').
  *) [ -e "$1" ] || exec "$py" -m nsa_titan.cli "$@" ;;
esac
if [ "$command" != train ]; then
  exec "$py" -m nsa_titan.cli "$command" "$@"
fi
has_recipe=0  # a recipe anywhere among the arguments (flags may come first), not an override's value
previous=""
value=""  # a '--section.field VALUE' flag's value: files beside it with its extension are what a pattern expanded to
extension() { local name=${1##*/}; case "$name" in *.*) echo ".${name##*.}" ;; *) echo "" ;; esac; }
beside_value() {
  [ -n "$value" ] && [ "$(dirname -- "$1")" = "$(dirname -- "$value")" ] &&
    [ "$(extension "$1")" = "$(extension "$value")" ]
}
for arg in "$@"; do
  case "$arg" in
    -*) value="" ;;
    *) case "$previous" in
         --*=*) ;;  # an override with its value: this argument stands alone
         --*.*) previous=""; value=$arg; continue ;;  # '--section.field VALUE': this is the value
       esac
       if [[ "$arg" == *.toml || "$arg" == *.TOML ]] || [ -d "$arg" ]; then has_recipe=1
       elif [ -e "$arg" ] && ! beside_value "$arg"; then has_recipe=1; fi ;;  # the CLI names a pattern's files
  esac
  previous=$arg
done
if [ "$has_recipe" -eq 0 ]; then
  set -- "$root/recipes/debug.toml" "$@"
fi
for arg in "$@"; do
  case "$arg" in --help|-h) exec "$py" -m nsa_titan.cli train "$@" ;; esac
done

if [ -z "${NGPU:-}" ]; then
  # The GPUs this process may use (CUDA_VISIBLE_DEVICES respected), else one CPU process.
  NGPU=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  [ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1
fi
NNODES=${NNODES:-1}
# Each launch variable is a whole number in its range, or the launch stops here naming it.
check_count() {  # NAME VALUE MIN
  case "$2" in
    ''|*[!0-9]*) echo "error: $1=$2 is not a whole number. Fix: set $1 to a number of at least $3, or unset it." >&2
                 exit 2 ;;
  esac
  if [ "$((10#$2))" -lt "$3" ]; then
    echo "error: $1=$2 must be at least $3. Fix: set $1 to a number of at least $3, or unset it." >&2
    exit 2
  fi
}
check_count NGPU "$NGPU" 1
check_count NNODES "$NNODES" 1
NGPU=$((10#$NGPU)) NNODES=$((10#$NNODES))
if [ "$NNODES" -eq 1 ]; then
  for name in RDZV_ENDPOINT RDZV_ID; do  # a node of a multi-node job started without NNODES would train alone
    if [ -n "${!name:-}" ]; then
      echo "error: $name is set but NNODES is 1, so this launch would train alone. Fix: set NNODES to the job's node count, or unset $name." >&2
      exit 2
    fi
  done
elif [ -n "${NODE_RANK:-}" ]; then
  echo "note: NODE_RANK is not used: the c10d rendezvous numbers the nodes itself, by host name (rank 0, which logs and writes the run's records, is on the node whose name sorts first)." >&2
fi
for arg in "$@"; do  # the recipe as this launch would run it: checked for its world size
  case "$arg" in --print-config) WORLD_SIZE=$((NGPU * NNODES)) exec "$py" -m nsa_titan.cli train "$@" ;; esac
done
export PYTHONUNBUFFERED=1
if [ "$NGPU" -eq 1 ] && [ "$NNODES" -eq 1 ]; then
  # One process needs no launcher; its own exit code (2 bad input, 3 NaN stop, 4 out of device memory,
  # 124 hang) comes back.
  exec "$py" -m nsa_titan.cli train "$@"
fi
# Check the recipe once, for the whole job's world size, before starting any process. A Ctrl-C during a check is
# said by the check, which exits 130; one between the checks is noted here and said before the next step.
interrupted=0
trap 'interrupted=1' INT
stop_if_interrupted() { [ "$interrupted" -eq 0 ] || stopped_early 2; }
config=$(WORLD_SIZE=$((NGPU * NNODES)) "$py" -m nsa_titan.cli train "$@" --print-config) || exit $?
stop_if_interrupted
# The node's devices, checked once here (not once per rank); the run's folder, for a stop request's halt file.
dump=$("$py" -m nsa_titan.launch_check "$NGPU" <<< "$config") || exit $?  # one process: it says a Ctrl-C itself
stop_if_interrupted
if [ "$NNODES" -gt 1 ]; then
  if [ -z "${RDZV_ENDPOINT:-}" ]; then
    echo "error: NNODES=$NNODES needs RDZV_ENDPOINT, the host:port every node meets at. Fix: set RDZV_ENDPOINT=host:port of node 0 (the same on every node)." >&2
    exit 2
  fi
  port=${RDZV_ENDPOINT##*:} host=${RDZV_ENDPOINT%:*}
  if [ "$host" = "$RDZV_ENDPOINT" ] || [ -z "$host" ] || ! [[ "$port" =~ ^[0-9]+$ ]] || [ "$((10#$port))" -lt 1 ] || [ "$((10#$port))" -gt 65535 ]; then
    echo "error: RDZV_ENDPOINT=$RDZV_ENDPOINT is not host:port (a port from 1 to 65535). Fix: set RDZV_ENDPOINT=host:port of node 0, e.g. node0:29500." >&2
    exit 2
  fi
  if ! "$py" -c 'import socket, sys; socket.getaddrinfo(sys.argv[1].strip("[]"), None)' "$host" 2>/dev/null; then
    stop_if_interrupted  # a Ctrl-C during a slow lookup is not a host that is not known
    echo "error: RDZV_ENDPOINT=$RDZV_ENDPOINT: the host '$host' is not known here. Fix: give node 0's address or a name this node resolves." >&2
    exit 2
  fi
  launcher=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="${RDZV_ID:-nsa_titan}")
  echo "run_train.sh: waiting at $RDZV_ENDPOINT for the $NNODES nodes to join (torchrun's rendezvous gives up after 600 s)." >&2
else
  launcher=(--standalone)
fi

# A stop request (SIGTERM from a scheduler, Ctrl-C, hang-up) becomes the halt file: every rank
# finishes its step, saves and exits 0, however long the save takes, and torchrun exits 0 with
# them (nsa_titan.launch is torchrun ending a failure with one line and the failed rank's exit code).
# torchrun runs in its own session so that the request reaches this script alone (torchrun
# itself would kill its workers 30 s after a signal). A second request ends every process at once,
# saving nothing, as a second Ctrl-C does to one process.
own_session=()
command -v setsid >/dev/null 2>&1 && own_session=(setsid)  # without it, a group signal reaches torchrun too
stop_if_interrupted
${own_session[@]+"${own_session[@]}"} "$py" -m nsa_titan.launch "${launcher[@]}" --nproc_per_node="$NGPU" \
  -m nsa_titan.cli train "$@" &
child=$!
stopping=0
stopped_by=""
children_of() {  # PID: its child processes (pgrep where procps is installed, else Linux's /proc)
  if command -v pgrep >/dev/null 2>&1; then pgrep -P "$1" 2>/dev/null || true
  else cat /proc/"$1"/task/*/children 2>/dev/null || true; fi
}
ranks_seen=0  # whether the launcher has started its ranks (seen by the wait loop below, or by request_stop)
request_stop() {  # SIGNAL_NUMBER
  if [ "$ranks_seen" -eq 0 ] && [ "$stopping" -eq 0 ]; then
    kill -STOP "$child" 2>/dev/null || true  # frozen: no rank starts while this looks
    if [ -z "$(children_of "$child")" ]; then  # none ever started (the nodes may still be meeting): nothing to save
      { kill -KILL "$child"; wait "$child"; } 2>/dev/null || true
      echo "error: stopped before any rank started; nothing ran." >&2
      exit $((128 + $1))
    fi
    ranks_seen=1
    kill -CONT "$child" 2>/dev/null || true
  fi
  if [ "$stopping" -eq 0 ]; then
    stopping=1
    mkdir -p "$dump" && : > "$dump/HALT"
    echo "run_train.sh: stop requested; every rank stops after its current step and saves. Again to stop now." >&2
  elif [ -z "$stopped_by" ]; then
    stopped_by=$1
    # torchrun, frozen first, neither restarts nor reports the ranks it loses. It starts each rank in a session
    # of its own (with its loader workers): those groups go, then torchrun. (A rank whose launcher is gone
    # would otherwise stop with a save, which this request refuses to wait for.)
    kill -STOP "$child" 2>/dev/null || true
    for rank in $(children_of "$child"); do
      kill -KILL -- "-$rank" 2>/dev/null || kill -KILL "$rank" 2>/dev/null || true
    done
    # Reaped here, stderr closed around both: bash's "Killed" job line for it, printed at whichever command
    # follows its end, goes nowhere (the line below says what happened).
    { kill -KILL "$child"; wait "$child"; } 2>/dev/null || true
    # The ranks' stack dump files no dump went to (they remove their own at a clean end, which this is not).
    find "$dump/stacks" -maxdepth 1 -type f -name 'rank-*.txt' -empty -delete 2>/dev/null || true
    rmdir "$dump/stacks" 2>/dev/null || true
  fi
}
trap 'request_stop 15' TERM
trap 'request_stop 2' INT
trap 'request_stop 1' HUP
[ "$interrupted" -eq 0 ] || request_stop 2  # a Ctrl-C between the last check and these traps
forward_to_ranks() {  # SIGNAL: `kill -USR1` of this script dumps every rank's stacks (its default would end it)
  for rank in $(children_of "$child"); do kill "-$1" "$rank" 2>/dev/null || true; done
}
trap 'forward_to_ranks USR1' USR1
while [ "$ranks_seen" -eq 0 ] && kill -0 "$child" 2>/dev/null; do  # until the ranks start (a second each)
  [ -z "$(children_of "$child")" ] || ranks_seen=1
  [ "$ranks_seen" -eq 1 ] || { sleep 1 & wait $! 2>/dev/null || true; }  # a signal's trap runs at once
done
while :; do
  rc=0
  wait "$child" 2>/dev/null || rc=$?  # its end by a signal is said below, not as bash's "Killed" job line
  kill -0 "$child" 2>/dev/null || break  # returned for a signal: the launcher is still running
done
# A halt the run never read (it had already ended) must not stop the next run.
[ "$stopping" -eq 0 ] || rm -f "$dump/HALT"
if [ -n "$stopped_by" ]; then
  echo "error: train interrupted at once: nothing was saved since the last complete checkpoint: a rerun resumes from it, or starts afresh where there is none." >&2
  exit $((128 + stopped_by))
fi
exit "$rc"
