#!/usr/bin/env bash
# Runs `python -m cursor_rl.main` on one NVIDIA GPU host, or as one process of a multi-host
# job (start the same command on every host, each with its own --host_id).
#
#   bash launch/run_gpu.sh -- --config=configs/small.py --workdir=gs://BUCKET/run [--config.x=y]
#   bash launch/run_gpu.sh --coordinator=HOST0:8476 --num_hosts=2 --host_id=0 -- MAIN_FLAGS
#
# Sets up .venv with the `gpu` extra (CUDA 12 wheels; idempotent) unless CURSOR_RL_PYTHON
# names an interpreter to use. One process per host drives all its GPUs. Without the
# coordinator flags JAX auto-detects SLURM and Open MPI jobs; elsewhere pass them.
# DRY_RUN=1 prints the environment and command instead of running them.
#
# XLA flags set here (override with XLA_FLAGS; see launch/README.md):
#   latency-hiding scheduler, pipelined all-gather/reduce-scatter/all-reduce and while-loop
#   double buffering overlap the FSDP/expert collectives with compute; collective combine
#   thresholds batch small NCCL calls. XLA_PYTHON_CLIENT_MEM_FRACTION gives XLA 90% of HBM.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

coordinator="" num_hosts=1 host_id=0
while [ "$#" -gt 0 ]; do
  case "$1" in
    --coordinator=*) coordinator="${1#*=}" ;;
    --num_hosts=*) num_hosts="${1#*=}" ;;
    --host_id=*) host_id="${1#*=}" ;;
    --) shift; break ;;
    -h | --help) usage ;;
    *) echo "run_gpu.sh: unknown argument $1 (main's flags go after --)" >&2; usage ;;
  esac
  shift
done
[ "$#" -gt 0 ] || usage
if [ -n "$coordinator" ]; then
  export CURSOR_RL_MULTIHOST=1 CURSOR_RL_COORDINATOR="$coordinator"
  export CURSOR_RL_NUM_PROCESSES="$num_hosts" CURSOR_RL_PROCESS_ID="$host_id"
elif [ -n "${SLURM_JOB_ID:-}${OMPI_COMM_WORLD_SIZE:-}" ]; then
  export CURSOR_RL_MULTIHOST=1  # jax.distributed.initialize() reads the job's variables
elif [ "$num_hosts" -gt 1 ]; then
  echo "run_gpu.sh: --num_hosts=$num_hosts needs --coordinator=HOST:PORT (or SLURM/MPI)" >&2
  exit 2
else
  export CURSOR_RL_MULTIHOST=0  # one host: no coordinator to meet
fi

gpu_xla_flags=(
  --xla_gpu_enable_latency_hiding_scheduler=true
  --xla_gpu_enable_pipelined_all_gather=true
  --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true
  --xla_gpu_enable_while_loop_double_buffering=true
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  --xla_gpu_reduce_scatter_combine_threshold_bytes=67108864
)
export XLA_FLAGS="${gpu_xla_flags[*]}${XLA_FLAGS:+ $XLA_FLAGS}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
# NCCL picks the fastest transport itself; say which NIC when a host has several
# (NCCL_SOCKET_IFNAME) and keep its logging to warnings.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

if [ "${DRY_RUN:-0}" = "1" ]; then
  echo "XLA_FLAGS=$XLA_FLAGS"
  echo "XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION NCCL_DEBUG=$NCCL_DEBUG"
fi
# shellcheck source=launch/main_command.sh
source "$(dirname "$0")/main_command.sh"
cursor_rl_main gpu "$@"
