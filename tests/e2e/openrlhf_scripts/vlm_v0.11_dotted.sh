#!/bin/bash
# Vision-language RL written like OpenRLHF v0.11's examples/scripts/train_vlm_math_hybrid_engine.sh
# (dotted flags: images under --data.image_key, one per prompt, the vision encoder frozen,
# REINFORCE++-baseline), `python3 -m openrlhf.cli.train_ppo_ray` swapped for torchrun.
# Sizes are the test's: a tiny Qwen2.5-VL on 2 CPU ranks. Inputs: MODEL DATA SAVE PORT (PYTHON).
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
   --vllm.gpu_memory_utilization 0.7 \
   --vllm.enforce_eager \
   --vllm.enable_sleep \
   --ds.enable_sleep \
   --actor.model_name_or_path ${MODEL} \
   --reward.remote_url ${DATA}/reward.py \
   --ckpt.output_dir ${SAVE} \
   --ckpt.save_steps -1 \
   --data.prompt_dataset ${DATA}/prompts.jsonl \
   --data.input_key prompt \
   --data.label_key label \
   --data.image_key images \
   --data.max_images_per_prompt 1 \
   --actor.freeze_visual_encoder \
   --data.max_len 48 \
   --rollout.max_new_tokens 8 \
   --data.max_samples 16 \
   --data.apply_chat_template \
   --algo.advantage.estimator reinforce_baseline \
   --algo.kl.init_coef 1e-3 \
   --algo.kl.use_loss \
   --algo.kl.estimator k3 \
   --rollout.batch_size 8 \
   --rollout.n_samples_per_prompt 4 \
   --rollout.micro_batch_size 16 \
   --train.batch_size 32 \
   --train.micro_batch_size 8 \
   --train.max_epochs 1 \
   --actor.adam.lr 1e-3 \
   --ds.zero_stage 3 \
   --ds.attn_implementation eager \
   --ds.param_dtype bf16 \
   --logger.logging_steps 1
