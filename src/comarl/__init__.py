"""comarl: train teams of distinct LLMs to cooperate with multi-agent reinforcement learning.

Names are imported lazily, so ``import comarl`` is cheap and touches neither torch nor the network.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "MAGRPOConfig": "comarl.config",
    "MAREINFORCEConfig": "comarl.config",
    "MARLOOConfig": "comarl.config",
    "MAReMaxConfig": "comarl.config",
    "ActorCriticConfig": "comarl.config",
    "IACConfig": "comarl.config",
    "MAACConfig": "comarl.config",
    "IPPOConfig": "comarl.config",
    "MAPPOConfig": "comarl.config",
    "MADPOConfig": "comarl.config",
    "MARLHFConfig": "comarl.config",
    "ConfigError": "comarl.config",
    "MAGRPOTrainer": "comarl.trainers.magrpo",
    "MAREINFORCETrainer": "comarl.trainers.magrpo",
    "MARLOOTrainer": "comarl.trainers.magrpo",
    "MAReMaxTrainer": "comarl.trainers.magrpo",
    "ActorCriticTrainer": "comarl.trainers.actor_critic",
    "IACTrainer": "comarl.trainers.actor_critic",
    "MAACTrainer": "comarl.trainers.actor_critic",
    "IPPOTrainer": "comarl.trainers.actor_critic",
    "MAPPOTrainer": "comarl.trainers.actor_critic",
    "MADPOTrainer": "comarl.trainers.preference",
    "MARLHFTrainer": "comarl.trainers.preference",
    "RewardModelEnv": "comarl.trainers.preference",
    "Agent": "comarl.agents",
    "Team": "comarl.agents",
    "Env": "comarl.envs",
    "StepResult": "comarl.envs",
    "FunctionEnv": "comarl.envs",
    "RewardFunctionError": "comarl.envs",
    "evaluate_task": "comarl.evaluation",
    "pass_at_k": "comarl.evaluation",
    "WritingCollabEnv": "comarl.tasks.writing",
    "CodeCollabEnv": "comarl.tasks.code",
    "SandboxLimits": "comarl.sandbox",
    "SandboxPool": "comarl.sandbox",
    "RunResult": "comarl.sandbox",
    "run_python": "comarl.sandbox",
    "HFEngine": "comarl.engines",
    "SamplingParams": "comarl.engines",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'comarl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
