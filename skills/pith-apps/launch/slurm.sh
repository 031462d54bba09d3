#!/bin/bash
# pith-train on several nodes under SLURM: one task per node, each running torchrun over its node's GPUs, the nodes
# meeting at a c10d rendezvous on the job's first node (skills/pith-apps/launch/SKILL.md). Submit from the repository
# root, the training flags as the script's arguments:
#   sbatch --nodes 2 skills/pith-apps/launch/slurm.sh qwen3 --preset 30b-a3b --seq-len 4096 --batch-size 64 \
#       --pp 16 --micro-batch-size 1 --out runs/qwen3-30b
# PITH_DRY_RUN=1: each task prints its node's torchrun line (`node N: ...`) instead of running it.
#SBATCH --job-name=pith-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
# whole nodes: a node's one task holds one CPU by default (unless the site gives CPUs per GPU), which its 8 training
# processes would share; srun's step gets every CPU the job holds on a node
#SBATCH --exclusive
set -eu

# One CPU thread per process: each of a node's processes would otherwise size torch's thread pool to every core the
# task holds (a value SLURM or the site sets included) and contend with the others for them. The GPUs compute; the
# batches are slices of a memory-mapped file. torchrun sets 1 as well, but only where nothing set it.
export OMP_NUM_THREADS=1
# A collective that fails or outlives its timeout (a rank died, a node was lost) tears its process down instead of
# leaving it waiting; torchrun then stops the node's other processes and srun (--kill-on-bad-exit) the other nodes.
# 3 tears down without first aborting the communicators, an abort that can itself hang: torch 2.13's default, set
# here so that an inherited 0 (no handling) cannot keep a broken job for its whole time limit.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
# NCCL picks the network interface itself. On nodes with several networks where it picks one the other nodes cannot
# reach (the rendezvous succeeds, then NCCL fails to connect or the first collective hangs), name the right one:
# export NCCL_SOCKET_IFNAME=ib0

head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)   # the rendezvous host: the job's first node
# the two-node command of SKILL.md for this job: its node count, the GPUs SLURM gave each node, its id
launch=(hatch run apps:torchrun --nnodes "$SLURM_NNODES" --nproc-per-node "${SLURM_GPUS_ON_NODE:-8}"
        --rdzv-backend c10d --rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID" -m pith_apps.train "$@")
if [ -n "${PITH_DRY_RUN:-}" ]; then
    launch=(bash -c 'printf "node %s:" "$SLURM_NODEID"; printf " %q" "$@"; echo' dry-run "${launch[@]}")
fi
# one task per node; a task that fails ends the others at once, rather than leaving them in the rendezvous or in a
# collective until a timeout
srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${launch[@]}"
