#!/bin/bash
# Asynchronous agent RL written like OpenRLHF v0.11's
# examples/scripts/train_reinforce_baseline_ray_agent_async.sh (dotted flags), `ray job submit
# ... -- python3 -m openrlhf.cli.train_ppo_ray` swapped for torchrun. Sizes are the test's: a
# tiny model on 3 CPU ranks, 2 training ranks (the actor pool, one ring-attention group of 2:
# Ulysses sequence parallelism here) and 1 vLLM engine of TP 1 (the original: 4 + 2 engines of
# TP 2). Inputs: MODEL DATA SAVE PORT (PYTHON).
set -x

AGENT_FUNC_PATH="${DATA}/agent_func.py"

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
   --train.agent_func_path ${AGENT_FUNC_PATH}

   --data.prompt_dataset ${DATA}/agent_prompts.jsonl
   --data.input_key prompt
   --data.label_key label
   --data.max_len 96
   --rollout.max_new_tokens 16
   --data.apply_chat_template
   --ds.packing_samples
   --ds.ring_attn_size 2
   --ds.ring_attn_head_stride 2

   --rollout.batch_size 8
   --rollout.n_samples_per_prompt 4
   --train.batch_size 32
   --algo.dynamic_filtering_enable
   --algo.dynamic_filtering_range 0.0 1.0

   --train.dynamic_batch_enable
   --train.max_tokens_per_gpu 512
   --rollout.max_tokens_per_gpu 1024

   --train.micro_batch_size 1
   --rollout.micro_batch_size 8
   --data.max_samples 32
   --train.max_epochs 1
   --train.num_episodes 1
)

ENGINE_ARGS=(
   --train.async_enable
   --train.partial_rollout_enable

   --ref.num_nodes 1
   --ref.num_gpus_per_node 2
   --actor.num_nodes 1
   --actor.num_gpus_per_node 2
   --vllm.num_engines 1
   --vllm.tensor_parallel_size 1
   --vllm.gpu_memory_utilization 0.95
   --train.colocate_all
   --ds.enable_sleep
   --vllm.sync_backend nccl
   --vllm.enforce_eager

   --ds.zero_stage 3
   --actor.gradient_checkpointing_enable
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

"${PYTHON:-python3}" -m torch.distributed.run --nproc_per_node 3 \
   --master_addr 127.0.0.1 --master_port ${PORT} \
   -m fsdp_rlhf.cli ppo \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${ENGINE_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${LOG_ARGS[@]}
