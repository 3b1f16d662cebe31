#!/bin/bash
# Knowledge distillation written like train_knowledge_distillation.sh on OpenRLHF's FSDP2 branch
# (pr-1176-rebased-clean, 2026-03: --model_name_or_path, --ckpt_save_path, --param_dtype,
# --attn_implementation; never released), `torchrun -m openrlhf.cli.train_kd` swapped for
# fsdp_rlhf.cli kd. Sizes are the test's. Inputs: MODEL TEACHER DATA SAVE PORT (PYTHON).
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
   --model_name_or_path ${MODEL} \
   --teacher_model ${TEACHER} \
   --ckpt_save_path ${SAVE} \
   --save_steps -1 \
   --logging_steps 1 \
   --eval_steps -1 \
   --max_epochs 1 \
   --param_dtype bf16 \
   --attn_implementation flash_attention_2 \
   --kd_coef 0.4 \
   --learning_rate 5e-4 \
   --teacher_offload \
   --gradient_checkpointing
EOF2

"${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node 2 \
   -m $training_commands
