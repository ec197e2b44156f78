"""LoRA agents (peft): only adapters train, the KL reference is the base with adapters off, adapters save and load."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from comarl import ConfigError, IPPOConfig, IPPOTrainer, MAGRPOConfig, MAGRPOTrainer
from comarl.agents import WithoutAdapters

DATA = [{"prompt": p} for p in ("def add(a, b):", "the agents meet at", "alice and bob", "return a + b")]


def length_reward(a, b):
    return [len(x) / 10 - len(y) / 20 for x, y in zip(a, b)]


def lora_args(**kw):
    base = dict(
        prompts_per_step=2,
        num_generations=3,
        max_new_tokens=5,
        learning_rate=1e-2,
        max_steps=2,
        progress_bar=False,
        reward_call="batched",
        lora_r=4,
    )
    base.update(kw)
    return base


def test_only_adapters_train_on_a_heterogeneous_team_and_the_reference_is_the_base(qwen_bpe, llama_word):
    trainer = MAGRPOTrainer(
        agents=[qwen_bpe, llama_word],
        train_dataset=DATA,
        reward_func=length_reward,
        args=MAGRPOConfig(**lora_args(beta=0.1)),
    )
    before = [{n: p.detach().clone() for n, p in a.model.named_parameters()} for a in trainer.team]
    metrics = trainer.train()
    for i, agent in enumerate(trainer.team):
        moved = {n for n, p in agent.model.named_parameters() if not torch.equal(p, before[i][n])}
        adapters = {n for n, _ in agent.model.named_parameters() if "lora_" in n}
        assert adapters and moved == adapters, f"agent {i}: {sorted(moved ^ adapters)[:4]}"
        # The reference shares the agent's weights (no copy) and scores as the untrained base model.
        reference = trainer.references[i]
        assert isinstance(reference, WithoutAdapters) and reference.model is agent.model
        base = AutoModelForCausalLM.from_pretrained([qwen_bpe, llama_word][i])
        ids = agent.tokenizer(["alice and bob"], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            assert torch.allclose(reference(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-5)
            assert not torch.allclose(
                agent.model(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-5
            )
    assert metrics["agent_0/kl"] > 0


def test_saved_adapters_load_back_as_the_trained_agent(qwen_bpe, tmp_path):
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda a: [len(x) for x in a],
        args=MAGRPOConfig(**lora_args()),
    )
    trainer.train()
    trainer.save_model(tmp_path)
    assert (tmp_path / "agent_0" / "adapter_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "agent_0")  # base by path + adapter
    ids = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        assert torch.allclose(
            loaded(input_ids=ids).logits, trainer.team[0].model(input_ids=ids).logits, atol=1e-5
        )


def test_value_heads_train_on_lora_agents(qwen_bpe):
    trainer = IPPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=IPPOConfig(**lora_args()),
    )
    heads = [h.linear.weight.detach().clone() for h in trainer.value_heads]
    metrics = trainer.train()
    assert all(not torch.equal(h.linear.weight, w) for h, w in zip(trainer.value_heads, heads))
    assert metrics["agent_1/value_loss"] > 0


def test_lora_rank_is_checked():
    with pytest.raises(
        ConfigError, match=r"lora_r=0: must be an integer >= 1 \(or None for full fine-tuning\)"
    ):
        MAGRPOConfig(lora_r=0)
