#!/bin/bash
# Knowledge distillation written like OpenRLHF's examples/scripts/train_knowledge_distillation.sh
# of its releases (0.4 to 0.9.1: --pretrain, --save_path, --bf16, --flash_attn), with
# `deepspeed --module openrlhf.cli.train_kd` swapped for torchrun. Sizes are the test's: tiny
# models on 2 CPU ranks. Inputs: MODEL TEACHER DATA SAVE PORT (PYTHON).
set -x

read -r -d '' training_commands <<EOF2
fsdp_rlhf.cli kd \
   --max_len 64 \
   --dataset ${DATA}/kd.jsonl \
   --input_key question \
   --output_key response \
   --train_batch_size 16 \
   --micro_train_batch_size 4 \
   --max_samples 48 \
   --pretrain ${MODEL} \
   --teacher_model ${TEACHER} \
   --save_path ${SAVE} \
   --save_steps -1 \
   --logging_steps 1 \
   --eval_steps -1 \
   --zero_stage 3 \
   --max_epochs 1 \
   --bf16 \
   --flash_attn \
   --kd_coef 0.4 \
   --learning_rate 5e-4 \
   --teacher_offload \
   --gradient_checkpointing
EOF2

"${PYTHON:-python3}" -m torch.distributed.run --nproc_per_node 2 \
   --master_addr 127.0.0.1 --master_port ${PORT} -m $training_commands
