#!/bin/bash
# FlashREINFORCE written like OpenRLHF 0.11.2's
# examples/scripts/train_flash_reinforce_ray_agent_async.sh (dotted flags), `ray job submit
# ... -- python3 -m openrlhf.cli.train_ppo_ray` swapped for torchrun. The optimizer flags are the
# original's (the algorithm is configuration: one response per prompt, flash_reinforce, the
# sequence-level binary-KL trust region of 5e-3, seq-mean-token-mean, no KL). Sizes are the
# test's: a tiny model on 2 CPU ranks, 1 training rank and 1 vLLM engine (the original: 1 + 7
# GPUs), 16-token responses (8192), rollout batches of 8 (128) over-sampled to 16 (512), 4
# updates (12,000), a queue of 2 (8). Inputs: MODEL DATA SAVE PORT (PYTHON).
set -x

CKPT_ARGS=(
   --actor.model_name_or_path ${MODEL}
   --ckpt.load_enable

   --ckpt.output_dir ${SAVE}
   --ckpt.path "${SAVE}/ckpt"
   --ckpt.save_hf
   --ckpt.max_num 3
   --ckpt.save_steps 2
)

ROLLOUT_ARGS=(
   --reward.remote_url ${DATA}/parity_reward.py

   --data.prompt_dataset ${DATA}/flash_prompts.jsonl
   --data.input_key prompt
   --data.label_key label
   --data.apply_chat_template
   --data.max_len 64
   --rollout.max_new_tokens 16
   --rollout.temperature 1.0
   --rollout.top_p 1.0
   --ds.packing_samples

   --rollout.batch_size 8
   --rollout.vllm_generate_batch_size 16
   --rollout.n_samples_per_prompt 1
   --rollout.micro_batch_size 1
   --train.batch_size 8
   --train.micro_batch_size 1
   --train.max_epochs 1
   --train.num_episodes 1
   --data.max_samples 32
)

ENGINE_ARGS=(
   --train.async_enable
   --train.async_queue_size 2

   --actor.num_nodes 1
   --actor.num_gpus_per_node 1
   --vllm.num_engines 1
   --vllm.tensor_parallel_size 1
   --vllm.gpu_memory_utilization 0.9
   --vllm.sync_backend nccl

   --ds.zero_stage 2
   --actor.gradient_checkpointing_enable
   --ds.param_dtype bf16
)

OPTIMIZER_ARGS=(
   --algo.advantage.estimator flash_reinforce
   --algo.advantage.is_correction_level seq
   --algo.advantage.is_correction_gating binary_kl
   --algo.advantage.is_correction_threshold 5e-3
   --actor.loss_agg_mode seq-mean-token-mean
   --algo.kl.init_coef 0
   --actor.adam.lr 1e-6
   --actor.adam.weight_decay 0.1
)

LOG_ARGS=(
   --logger.tensorboard_dir ${SAVE}/runs
   --logger.logging_steps 1
   --eval.steps -1
)

"${PYTHON:-python3}" -m torch.distributed.run --nproc_per_node 2 \
   --master_addr 127.0.0.1 --master_port ${PORT} \
   -m fsdp_rlhf.cli ppo \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${ENGINE_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${LOG_ARGS[@]}
