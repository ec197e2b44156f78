"""One measured epoch of TRL's GRPOTrainer (one agent) on the benchmark workload; prints one RESULT line.

Runs in TRL's own virtual environment (bench.py creates it). TRL counts its batch in completions:
``per_device_train_batch_size`` = prompts per optimizer step x num_generations, with one
generation per optimizer step (``steps_per_generation`` = ``gradient_accumulation_steps`` = 1).
"""

from __future__ import annotations

import tempfile
import time

from common import (
    LEARNING_RATE,
    NEW_TOKENS,
    NUM_GENERATIONS,
    PROMPTS_PER_STEP,
    TEMPERATURE,
    Clock,
    load_prompts,
    model_path,
    report,
    runner_args,
    set_threads,
    team_reward,
)


def main() -> None:
    args = runner_args(__doc__)
    if args.agents != 1:
        raise SystemExit("run_trl.py: TRL's GRPOTrainer trains one model; use --agents 1")
    set_threads(args.threads)
    started = time.perf_counter()
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    prompts = load_prompts(args.workload, args.prompts)
    per_step = min(PROMPTS_PER_STEP[args.mode], len(prompts))
    clock = Clock()

    def length_reward(prompts, completions, completion_ids, **kwargs):  # noqa: ANN001, ANN003, ANN202
        """team_reward for one agent; also counts what TRL generated (it calls this once per generation)."""
        clock.completions += len(completions)
        clock.tokens += sum(len(ids) for ids in completion_ids)
        return team_reward(completions)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=per_step * NUM_GENERATIONS,
        gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=NEW_TOKENS,
        generation_kwargs={"min_new_tokens": NEW_TOKENS},
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        learning_rate=LEARNING_RATE,
        num_train_epochs=1,
        beta=0.0,
        gradient_checkpointing=False,  # TRL's default is True; comarl's is False: no recomputed forward
        bf16=args.bf16,
        use_cpu=args.device == "cpu",
        shuffle_dataset=False,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        seed=0,
    )

    class StartClock(TrainerCallback):
        """TRL builds its optimizer and prepares the model inside train(); comarl does that in its constructor.
        The clock starts at TRL's first step, so neither library's set-up is timed."""

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN202
            clock.start()

    trainer = GRPOTrainer(
        model=model_path(args.workload),
        reward_funcs=length_reward,
        args=config,
        train_dataset=Dataset.from_list(prompts),
        callbacks=[StartClock()],
    )
    setup_seconds = time.perf_counter() - started
    with clock:
        trainer.train()
    report(
        "trl",
        args,
        clock,
        setup_seconds,
        expected_completions=len(prompts) * NUM_GENERATIONS,
        optimizer_steps=trainer.state.global_step,
    )


if __name__ == "__main__":
    main()
