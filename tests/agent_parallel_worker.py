"""One process of the agent-parallel test (launched by tests/test_distributed.py through torchrun)."""

from __future__ import annotations

import json
import os
import sys

import torch

from comarl import MAREINFORCEConfig, MAREINFORCETrainer

sys.path.insert(0, os.path.dirname(__file__))
from test_distributed import DATA, run_args, two_word_reward  # noqa: E402


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    trainer = MAREINFORCETrainer(
        agents=spec["agents"],
        train_dataset=DATA,
        eval_dataset=DATA,
        reward_func=two_word_reward,
        args=MAREINFORCEConfig(**run_args(agent_parallel=True, output_dir=spec["output_dir"])),
    )
    metrics = trainer.train()
    result = {"metrics": metrics, "eval": trainer.evaluate(), "local": trainer.local}
    rank = trainer.parallel.rank
    with open(os.path.join(spec["output_dir"], f"rank_{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
