"""One measured epoch of CoMLRL 1.4.3's MAGRPOTrainer on the benchmark workload; prints one RESULT line.

Runs in CoMLRL's own virtual environment (bench.py creates it). CoMLRL generates for one dataset
item at a time (its DataLoader has batch_size=1); ``rollout_buffer_size`` = ``train_batch_size`` =
prompts per optimizer step (1 in the peer's semantics, 8 in batched mode).
"""

from __future__ import annotations

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
    if args.bf16:
        raise SystemExit(
            "run_comlrl.py: --bf16 is for comarl and TRL only; this runner measures the fp32 workload"
        )
    set_threads(args.threads)
    started = time.perf_counter()
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    prompts = load_prompts(args.workload, args.prompts)
    per_step = min(PROMPTS_PER_STEP[args.mode], len(prompts))
    config = MAGRPOConfig(
        num_train_epochs=1,
        agent_learning_rate=LEARNING_RATE,
        logging_steps=10**6,
        num_agents=args.agents,
        num_generations=NUM_GENERATIONS,
        max_new_tokens=NEW_TOKENS,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,  # 0 = off; None would fall back to transformers' default top_k=50
        num_turns=1,
        eval_interval=0,
        eval_num_samples=0,
        rollout_buffer_size=per_step,
        train_batch_size=per_step,
        agent_devices=args.device,
    )
    trainer = MAGRPOTrainer(
        agent_model=model_path(args.workload),
        num_agents=args.agents,
        train_dataset=prompts,
        reward_func=team_reward,
        formatters=[lambda item: item["prompt"]] * args.agents,
        args=config,
    )
    trainer.verbose = False  # no tqdm bar (comarl's runs have progress_bar=False too)
    clock = Clock()
    generate = trainer._generate_completions

    def counted_generate(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        out = generate(*a, **kw)
        clock.completions += len(out["response_lens"])
        clock.tokens += sum(out["response_lens"])
        return out

    trainer._generate_completions = counted_generate
    setup_seconds = time.perf_counter() - started
    with clock:
        # CoMLRL forwards train(**kwargs) to model.generate: this forces exactly NEW_TOKENS tokens.
        trainer.train(min_new_tokens=NEW_TOKENS)
    report(
        "comlrl",
        args,
        clock,
        setup_seconds,
        expected_completions=len(prompts) * NUM_GENERATIONS * args.agents,
    )


if __name__ == "__main__":
    main()
