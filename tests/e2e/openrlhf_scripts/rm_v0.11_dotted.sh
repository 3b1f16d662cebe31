#!/bin/bash
# A reward model written like OpenRLHF v0.11's examples/scripts/train_rm.sh (dotted flags),
# `deepspeed --module openrlhf.cli.train_rm` swapped for torchrun.
# Inputs: MODEL DATA SAVE PORT (PYTHON).
set -x

read -r -d '' training_commands <<EOF2
fsdp_rlhf.cli train-rm \
   --ckpt.output_dir ${SAVE} \
   --ckpt.save_steps -1 \
   --logger.logging_steps 1 \
   --eval.steps -1 \
   --train.batch_size 16 \
   --train.micro_batch_size 4 \
   --model.model_name_or_path ${MODEL} \
   --ds.param_dtype bf16 \
   --ds.zero_stage 3 \
   --train.max_epochs 1 \
   --data.max_len 64 \
   --ds.zpg 1 \
   --adam.lr 9e-6 \
   --data.dataset ${DATA}/pairs.jsonl \
   --data.prompt_key prompt \
   --data.chosen_key chosen \
   --data.rejected_key rejected \
   --data.max_samples 72 \
   --ds.attn_implementation flash_attention_2 \
   --ds.packing_samples \
   --model.gradient_checkpointing_enable
EOF2

"${PYTHON:-python3}" -m torch.distributed.run --nproc_per_node 2 \
   --master_addr 127.0.0.1 --master_port ${PORT} -m $training_commands
