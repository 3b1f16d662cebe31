#!/bin/bash
# Vision-language RL written like OpenRLHF v0.10's train_vlm_math_hybrid_engine.sh (flat flags:
# --image_key, --max_images_per_prompt, --freeze_visual_encoder), `ray job submit ... --
# python3 -m openrlhf.cli.train_ppo_ray` swapped for torchrun. Sizes are the test's: a tiny
# Qwen2.5-VL on 2 CPU ranks. Inputs: MODEL DATA SAVE PORT (PYTHON).
set -x

"${PYTHON:-python3}" -m torch.distributed.run --nproc_per_node 2 \
   --master_addr 127.0.0.1 --master_port ${PORT} \
   -m fsdp_rlhf.cli ppo \
   --ref_num_nodes 1 \
   --ref_num_gpus_per_node 2 \
   --actor_num_nodes 1 \
   --actor_num_gpus_per_node 2 \
   --vllm_num_engines 2 \
   --vllm_tensor_parallel_size 1 \
   --colocate_all_models \
   --vllm_gpu_memory_utilization 0.7 \
   --enforce_eager \
   --vllm_enable_sleep \
   --deepspeed_enable_sleep \
   --pretrain ${MODEL} \
   --remote_rm_url ${DATA}/reward.py \
   --save_path ${SAVE} \
   --save_steps -1 \
   --prompt_data ${DATA}/prompts.jsonl \
   --input_key prompt \
   --label_key label \
   --image_key images \
   --max_images_per_prompt 1 \
   --freeze_visual_encoder \
   --max_len 48 \
   --max_new_tokens 8 \
   --max_samples 16 \
   --apply_chat_template \
   --advantage_estimator reinforce_baseline \
   --init_kl_coef 1e-3 \
   --use_kl_loss \
   --kl_estimator k3 \
   --rollout_batch_size 8 \
   --n_samples_per_prompt 4 \
   --micro_rollout_batch_size 16 \
   --train_batch_size 32 \
   --micro_train_batch_size 8 \
   --max_epochs 1 \
   --actor_learning_rate 1e-3 \
   --zero_stage 3 \
   --attn_implementation eager \
   --logging_steps 1
