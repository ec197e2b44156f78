"""One process of the agent- and data-parallel tests (launched by tests/test_distributed.py through torchrun).

It runs a list of runs one after the other in the same processes (and process group): starting the processes
costs ~10x one of these 2-step runs."""

from __future__ import annotations

import json
import os
import random
import sys

import torch
from torch.distributed.tensor import DTensor

import comarl
from comarl.distributed import finish
from comarl.trainers.preference import reward_scores

sys.path.insert(0, os.path.dirname(__file__))
from test_distributed import (  # noqa: E402
    DATA,
    candidate_texts,
    run_args,
    second_turn_for_the_first,
    two_word_reward,
)


def main() -> None:
    torch.set_num_threads(1)
    for spec in json.loads(sys.argv[1]):
        run(spec)


def run(spec: dict) -> None:
    """Train one run and write what this process saw to output_dir/rank_<r>.json."""
    name = spec["trainer"]
    launch = {
        "agent": {"agent_parallel": True},
        "data": {"data_parallel": True},
        "grid": {"agent_parallel": True, "data_parallel": True},
    }[spec.get("launch", "agent")]
    args = getattr(comarl, f"{name}Config")(
        **run_args(**launch, output_dir=spec["output_dir"], **spec["overrides"])
    )
    trainer = getattr(comarl, f"{name}Trainer")(
        agents=spec["agents"],
        train_dataset=DATA,
        eval_dataset=DATA,
        reward_func=two_word_reward,
        transition=second_turn_for_the_first if args.num_turns > 1 else None,
        args=args,
    )
    fitted = {}
    if spec.get("fit_first"):  # MARLHF: stage 1 by hand, to hand its pairs to the test
        texts = trainer._preference_texts()
        fitted = {"texts": texts, "metrics": trainer.fit_reward_model(pairs=texts)}
        fitted["scores"] = reward_scores(trainer.reward_model, texts[0] + texts[1]).tolist()
    metrics = trainer.train(resume_from_checkpoint=True if spec.get("resume") else None)
    result = {
        "metrics": metrics,
        "eval": trainer.evaluate(),
        "local": trainer.local,
        "torch_seed": torch.initial_seed(),
        # streams environments and joint-action sampling draw from: per data shard, equal within an episode's
        # processes (agent_parallel)
        "python_draw": random.random(),
        "joint_seed": trainer.joint_generator.initial_seed(),
        "fitted": fitted,
        # parameters of each agent this process holds, and of the whole agent (shard_weights: a share of it)
        "held": {i: sum(local(p).numel() for p in trainer.team[i].model.parameters()) for i in trainer.local},
        "parameters": {i: sum(p.numel() for p in trainer.team[i].model.parameters()) for i in trainer.local},
        # of each agent's KL reference copy (shard_weights: a share of it, also after its forwards)
        "reference_held": {
            i: sum(local(p).numel() for p in r.parameters())
            for i, r in enumerate(trainer.references or [])
            if isinstance(r, torch.nn.Module)
        },
        # the weights this process holds, to compare processes that should hold the same
        "weights": {
            i: sum(float(whole(p).double().sum()) for p in trainer.team[i].model.parameters())
            for i in trainer.local
        },
    }
    candidates = getattr(trainer, "candidates", None)  # MADPO's candidates of the initial team
    if candidates is not None:
        result["candidates"] = candidate_texts(candidates)
    with open(os.path.join(spec["output_dir"], f"rank_{trainer.processes.rank}.json"), "w") as f:
        json.dump(result, f)


def local(param: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this process holds."""
    return param.to_local() if isinstance(param, DTensor) else param


def whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor (gathered from every data shard under shard_weights)."""
    return param.full_tensor() if isinstance(param, DTensor) else param


if __name__ == "__main__":
    main()
    finish()  # as `comarl train` ends a distributed run (see comarl.distributed.finish)
