#!/bin/bash
# Asynchronous agent RL written like OpenRLHF v0.10's
# examples/scripts/train_reinforce_baseline_ray_agent_async.sh (flat flags), `ray job submit
# ... -- python3 -m openrlhf.cli.train_ppo_ray` swapped for torchrun. Sizes are the test's: a
# tiny model on 3 CPU ranks, 2 training ranks (the actor pool, one ring-attention group of 2:
# Ulysses sequence parallelism here) and 1 vLLM engine of TP 1 (the original: 4 + 2 engines of
# TP 2). Inputs: MODEL DATA SAVE PORT (PYTHON).
set -x

AGENT_FUNC_PATH="${DATA}/agent_func.py"

CKPT_ARGS=(
   --pretrain ${MODEL}
   --load_checkpoint

   --save_path ${SAVE}
   --ckpt_path "${SAVE}/ckpt"
   --save_hf_ckpt
   --max_ckpt_num 3
   --save_steps 2
)

ROLLOUT_ARGS=(
   --agent_func_path ${AGENT_FUNC_PATH}

   --prompt_data ${DATA}/agent_prompts.jsonl
   --input_key prompt
   --label_key label
   --max_len 96
   --max_new_tokens 16
   --apply_chat_template
   --packing_samples
   --ring_attn_size 2
   --ring_head_stride 2

   --rollout_batch_size 8
   --n_samples_per_prompt 4
   --train_batch_size 32
   --dynamic_filtering
   --dynamic_filtering_reward_range 0.0 1.0

   --use_dynamic_batch
   --train_max_tokens_per_gpu 512
   --rollout_max_tokens_per_gpu 1024

   --micro_train_batch_size 1
   --micro_rollout_batch_size 8
   --max_samples 32
   --max_epochs 1
   --num_episodes 1
)

ENGINE_ARGS=(
   --async_train
   --partial_rollout

   --ref_num_nodes 1
   --ref_num_gpus_per_node 2
   --actor_num_nodes 1
   --actor_num_gpus_per_node 2
   --vllm_num_engines 1
   --vllm_tensor_parallel_size 1
   --vllm_gpu_memory_utilization 0.95
   --colocate_all_models
   --deepspeed_enable_sleep
   --vllm_sync_backend nccl
   --enforce_eager

   --zero_stage 3
   --gradient_checkpointing
   --param_dtype bf16
)

OPTIMIZER_ARGS=(
   --advantage_estimator reinforce_baseline
   --actor_learning_rate 5e-7
   --entropy_loss_coef 0.0
   --init_kl_coef 1e-5
   --use_kl_loss
   --kl_estimator k2
   --enable_vllm_is_correction
   --vllm_is_correction_type icepop
)

LOG_ARGS=(
   --use_tensorboard ${SAVE}/runs
   --logging_steps 1
   --eval_steps -1
)

"${PYTHON:-python3}" -m torch.distributed.run --nproc_per_node 3 \
   --master_addr 127.0.0.1 --master_port ${PORT} \
   -m fsdp_rlhf.cli ppo \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${ENGINE_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${LOG_ARGS[@]}
