"""LoRA agents (peft): only adapters train, the KL reference is the base with adapters off, adapters save and load."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from comarl import ConfigError, IPPOConfig, IPPOTrainer, MAGRPOConfig, MAGRPOTrainer
from comarl.agents import Agent, WithoutAdapters, has_adapters

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
        trained = trainer.team[0].model(input_ids=ids).logits
        assert torch.allclose(loaded(input_ids=ids).logits, trained, atol=1e-5)


def test_a_shared_base_from_a_saved_lora_agent_is_refused(qwen_bpe, tmp_path):
    """lora_shared_base gives every agent a new adapter on the base: from a saved LoRA agent's folder the saved
    adapter sat unused beside them (training restarted from the base without a word)."""
    first = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda a: [len(x) for x in a],
        args=MAGRPOConfig(**lora_args()),
    )
    first.save_model(tmp_path)
    with pytest.raises(ConfigError, match=r"^lora_shared_base=True: .*agent_0 is a saved LoRA agent"):
        MAGRPOTrainer(
            model=str(tmp_path / "agent_0"),
            num_agents=2,
            train_dataset=DATA,
            reward_func=lambda a, b: [0.0],
            args=MAGRPOConfig(**lora_args(), lora_shared_base=True),
        )


def test_a_saved_lora_agent_trains_on_from_its_adapter(qwen_bpe, tmp_path):
    """An agent folder that save_model wrote loaded frozen (transformers' adapter loading): without lora_r the
    optimizer got no parameters; with lora_r a fresh adapter named like the saved one replaced it (training restarted
    from the base). It now loads as a trainable peft model: training continues the saved adapter."""
    first = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda a: [len(x) for x in a],
        args=MAGRPOConfig(**lora_args()),
    )
    first.train()
    first.save_model(tmp_path)
    ids = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        trained = first.team[0].model(input_ids=ids).logits
    agent = Agent.from_pretrained(tmp_path / "agent_0")
    assert has_adapters(agent.model)
    trainable = {n: p.detach().clone() for n, p in agent.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for lora_r in (None, 4):  # the folder's adapter is the one that trains, with or without lora_r
        again = MAGRPOTrainer(
            model=str(tmp_path / "agent_0"),
            num_agents=1,
            train_dataset=DATA,
            reward_func=lambda a: [len(x) for x in a],
            args=MAGRPOConfig(**lora_args(lora_r=lora_r, beta=0.1, max_steps=1)),
        )
        model = again.team[0].model
        with torch.no_grad():
            assert torch.allclose(model(input_ids=ids).logits, trained, atol=1e-5)
        again.train()
        moved = {
            n for n, p in model.named_parameters() if n in trainable and not torch.equal(p, trainable[n])
        }
        assert moved == set(trainable)


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


def test_target_modules_that_match_nothing_stop_before_any_weights_load(qwen_bpe, monkeypatch):
    import comarl.trainers.magrpo as magrpo

    error = (
        r"lora_target_modules=\['qkv'\]: no module of Qwen2ForCausalLM matches; name some of its linear layers "
        r"\(down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj\) or give 'all-linear'"
    )
    monkeypatch.setattr(magrpo, "_load_agent", lambda *args: pytest.fail("weights were loaded"))
    with pytest.raises(ConfigError, match=error):  # the memory check builds the model on the meta device
        MAGRPOTrainer(
            model=qwen_bpe,
            train_dataset=DATA,
            reward_func=length_reward,
            args=MAGRPOConfig(**lora_args(lora_target_modules=["qkv"])),
        )
    monkeypatch.undo()
    # without the memory check, when the adapters are added to the loaded model, and with a shared base
    for shared in (False, True):
        with pytest.raises(ConfigError, match=error):
            MAGRPOTrainer(
                model=qwen_bpe,
                train_dataset=DATA,
                reward_func=length_reward,
                args=MAGRPOConfig(
                    **lora_args(lora_target_modules=["qkv"], check_memory=False, lora_shared_base=shared)
                ),
            )


# ---------------------------------------------------------------------------- one base shared by every agent


def _lora_weights(agent):
    return {
        n.replace(".agent_0.", ".X.")
        .replace(".agent_1.", ".X.")
        .replace(".default.", ".X."): p.detach().clone()
        for n, p in agent.model.named_parameters()
        if "lora_" in n
    }


@pytest.mark.parametrize("trainer_name", ["MAGRPO", "MADPO", "IPPO"])
def test_shared_base_team_trains_exactly_like_separate_lora_agents(qwen_bpe, tmp_path, trainer_name):
    """lora_shared_base: one base in memory, one adapter per agent; every metric, adapter weight and saved agent
    equals a team of separate LoRA copies (same adapter seeds), with a KL reference (adapters off)."""
    import comarl

    def run(shared, out=None):
        extra = {
            "MAGRPO": {"beta": 0.05},
            "MADPO": {"candidates_from": "current"},
            "IPPO": {"num_iterations": 2},  # value heads read the base through the agent's adapter
        }[trainer_name]
        args = getattr(comarl, f"{trainer_name}Config")(
            **lora_args(num_generations=4, lora_shared_base=shared, output_dir=out, seed=7, **extra)
        )
        trainer = getattr(comarl, f"{trainer_name}Trainer")(
            model=qwen_bpe, num_agents=2, train_dataset=DATA, reward_func=length_reward, args=args
        )
        return trainer, trainer.train()

    separate, expected = run(False)
    shared, metrics = run(True, str(tmp_path))
    base = shared.team[0].model.get_base_model()
    assert shared.team[1].model.get_base_model() is base  # one copy of the base weights
    assert separate.team[1].model.get_base_model() is not separate.team[0].model.get_base_model()
    compared = [k for k in expected if not k.startswith("time/") and k != "completions_per_s"]
    assert any(k.startswith("agent_1/") for k in compared)
    for key in compared:
        assert metrics[key] == expected[key], key
    for a, b in zip(separate.team, shared.team):
        mine, theirs = _lora_weights(a), _lora_weights(b)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    # the agents differ from each other, and agent 1's saved folder loads as agent 1
    assert not torch.equal(*[next(iter(_lora_weights(a).values())) for a in shared.team])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "agents" / "agent_1")
    ids = shared.team[1].tokenizer(["alice and bob"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(
            loaded(input_ids=ids).logits, shared.team[1].model(input_ids=ids).logits, atol=1e-5
        )
        assert not torch.allclose(
            loaded(input_ids=ids).logits, shared.team[0].model(input_ids=ids).logits, atol=1e-5
        )


def test_shared_base_from_a_model_object(qwen_bpe):
    """lora_shared_base=True with model=<a model object>: the object is the one base (it was refused, after a deep
    copy per agent); one that already holds adapters is refused (every agent gets a new adapter)."""
    from transformers import AutoTokenizer

    from comarl.agents import add_lora

    model = AutoModelForCausalLM.from_pretrained(qwen_bpe)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = MAGRPOTrainer(
        model=model,
        num_agents=2,
        tokenizer=AutoTokenizer.from_pretrained(qwen_bpe),
        train_dataset=DATA,
        reward_func=length_reward,
        args=MAGRPOConfig(**lora_args(lora_shared_base=True, max_steps=1)),
    )
    trainer.train()
    assert trainer.team[0].model.get_base_model() is model and trainer.team[1].model.get_base_model() is model
    assert all(
        torch.equal(p, q)
        for p, q in zip(before, (p for n, p in model.named_parameters() if "lora_" not in n))
    )
    adapted = add_lora(AutoModelForCausalLM.from_pretrained(qwen_bpe), 4, 8, None)
    with pytest.raises(
        ConfigError, match=r"lora_shared_base=True: the model object \(\w+\) already holds peft adapters"
    ):
        MAGRPOTrainer(
            model=adapted,
            num_agents=2,
            tokenizer=AutoTokenizer.from_pretrained(qwen_bpe),
            train_dataset=DATA,
            reward_func=length_reward,
            args=MAGRPOConfig(**lora_args(lora_shared_base=True)),
        )


def test_shared_base_errors(qwen_bpe, llama_word):
    with pytest.raises(
        ConfigError, match="lora_shared_base=True shares a base between LoRA adapters: set lora_r="
    ):
        MAGRPOConfig(lora_shared_base=True)
    with pytest.raises(ConfigError, match="agent_parallel=True gives every agent its own process"):
        MAGRPOConfig(lora_r=4, lora_shared_base=True, agent_parallel=True)
    with pytest.raises(ConfigError, match="lora_shared_base=True: every agent must name the same model"):
        MAGRPOTrainer(
            agents=[qwen_bpe, llama_word],
            train_dataset=DATA,
            reward_func=length_reward,
            args=MAGRPOConfig(**lora_args(lora_shared_base=True)),
        )


def test_shared_base_agent_owns_its_embedding_adapter(qwen_bpe):
    """peft names an embedding's adapter '...embed_tokens.lora_embedding_A.agent_0' (no dot after the adapter's
    name): the agent's parameters, optimizer and checkpoint state must hold it, and training must move it, as for
    a separate LoRA agent (a '.agent_0.' match left it out of all three)."""
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=MAGRPOConfig(**lora_args(lora_shared_base=True, lora_target_modules=["embed_tokens", "q_proj"])),
    )
    agent = trainer.team[0].model
    embedding = {n: p for n, p in agent.named_parameters() if "lora_embedding" in n}
    assert sorted(n.split(".")[-2:] for n in embedding) == [
        ["lora_embedding_A", "agent_0"],
        ["lora_embedding_B", "agent_0"],
    ]
    in_optimizer = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert all(id(p) in in_optimizer for p in embedding.values())
    assert set(embedding) <= set(agent.state_dict())
    before = {n: p.detach().clone() for n, p in embedding.items()}
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in embedding.items())
