#!/usr/bin/env bash
#SBATCH --job-name=megatron-rl-grpo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --signal=B:TERM@120
#
# GRPO on a Slurm allocation: one Ray node per Slurm node, then `megatron-rl train` on the first node.
#
#   sbatch [--nodes N --gpus-per-node G --time T ...] launch/slurm_grpo.sh CONFIG.yaml [key.path=value ...]
#
# sbatch's own flags override the #SBATCH defaults above (--signal asks Slurm for a SIGTERM two minutes before the
# time limit, so the job tears down cleanly instead of being killed). The script appends cluster.ray_address, cluster.num_nodes
# and cluster.devices_per_node (they describe the allocation, so they win over the config). Environment knobs (all
# optional; srun passes the environment to every node):
#   GPUS_PER_NODE     GPUs given to Ray per node (default: from Slurm, else 0)
#   CPUS_PER_NODE     CPUs given to Ray per node (default: SLURM_CPUS_ON_NODE, else nproc)
#   DEVICES_PER_NODE  cluster.devices_per_node (default: GPUS_PER_NODE; 1 on CPU-only nodes)
#   NODE_IP           address every node registers with (default: NET_IFNAME's address, else `hostname -I`)
#   NET_IFNAME        cluster network interface: node addresses, and NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME unless
#                     those are set; UCX_NET_DEVICES is passed through when set. Unset: left to the system.
#   RAY_PORT (6379), RAY_CLIENT_PORT (10001), RAY_PORT_BASE (20000): head GCS port, Ray client port, first of the
#                     per-node ports (node manager, object manager, agents, then worker ports from base+10)
#   RAY_DASHBOARD     true to start Ray's dashboard on the head (default false)
#   RAY_PORT_STRIDE   add node_index*stride to the per-node ports (default 0; >0 when several nodes share a host)
#   RAY_TMPDIR        Ray's temp dir root, node i uses RAY_TMPDIR/n<i> (default /tmp/ray-mrl-<job id>)
#   OBJECT_STORE_MB   Ray object store per node (default: Ray's own choice)
#   RAY_WAIT_TIMEOUT_S  how long to wait for every node to register (default 300)
#   RAY_STOP_ON_EXIT  1 (default): also run `ray stop` on every node at the end (it stops ALL of this user's Ray
#                     processes on those nodes: fine on exclusive nodes, set 0 on shared hosts)
#   RAY_AUTH_MODE / RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH: Ray token auth, see docs/cluster.md. With none set,
#                     a random per-job token is generated and handed to every node and the driver.
#   CONTAINER_IMAGE   run every step in this image via pyxis (CONTAINER_MOUNTS default: the submit dir)
#   LOG_DIR           per-node Ray logs and the driver log (default logs/slurm-<job id>)
#   MEGATRON_RL, RAY, PYTHON   commands to use (default: megatron-rl, ray, python3 on PATH)
set -euo pipefail

