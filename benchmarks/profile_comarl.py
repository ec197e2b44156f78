"""Where comarl's training step spends its time on the benchmark workload.

Runs comarl's trainer step by step and prints the trainer's own phase timings (generate,
environment, update) summed over the epoch. For Python-level stacks run it under py-spy::

    py-spy record -r 200 -f raw -o profile.txt -- python benchmarks/profile_comarl.py --workload DIR --mode batched
"""

from __future__ import annotations

import time

from common import load_prompts, runner_args, set_threads
from run_comarl import build_trainer


def main() -> None:
    args = runner_args(__doc__)
    set_threads(args.threads)
    prompts = load_prompts(args.workload, args.prompts)
    trainer = build_trainer(args, prompts)
    totals: dict[str, float] = {}
    started = time.perf_counter()
    for items, seeds in trainer._batches():  # the trainer's own data order and seeds, one step at a time
        trainer.step += 1
        metrics, _ = trainer.training_step(items, seeds)
        for key, value in metrics.items():
            if key.startswith("time/"):
                totals[key] = totals.get(key, 0.0) + value
    wall = time.perf_counter() - started
    print(f"{args.agents} agent(s), mode {args.mode}: {trainer.step} steps in {wall:.2f} s")
    for key, value in sorted(totals.items()):
        print(f"  {key:<18} {value:7.2f} s  {100 * value / wall:5.1f}%")


if __name__ == "__main__":
    main()
