#!/bin/bash
# DAPO (dynamic filtering, clip-higher, token-level loss) written like OpenRLHF v0.11's
# examples/scripts/train_dapo_ray_hybrid_engine.sh (dotted flags), `python3 -m
# openrlhf.cli.train_ppo_ray` swapped for torchrun. --data.max_len without
# --rollout.max_new_tokens: each response gets what its prompt leaves.
# Inputs: MODEL DATA SAVE PORT (PYTHON).
set -x

"${PYTHON:-python3}" -m torch.distributed.run --nproc_per_node 2 \
   --master_addr 127.0.0.1 --master_port ${PORT} \
   -m fsdp_rlhf.cli ppo \
   --ref.num_nodes 1 \
   --ref.num_gpus_per_node 2 \
   --actor.num_nodes 1 \
   --actor.num_gpus_per_node 2 \
   --vllm.num_engines 2 \
   --vllm.tensor_parallel_size 1 \
   --train.colocate_all \
   --vllm.gpu_memory_utilization 0.6 \
   --algo.kl.init_coef 1e-3 \
   --algo.advantage.gamma 1.0 \
   --algo.kl.use_loss \
   --algo.kl.estimator k3 \
   --algo.advantage.estimator group_norm \
   --algo.dynamic_filtering_enable \
   --algo.dynamic_filtering_range 0 1 \
   --actor.eps_clip_low_high 0.2 0.27 \
   --actor.model_name_or_path ${MODEL} \
   --reward.remote_url ${DATA}/parity_reward.py \
   --ckpt.output_dir ${SAVE} \
   --ckpt.path ${SAVE}/ckpt \
   --ckpt.save_steps 20 \
   --train.micro_batch_size 8 \
   --train.batch_size 32 \
   --rollout.micro_batch_size 16 \
   --rollout.batch_size 8 \
   --rollout.n_samples_per_prompt 4 \
   --train.max_epochs 1 \
   --data.max_len 40 \
   --data.max_samples 16 \
   --ds.zero_stage 3 \
   --actor.adam.lr 5e-7 \
   --data.prompt_dataset ${DATA}/prompts.jsonl \
   --data.input_key input \
   --data.apply_chat_template \
   --ds.packing_samples \
   --vllm.sync_backend nccl \
   --vllm.enforce_eager \
   --vllm.enable_sleep \
   --ds.enable_sleep \
   --algo.advantage.is_correction_enable \
   --logger.tensorboard_dir ${SAVE}/tb
