"""The bench harness behind ``make bench`` (``python -m scripts.bench``): fsdp-rlhf against TRL
on the same machine, side by side. Imported as ``scripts.benchkit`` from the repository root.

What is measured:
    matrix          the {bf16, fp32} x {tcmalloc, glibc} cells, each with the RM and GRPO rows
    rm              `fsdp-rlhf train-rm` against TRL's RewardTrainer
    rl              `fsdp-rlhf ppo` (GRPO, PPO with a critic) against TRL's GRPOTrainer
    offline         `fsdp-rlhf sft` and `dpo` against TRL's SFTTrainer and DPOTrainer
    lora            our GRPO step with LoRA adapters against full fine-tuning
    prefix          the shared prompt prefix on and off, one micro-batch in this process
    dynamic_batch   token-budget micro-batches against fixed-size ones
    logits_memory   peak host memory of one log-prob forward at a real vocabulary size
    vocab_memory    what a 151,936 / 248,320-token vocabulary adds to a GRPO step's peak
                    memory per rank, phase by phase, checkouts side by side; run on its own
    sequence_parallel
                    peak memory per rank and step time of one long sequence, SP=1 against SP=2
    memcpy          the weight-sync reference: a plain copy of the same bytes
    peak            the machine's matmul limit per dtype, and MFU against it
    async_vs_sync   `ppo --async_train` against the colocated step on the same 2 ranks
                    (a slow HTTP reward, responses of varied length); run on its own

How:
    workload        sizes, the locally built model and the synthetic data both sides read
    launch          one torchrun job observed from outside: step times, peak RSS
    phase_peaks     the CLI with each phase's own peak memory (anonymous and VmHWM)
    rates           steady-state rates and the statistics the report uses
    machine         CPU, cores, memory, load, library versions
    trl_rm_worker, trl_grpo_worker, trl_offline_worker
                    the TRL side, each run under torchrun as a script
    worker_exit     how those workers end (no interpreter teardown)

Reporting:
    report          medians, ratios, targets; the JSON file
    render          the comparison table (console and markdown)
    notes           the "where the time goes" notes, from the measured numbers
    summary         bench/results/summary.md
"""