log() { echo "[slurm_grpo $(date +%H:%M:%S)] $*"; }
usage() { awk 'NR >= 10 && !/^#/ {exit} NR >= 10' "${BASH_SOURCE[0]}"; }  # the comment block above
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  usage
  [[ $# -ge 1 ]] && exit 0
  exit 2
fi
if [[ -z "${SLURM_JOB_ID:-}" ]]; then
  echo "slurm_grpo.sh: not inside a Slurm job; submit it with sbatch (see --help)" >&2
  exit 2
fi
CONFIG="$1"
shift
OVERRIDES=("$@")

MEGATRON_RL="${MEGATRON_RL:-megatron-rl}"
RAY="${RAY:-ray}"
PYTHON="${PYTHON:-python3}"
JOB_ID="$SLURM_JOB_ID"
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NNODES="${#NODES[@]}"
if [[ "$NNODES" -lt 1 ]]; then
  echo "slurm_grpo.sh: SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}' names no nodes" >&2
  exit 2
fi
# Slurm spells GPUs per node as "8" or "h100:8"; keep the count.
slurm_gpus="${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}"
GPUS_PER_NODE="${GPUS_PER_NODE:-${slurm_gpus##*:}}"
CPUS_PER_NODE="${CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-$(nproc)}}"
if [[ "$GPUS_PER_NODE" -gt 0 ]]; then
  DEVICES_PER_NODE="${DEVICES_PER_NODE:-$GPUS_PER_NODE}"
else
  DEVICES_PER_NODE="${DEVICES_PER_NODE:-1}"
fi
RAY_PORT="${RAY_PORT:-6379}"
RAY_CLIENT_PORT="${RAY_CLIENT_PORT:-10001}"
RAY_PORT_BASE="${RAY_PORT_BASE:-20000}"
RAY_PORT_STRIDE="${RAY_PORT_STRIDE:-0}"
RAY_TMPDIR="${RAY_TMPDIR:-/tmp/ray-mrl-$JOB_ID}"
RAY_WAIT_TIMEOUT_S="${RAY_WAIT_TIMEOUT_S:-300}"
RAY_STOP_ON_EXIT="${RAY_STOP_ON_EXIT:-1}"
LOG_DIR="${LOG_DIR:-logs/slurm-$JOB_ID}"
mkdir -p "$LOG_DIR"

# Network: only what the user chose is exported; otherwise NCCL/Gloo/UCX pick interfaces themselves.
if [[ -n "${NET_IFNAME:-}" ]]; then
  export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$NET_IFNAME}"
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$NET_IFNAME}"
fi
for v in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME UCX_NET_DEVICES; do
  if [[ -n "${!v:-}" ]]; then
    export "${v?}"
    log "$v=${!v}"
  fi
done

