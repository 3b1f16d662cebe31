#!/usr/bin/env bash
# DPO with the flags of OpenRLHF's train_dpo example (Llama 3 8B).
#
# Run the same script on every node. Multi-node settings come from the environment, as on
# platforms that inject one pod/host per node (Kubeflow PyTorchJob without nprocPerNode):
#   WORLD_SIZE = number of nodes, RANK = this node's index, MASTER_ADDR/MASTER_PORT = node 0.
# Every path and GPUS_PER_NODE can be overridden from the environment; extra
# `fsdp-rlhf dpo` flags can be appended on the command line (later flags win).
#
#   examples/dpo.sh                                 # one node, 8 GPUs
#   GPUS_PER_NODE=2 examples/dpo.sh --max_len 1024  # fewer GPUs, one flag changed
#   DRY_RUN=1 examples/dpo.sh                       # print the torchrun command only
set -eu

# Where the trained policy is written.
SAVE_PATH=${SAVE_PATH:-/mnt/cluster/models/Llama-2-7b-dpo-model/}
# The SFT model to train; also the frozen reference.
SFT_MODEL_PATH=${SFT_MODEL_PATH:-/mnt/cluster/test/models/Llama-2-7b-sft-model-ocra-500k/}
# Pairwise preference data (chat-message lists under chosen/rejected).
DATASET_PATH=${DATASET_PATH:-/mnt/cluster/test/dataset/OpenRLHF/preference_dataset_mixture2_and_safe_pku}
# Resumable checkpoint every SAVE_STEPS steps, so a crash or a missed stop signal loses at most
# that many steps (-1: only when stopped by a signal).
SAVE_STEPS=${SAVE_STEPS:-20}
# Resumable checkpoints; rerun with --load_checkpoint appended to continue from the newest.
CKPT_PATH=${CKPT_PATH:-${SAVE_PATH%/}/checkpoints}
# TensorBoard logs.
TENSORBOARD_PATH=${TENSORBOARD_PATH:-${AIHC_TENSORBOARD_LOG_PATH:-/mnt/cluster/tensorboard-log}}

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${WORLD_SIZE:-1}
NODE_RANK=${RANK:-0}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-eth0}
# vLLM's CPU-side groups and the prompt exchange use gloo across nodes: same interface as NCCL.
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}
export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}
# Seconds torchrun lets the ranks finish after it is sent SIGTERM (its default, 30, is shorter
# than one checkpoint of a 7B model): enough to finish the step and write the final checkpoint.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}

TRAINING_ARGS=(
    --save_path "$SAVE_PATH"
    --save_steps "$SAVE_STEPS"
    --logging_steps 1
    --eval_steps -1
    --train_batch_size 256
    --micro_train_batch_size 1
    --pretrain "$SFT_MODEL_PATH"
    --bf16
    --max_epochs 1
    --max_len 8192
    --zero_stage 3
    --learning_rate 5e-7
    --beta 0.1
    --dataset "$DATASET_PATH"
    --apply_chat_template
    --chosen_key chosen
    --rejected_key rejected
    --flash_attn
    --tensorboard "$TENSORBOARD_PATH"
    --gradient_checkpointing
    --ckpt_path "$CKPT_PATH"
)

CMD=(torchrun "${DISTRIBUTED_ARGS[@]}" -m fsdp_rlhf.cli dpo "${TRAINING_ARGS[@]}" "$@")

# Print a command so that it can be pasted back into a shell.
print_cmd() {
    local arg out=()
    for arg in "$@"; do
        if [[ $arg =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
            out+=("$arg")
        else
            out+=("'${arg//\'/\'\\\'\'}'")
        fi
    done
    printf '%s\n' "${out[*]}"
}

if [[ ${DRY_RUN:-0} == 1 ]]; then
    print_cmd "${CMD[@]}"
    exit 0
fi
set -x
exec "${CMD[@]}"
