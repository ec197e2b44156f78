"""Agent parallelism (one process per agent under torchrun, gloo on CPU) computes what one process computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from comarl import ConfigError, MAACConfig, MAREINFORCEConfig, MAREINFORCETrainer

DATA = [{"prompt": p} for p in ("def add(a, b):", "the agents meet at", "alice and bob", "return a + b")]


def two_word_reward(a, b):
    """Shared reward that differs between joint actions, so every agent gets a gradient."""
    return [len(x) / 10 - len(y) / 20 for x, y in zip(a, b)]


def run_args(**kw) -> dict:
    # top_k=1: sampling is the argmax, so both launches see the same completions whatever their RNG streams;
    # MAREINFORCE's raw-return advantages are non-zero without sampling noise.
    base = dict(
        prompts_per_step=2,
        num_generations=2,
        max_new_tokens=5,
        top_k=1,
        learning_rate=1e-3,
        max_steps=2,
        progress_bar=False,
        reward_call="batched",
        eval_interval=0,
        seed=5,
    )
    base.update(kw)
    return base


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains(qwen_bpe, llama_word, tmp_path):
    single = MAREINFORCETrainer(
        agents=[qwen_bpe, llama_word],
        train_dataset=DATA,
        eval_dataset=DATA,
        reward_func=two_word_reward,
        args=MAREINFORCEConfig(**run_args()),
    )
    expected = single.train()
    expected_eval = single.evaluate()

    out = tmp_path / "run"
    out.mkdir()
    spec = json.dumps({"agents": [qwen_bpe, llama_word], "output_dir": str(out)})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(Path(__file__).parent / "agent_parallel_worker.py"),
            spec,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]
    assert [r["local"] for r in ranks] == [[0], [1]]
    for r in ranks:  # every process reports the team's and every agent's metrics, equal to the single run's
        for key in ("reward", "agent_0/reward", "agent_1/reward", "agent_0/grad_norm", "agent_1/grad_norm"):
            assert r["metrics"][key] == pytest.approx(expected[key], rel=1e-5), key
        assert r["eval"]["eval/reward"] == pytest.approx(expected_eval["eval/reward"], rel=1e-5)
    # Each process saved its own agent; the weights equal the single process's.
    for i, agent in enumerate(single.team):
        saved = AutoModelForCausalLM.from_pretrained(out / "agents" / f"agent_{i}")
        for (name, p), q in zip(agent.model.named_parameters(), saved.parameters()):
            assert torch.allclose(p, q, atol=1e-6), (i, name)
    assert (out / "metrics.jsonl").exists()  # process 0 writes the run folder


def test_agent_parallel_needs_torchrun(qwen_bpe, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(
        ConfigError,
        match=r"agent_parallel=True needs one process per agent: launch with `torchrun --nproc-per-node=2",
    ):
        MAREINFORCETrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=two_word_reward,
            args=MAREINFORCEConfig(**run_args(agent_parallel=True)),
        )


def test_actor_critic_trainers_refuse_agent_parallel():
    with pytest.raises(
        ConfigError, match=r"agent_parallel=True is not supported by the actor-critic trainers yet"
    ):
        MAACConfig(agent_parallel=True)
