#!/bin/bash
# REINFORCE++-baseline with long responses and ring attention, written like OpenRLHF v0.11's
# examples/scripts/train_reinforce_baseline_hybrid_engine.sh (its dotted recipe in the docs'
# hybrid engine page: `ray job submit ... -- python3 -m openrlhf.cli.train_ppo_ray` swapped for
# torchrun). Scaled to 2 CPU ranks and a tiny model: --rollout.max_new_tokens 32768 with
# --data.max_len 33000 (theirs: 64000 / 74240), --ds.ring_attn_size 2 as theirs, one engine of
# TP 2 (theirs: 2 engines of TP 2 on 4 GPUs), a parity rule reward instead of the math verifier.
# Inputs: MODEL DATA SAVE PORT (PYTHON).
set -x

CKPT_ARGS=(
   --actor.model_name_or_path ${MODEL}
   --ckpt.output_dir ${SAVE}
   --ckpt.path "${SAVE}/ckpt"
   --ckpt.save_hf
   --ckpt.max_num 3
   --ckpt.save_steps 10
)

ROLLOUT_ARGS=(
   --reward.remote_url ${DATA}/parity_reward.py
   --data.prompt_dataset ${DATA}/prompts.jsonl
   --data.input_key input
   --data.max_len 33000
   --rollout.max_new_tokens 32768
   --data.apply_chat_template
   --ds.packing_samples

   --rollout.batch_size 4
   --rollout.n_samples_per_prompt 4
   --train.batch_size 16
   --algo.dynamic_filtering_enable
   --algo.dynamic_filtering_range 0.0 1.0

   --train.dynamic_batch_enable
   --train.max_tokens_per_gpu 4096
   --rollout.max_tokens_per_gpu 8192

   --train.micro_batch_size 1
   --rollout.micro_batch_size 8
   --data.max_samples 8
   --train.max_epochs 1
   --train.num_episodes 1
)

ENGINE_ARGS=(
   --ref.num_nodes 1
   --ref.num_gpus_per_node 2
   --actor.num_nodes 1
   --actor.num_gpus_per_node 2
   --vllm.num_engines 1
   --vllm.tensor_parallel_size 2
   --vllm.gpu_memory_utilization 0.7
   --train.colocate_all
   --vllm.enable_sleep
   --ds.enable_sleep
   --vllm.sync_backend nccl
   --vllm.enforce_eager

   --ds.zero_stage 3
   --actor.gradient_checkpointing_enable
   --ds.ring_attn_size 2
   --ds.ring_attn_head_stride 2
   --ds.param_dtype bf16
)

OPTIMIZER_ARGS=(
   --algo.advantage.estimator reinforce_baseline
   --actor.adam.lr 5e-7
   --actor.entropy_coef 0.0
   --algo.kl.init_coef 1e-5
   --algo.kl.use_loss
   --algo.kl.estimator k2
   --algo.advantage.is_correction_enable
   --algo.advantage.is_correction_type icepop
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
