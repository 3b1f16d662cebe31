#!/bin/bash
# GRPO with a rule reward, written like OpenRLHF v0.10's example scripts (flat flags), with
# `ray job submit ... -- python3 -m openrlhf.cli.train_ppo_ray` swapped for torchrun.
# Sizes are the test's: a tiny model on 2 CPU ranks. Inputs: MODEL DATA SAVE PORT (PYTHON).
set -x

CKPT_ARGS=(
   --pretrain ${MODEL}
   --save_path ${SAVE}
   --ckpt_path "${SAVE}/ckpt"
   --max_ckpt_num 2
   --save_steps 1
)

ROLLOUT_ARGS=(
   --remote_rm_url ${DATA}/reward.py
   --prompt_data ${DATA}/prompts.jsonl
   --input_key context_messages
   --apply_chat_template
   --max_len 48
   --max_new_tokens 16
   --packing_samples

   --rollout_batch_size 8
   --n_samples_per_prompt 4
   --train_batch_size 32
   --micro_train_batch_size 8
   --micro_rollout_batch_size 16
   --max_samples 16
   --max_epochs 1
   --num_episodes 1
)

ENGINE_ARGS=(
   --ref_num_nodes 1
   --ref_num_gpus_per_node 2
   --actor_num_nodes 1
   --actor_num_gpus_per_node 2
   --vllm_num_engines 2
   --vllm_tensor_parallel_size 1
   --colocate_all_models
   --vllm_gpu_memory_utilization 0.6
   --vllm_sync_backend nccl
   --enforce_eager
   --vllm_enable_sleep
   --deepspeed_enable_sleep
   --zero_stage 3
   --gradient_checkpointing
   --attn_implementation sdpa
)

ALGO_ARGS=(
   --advantage_estimator group_norm
   --use_kl_loss
   --kl_estimator k3
   --init_kl_coef 1e-3
   --gamma 1.0
   --actor_learning_rate 2e-3
   --lr_warmup_ratio 0
   --enable_vllm_is_correction
   --vllm_is_correction_type icepop
   --seed 7
)

LOG_ARGS=(
   --use_tensorboard ${SAVE}/tb
   --logging_steps 1
)

"${PYTHON:-python3}" -m torch.distributed.run --nproc_per_node 2 \
   --master_addr 127.0.0.1 --master_port ${PORT} \
   -m fsdp_rlhf.cli ppo \
   "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${ENGINE_ARGS[@]}" "${ALGO_ARGS[@]}" "${LOG_ARGS[@]}"