# Ray 2.60 turns token auth on when a token exists. A job's Ray ports are open to the whole cluster network, so by
# default every job gets its own random token (the environment carries it to each node; it is never printed).
if [[ -z "${RAY_AUTH_MODE:-}" ]]; then
  if [[ -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" && ! -f "$HOME/.ray/auth_token" ]]; then
    RAY_AUTH_TOKEN="$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')"
    export RAY_AUTH_TOKEN
  fi
  export RAY_AUTH_MODE=token
fi
export RAY_AUTH_MODE
# Teardown is of the whole job: skip Ray's 30 s per-node drain on SIGTERM (it exists for Serve replicas), so the job
# ends within scancel's KillWait.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
export RAY_USAGE_STATS_ENABLED=0

# srun arguments shared by every step: steps share the nodes with each other (--overlap) and may use all their CPUs.
SRUN_BASE=(--overlap --cpus-per-task="$CPUS_PER_NODE")
if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
  # One named container per job: the driver step must see the head's Ray sockets under RAY_TMPDIR.
  SRUN_BASE+=(--container-image="$CONTAINER_IMAGE" --container-name="mrl-$JOB_ID"
                --container-mounts="${CONTAINER_MOUNTS:-$PWD:$PWD}" --container-workdir="$PWD")
fi
SRUN_ONE=("${SRUN_BASE[@]}" --nodes=1 --ntasks=1)  # one task on the node named by --nodelist
# Ray nodes and the driver see the node's GPUs (the driver picks CPU or GPU placement from what it sees).
SRUN_RAY=("${SRUN_ONE[@]}")
if [[ "$GPUS_PER_NODE" -gt 0 ]]; then
  SRUN_RAY+=(--gres="gpu:$GPUS_PER_NODE")
fi

# --- what runs on each node (shipped to it with `declare -f`; every value arrives as an argument) ---------------
# shellcheck disable=SC2317  # runs on the nodes, through NODE_FUNCS
node_ip() {
  local ip="${NODE_IP:-}"
  if [[ -z "$ip" && -n "${NET_IFNAME:-}" ]]; then
    ip="$(ip -4 -o addr show dev "$NET_IFNAME" | awk '{split($4, a, "/"); print a[1]; exit}')"
  fi
  if [[ -z "$ip" ]]; then
    ip="$(hostname -I 2>/dev/null | awk '{print $1}')"
  fi
  echo "${ip:-127.0.0.1}"
}
# shellcheck disable=SC2317
node_main() {  # node_main ray_cmd ip|auto ray-start-args...
  local ray_cmd="$1" ip="$2"
  shift 2
  if [[ "$ip" == auto ]]; then ip="$(node_ip)"; fi
  echo "node $(hostname) registers as $ip"
  exec "$ray_cmd" start --block --node-ip-address="$ip" "$@"
}
NODE_FUNCS="$(declare -f node_ip node_main)"
# shellcheck disable=SC2016  # $@ must expand on the node, not here
NODE_ENTRY="$NODE_FUNCS"$'\n''node_main "$@"'

STEP_PIDS=()
STEP_NAMES=()
STEP_LOGS=()
DRIVER_PID=""
CLEANED=0
PHASE="while starting the Ray nodes"

node_ports() {  # node_ports index -> the per-node port flags
  local base=$((RAY_PORT_BASE + $1 * RAY_PORT_STRIDE))
  echo "--node-manager-port=$base" "--object-manager-port=$((base + 1))" \
    "--dashboard-agent-listen-port=$((base + 2))" "--dashboard-agent-grpc-port=$((base + 3))" \
    "--runtime-env-agent-port=$((base + 4))" "--metrics-export-port=$((base + 5))" \
    "--min-worker-port=$((base + 10))" "--max-worker-port=$((base + 999))"
}

start_node() {  # start_node index ip|auto extra-ray-args...
  local i="$1" ip="$2" name="${NODES[$1]}"
  shift 2
  local log="$LOG_DIR/ray-$i-$name.log"
  local -a ports
  read -r -a ports <<<"$(node_ports "$i")"
  local -a args=(--node-name="$name" --num-cpus="$CPUS_PER_NODE" --num-gpus="$GPUS_PER_NODE"
                 --temp-dir="$RAY_TMPDIR/n$i" --disable-usage-stats "${ports[@]}" "$@")
  if [[ -n "${OBJECT_STORE_MB:-}" ]]; then
    args+=(--object-store-memory="$((OBJECT_STORE_MB * 1024 * 1024))")
  fi
  srun "${SRUN_RAY[@]}" --nodelist="$name" --job-name="mrl-ray-$i" --output="$log" \
    bash -c "$NODE_ENTRY" mrl-node "$RAY" "$ip" "${args[@]}" &
  STEP_PIDS+=("$!")
  STEP_NAMES+=("$name")
  STEP_LOGS+=("$log")
}

dead_node() {  # prints "name|rc|log" of the first node whose Ray step has exited, or nothing
  local k rc
  for k in "${!STEP_PIDS[@]}"; do
    if ! kill -0 "${STEP_PIDS[$k]}" 2>/dev/null; then
      rc=0
      wait "${STEP_PIDS[$k]}" || rc=$?
      echo "${STEP_NAMES[$k]}|$rc|${STEP_LOGS[$k]}"
      return
    fi
  done
}

report_dead() {  # report_dead "name|rc|log" what-was-happening
  local name rc log
  IFS='|' read -r name rc log <<<"$1"
  log "FAILED $2: node $name left the job (its Ray node exited with status $rc); see $log" >&2
  tail -n 15 "$log" >&2 || true
}

# supervise srun-pid step-name what: wait for the step while watching every node; its status, or 97 on node loss
supervise() {
  local pid="$1" step="$2" what="$3" dead rc
  PHASE="$what"
  while kill -0 "$pid" 2>/dev/null; do
    dead="$(dead_node)"
    if [[ -n "$dead" ]]; then
      report_dead "$dead" "$what"
      stop_step "$pid" "$step" 20
      return 97
    fi
    sleep 1
  done
  rc=0
  wait "$pid" || rc=$?
  if [[ "$rc" -ne 0 ]]; then
    sleep 3  # a node loss often shows up in the driver first: give its Ray step a moment to exit, then name it
    dead="$(dead_node)"
    if [[ -n "$dead" ]]; then
      report_dead "$dead" "$what"
      return 97
    fi
  fi
  return "$rc"
}

# Stopping a step: a SIGTERM to srun itself makes srun SIGKILL the step's tasks ("forcing job termination"), so the
# step's processes get their SIGTERM from Slurm (scancel --signal on the step, found by its name) and may shut down
# cleanly; srun's own kill is only the fallback, after the grace period or when Slurm cannot be asked.
term_step() {  # term_step srun-pid step-name
  kill -0 "$1" 2>/dev/null || return 0
  local ids
  ids="$(squeue -h -s -j "$JOB_ID" -o '%i %j' 2>/dev/null | awk -v n="$2" '$2 == n {print $1}')" || true
  if [[ -n "$ids" ]]; then
    # scancel 22.05 signals a step and still exits non-zero ("Invalid job id"): its status says nothing, and
    # await_step falls back to srun's kill if the step outlives the grace period anyway
    # shellcheck disable=SC2086  # one word per step id
    scancel --signal=TERM $ids >/dev/null 2>&1 || true
  else
    kill -TERM "$1" 2>/dev/null || true
  fi
}

await_step() {  # await_step srun-pid grace_s: wait for the step to end; then srun's kill, then srun's own SIGKILL
  local pid="$1" t=0
  while kill -0 "$pid" 2>/dev/null && [[ "$t" -lt "$2" ]]; do
    sleep 1
    t=$((t + 1))
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    t=0
    while kill -0 "$pid" 2>/dev/null && [[ "$t" -lt 5 ]]; do
      sleep 1
      t=$((t + 1))
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

stop_step() {  # stop_step srun-pid step-name grace_s
  term_step "$1" "$2"
  await_step "$1" "$3"
}

# shellcheck disable=SC2317  # called from the traps
cleanup() {
  [[ "$CLEANED" == 1 ]] && return
  CLEANED=1
  log "tearing down (driver, then ${#STEP_PIDS[@]} Ray nodes)"
  # short grace periods: scancel's SIGKILL follows its SIGTERM after KillWait (30 s by default)
  if [[ -n "$DRIVER_PID" ]]; then stop_step "$DRIVER_PID" mrl-driver 15; fi
  local k
  for ((k = ${#STEP_PIDS[@]} - 1; k >= 0; k--)); do  # workers first, the head last
    term_step "${STEP_PIDS[$k]}" "mrl-ray-$k"
  done
  for ((k = ${#STEP_PIDS[@]} - 1; k >= 0; k--)); do
    await_step "${STEP_PIDS[$k]}" 10
  done
  if [[ "$RAY_STOP_ON_EXIT" == 1 ]]; then
    # Safety net for Ray processes that outlived their step (e.g. after a SIGKILL).
    timeout 60 srun "${SRUN_BASE[@]}" --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --job-name=mrl-ray-stop \
      "$RAY" stop --force >/dev/null 2>&1 || true
  fi
}

# shellcheck disable=SC2317  # called from the trap
on_term() {  # scancel, the --signal warning before the time limit, or Slurm killing the job after a node failure
  local job state down
  job="$(scontrol -o show job "$JOB_ID" 2>/dev/null)" || true
  state="$(grep -o 'JobState=[A-Z_]*' <<<"$job" | cut -d= -f2)" || true
  if [[ "$job" == *JobState=NODE_FAIL* || "$job" == *Reason=NodeDown* ]]; then
    # Slurm ends the whole job when one of its nodes fails: name the node(s) it lost, as a Ray node loss would be
    down="$(sinfo -h -N -n "$SLURM_JOB_NODELIST" -t down,no_respond -o %N 2>/dev/null | sort -u | paste -sd ' ')" ||
      true
    log "FAILED $PHASE: node ${down:-(unknown)} left the job (Slurm declared a node failure and ends the job)" >&2
  else
    log "SIGTERM received (job state ${state:-unknown}; scancel, or --signal ahead of the time limit)"
  fi
  cleanup
  exit 143
}
trap cleanup EXIT
trap on_term TERM
trap 'cleanup; exit 130' INT

log "job $JOB_ID, $NNODES node(s): ${NODES[*]}; per node $GPUS_PER_NODE GPU(s), $CPUS_PER_NODE CPU(s)," \
  "devices_per_node=$DEVICES_PER_NODE; logs in $LOG_DIR"

# The head's address is needed before anything else starts: ask the head node itself (same rules as every node).
HEAD_IP="$(srun "${SRUN_ONE[@]}" --nodelist="${NODES[0]}" --job-name=mrl-head-ip bash -c "$NODE_FUNCS"$'\n''node_ip')"
HEAD="$HEAD_IP:$RAY_PORT"
log "starting the Ray head on ${NODES[0]} ($HEAD) and $((NNODES - 1)) worker node(s)"
start_node 0 "$HEAD_IP" --head --port="$RAY_PORT" --ray-client-server-port="$RAY_CLIENT_PORT" \
  --include-dashboard="${RAY_DASHBOARD:-false}"
for ((i = 1; i < NNODES; i++)); do
  start_node "$i" auto --address="$HEAD"
done

# Wait until every node is alive with its resources registered, naming the ones still missing on timeout.
WAIT_PY='
import socket, sys, time
addr, timeout, gpus, names = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
deadline = time.monotonic() + timeout
host, port = addr.rsplit(":", 1)
while True:  # the head GCS port first: ray.init on an unreachable address is slow to fail
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"head node {names[0]}: no Ray GCS at {addr} after {timeout:.0f}s")
        time.sleep(1)
import ray
ray.init(address=addr, log_to_driver=False, logging_level="ERROR")
while True:
    alive = {n["NodeName"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    missing = [n for n in names if n not in alive or alive[n].get("GPU", 0) < gpus]
    if not missing:
        print(f"all {len(names)} Ray nodes registered at {addr}")
        break
    if time.monotonic() > deadline:
        sys.exit(f"Ray nodes not registered after {timeout:.0f}s: {missing} (alive: {sorted(alive)})")
    time.sleep(1)
'
srun "${SRUN_ONE[@]}" --nodelist="${NODES[0]}" --job-name=mrl-wait \
  "$PYTHON" -c "$WAIT_PY" "$HEAD" "$RAY_WAIT_TIMEOUT_S" "$GPUS_PER_NODE" "${NODES[@]}" &
supervise "$!" mrl-wait "while waiting for the Ray nodes"

log "starting megatron-rl train on ${NODES[0]}"
# The driver runs on the head node. The cluster.* values describe this allocation, so they come last and win.
srun "${SRUN_RAY[@]}" --nodelist="${NODES[0]}" --job-name=mrl-driver \
  "$MEGATRON_RL" train "$CONFIG" ${OVERRIDES[@]+"${OVERRIDES[@]}"} "cluster.ray_address=$HEAD" "cluster.num_nodes=$NNODES" \
  "cluster.devices_per_node=$DEVICES_PER_NODE" "cluster.bind_host=$HEAD_IP" \
  > >(tee -a "$LOG_DIR/driver.log") 2>&1 &
DRIVER_PID=$!
rc=0
supervise "$DRIVER_PID" mrl-driver "during training" || rc=$?
DRIVER_PID=""
if [[ "$rc" -eq 0 ]]; then
  log "training finished; driver log $LOG_DIR/driver.log"
else
  log "training failed with status $rc; driver log $LOG_DIR/driver.log" >&2
fi
exit "$rc"
