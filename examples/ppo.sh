#!/usr/bin/env bash
# PPO with the flags of the AIAK-RLHF PPO example (section 2.3), without Ray: the example's
# `ray start` / `ray job submit ... train_ppo_ray_optim.py` becomes one torchrun per node running
# `fsdp-rlhf ppo`; every rank trains and hosts its share of the in-process vLLM engines.
#
# Run the same script on every node. Multi-node settings come from the environment, as on
# platforms that inject one pod/host per node (Kubeflow PyTorchJob without nprocPerNode):
#   WORLD_SIZE = number of nodes, RANK = this node's index, MASTER_ADDR/MASTER_PORT = node 0.
# Every path, GPUS_PER_NODE and VLLM_TENSOR_PARALLEL_SIZE can be overridden from the
# environment; extra `fsdp-rlhf ppo` flags can be appended on the command line (later flags win).
#
#   examples/ppo.sh                              # one node, 8 GPUs
#   VLLM_TENSOR_PARALLEL_SIZE=2 examples/ppo.sh  # 14B/33B-class models: shard vLLM engines
#   DRY_RUN=1 examples/ppo.sh                    # print the torchrun command only
set -eu

# vLLM tensor parallel size: 1 for 7B models; 14B, 33B, ... may need more (1 to 8).
VLLM_TENSOR_PARALLEL_SIZE=${VLLM_TENSOR_PARALLEL_SIZE:-1}
# Where the trained actor is written.
SAVE_PATH=${SAVE_PATH:-/mnt/cluster/llama2-ppo-model}
# The SFT model (initial actor and reference).
SFT_MODEL_PATH=${SFT_MODEL_PATH:-/mnt/cluster/test/models/Llama-2-7b-sft-model-ocra-500k/}
# The reward model.
REWARD_MODEL_PATH=${REWARD_MODEL_PATH:-/mnt/cluster/test/models/Llama-2-7b-rm-anthropic_hh-lmsys-oasst-webgpt/}
# Prompt data.
DATASET_PATH=${DATASET_PATH:-/mnt/cluster/test/dataset/OpenLLMAI/prompt-collection-v0.1}
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

if (( GPUS_PER_NODE * NNODES % VLLM_TENSOR_PARALLEL_SIZE != 0 )); then
    echo "ppo.sh: $NNODES node(s) x $GPUS_PER_NODE GPUs is not divisible by" \
        "VLLM_TENSOR_PARALLEL_SIZE=$VLLM_TENSOR_PARALLEL_SIZE" >&2
    exit 2
fi
# One vLLM engine per VLLM_TENSOR_PARALLEL_SIZE GPUs.
VLLM_NUM_ENGINES=$((GPUS_PER_NODE * NNODES / VLLM_TENSOR_PARALLEL_SIZE))

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
    --num_nodes "$NNODES"
    --num_gpus_per_node "$GPUS_PER_NODE"
    --vllm_num_engines "$VLLM_NUM_ENGINES"
    --vllm_tensor_parallel_size "$VLLM_TENSOR_PARALLEL_SIZE"
    --vllm_gpu_memory_utilization 0.9
    --colocate_all
    --ref_reward_offload
    --pretrain "$SFT_MODEL_PATH"
    --reward_pretrain "$REWARD_MODEL_PATH"
    --save_path "$SAVE_PATH"
    --micro_train_batch_size 8
    --micro_rollout_batch_size 16
    --rollout_batch_size 1024
    --max_samples 1000000
    --max_epochs 1
    --prompt_max_len 1024
    --generate_max_len 1024
    --zero_stage 3
    --bf16
    --actor_learning_rate 5e-7
    --critic_learning_rate 9e-6
    --init_kl_coef 0.01
    --prompt_data "$DATASET_PATH"
    --input_key context_messages
    --apply_chat_template
    --normalize_reward
    --adam_offload
    --flash_attn
    --tensorboard "$TENSORBOARD_PATH"
    --gradient_checkpointing
    --save_steps "$SAVE_STEPS"
    --ckpt_path "$CKPT_PATH"
)

CMD=(torchrun "${DISTRIBUTED_ARGS[@]}" -m fsdp_rlhf.cli ppo "${TRAINING_ARGS[@]}" "$@")

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
