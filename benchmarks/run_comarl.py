"""One measured epoch of comarl's MAGRPOTrainer on the benchmark workload; prints one RESULT line."""

from __future__ import annotations

import time
from typing import Any

from common import (
    LEARNING_RATE,
    NEW_TOKENS,
    NUM_GENERATIONS,
    PROMPTS_PER_STEP,
    TEMPERATURE,
    Clock,
    load_prompts,
    model_path,
    peak_rss_mb,
    report,
    runner_args,
    set_threads,
    team_reward,
)


def build_trainer(args: Any, prompts: list[dict[str, str]]) -> Any:
    """comarl's MAGRPOTrainer on the workload, configured like the peers (see docs/benchmarks.md)."""
    from comarl import MAGRPOConfig, MAGRPOTrainer

    config = MAGRPOConfig(
        num_generations=NUM_GENERATIONS,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=None,
        prompts_per_step=min(PROMPTS_PER_STEP[args.mode], len(prompts)),
        num_train_epochs=1,
        learning_rate=LEARNING_RATE,
        reward_call="batched",
        logging_steps=10**6,
        log_completions=0,
        progress_bar=False,
        output_dir=None,
        shuffle=False,
        agent_devices=args.device,
        agent_parallel=args.agent_parallel,
        bf16=args.bf16,
        keep_freed_memory=not args.glibc_malloc,
    )
    trainer = MAGRPOTrainer(
        model=model_path(args.workload),
        num_agents=args.agents,
        train_dataset=prompts,
        reward_func=team_reward,
        formatters=[lambda item: item["prompt"]] * args.agents,
        args=config,
    )
    trainer.engine.fast_decoding = not args.plain_decoding
    return trainer


def main() -> None:
    from comarl.distributed import finish

    args = runner_args(__doc__)
    set_threads(args.threads)
    started = time.perf_counter()
    prompts = load_prompts(args.workload, args.prompts)
    trainer = build_trainer(args, prompts)
    clock = Clock()
    generate = trainer.engine.generate

    def counted_generate(agent, prompts, num_generations, params, seeds=None):  # noqa: ANN001, ANN202
        gen = generate(agent, prompts, num_generations, params, seeds)
        clock.completions += len(gen.completions)
        clock.tokens += gen.num_tokens
        return gen

    trainer.engine.generate = counted_generate
    setup_seconds = time.perf_counter() - started
    with clock:
        trainer.train()
    extra = {}
    if trainer.parallel is not None:
        # One process per agent: each counted its own agent. The team's numbers: completions, tokens and CPU
        # time summed over the processes, wall time of the slowest, memory summed (and the largest process).
        parts = trainer.parallel.gather(
            (clock.completions, clock.tokens, clock.cpu_seconds, clock.seconds, peak_rss_mb())
        )
        if trainer.parallel.rank != 0:
            finish()
        clock.completions, clock.tokens = sum(p[0] for p in parts), sum(p[1] for p in parts)
        clock.cpu_seconds, clock.seconds = sum(p[2] for p in parts), max(p[3] for p in parts)
        extra = {
            "peak_rss_mb": round(sum(p[4] for p in parts), 1),
            "peak_rss_mb_per_process": round(max(p[4] for p in parts), 1),
        }
    report(
        "comarl-ap" if trainer.parallel is not None else "comarl",
        args,
        clock,
        setup_seconds,
        expected_completions=len(prompts) * NUM_GENERATIONS * args.agents,
        optimizer_steps=trainer.step,
        **extra,
    )
    if trainer.parallel is not None:
        finish()  # as `comarl train` ends under torchrun: a normal exit can abort a finished run (distributed.finish)


if __name__ == "__main__":
    main()
