"""The MAGRPO-family trainer end to end on tiny local models: masking, updates, teams, compatibility, errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comarl import (
    Agent,
    ConfigError,
    MAGRPOConfig,
    MAGRPOTrainer,
    MAREINFORCEConfig,
    MAREINFORCETrainer,
    MAReMaxConfig,
    MAReMaxTrainer,
    MARLOOConfig,
    MARLOOTrainer,
    RewardFunctionError,
)
from comarl.engines import HFEngine, SamplingParams

DATA = [{"prompt": p} for p in ("def add(a, b):", "the agents meet at", "alice and bob", "return a + b")]


def length_reward(a, b):
    """Shared reward that varies between samples, so every advantage is non-zero."""
    return [len(x) / 10 - len(y) / 20 for x, y in zip(a, b)]


def small_args(**kw) -> MAGRPOConfig:
    base = dict(
        prompts_per_step=2,
        num_generations=3,
        max_new_tokens=6,
        learning_rate=1e-3,
        max_steps=1,
        progress_bar=False,
        reward_call="batched",
    )
    base.update(kw)
    return MAGRPOConfig(**base)


# ---------------------------------------------------------------------------- log-probs and masking


def test_batched_logprobs_match_unpadded_per_sequence(qwen_bpe):
    """Left padding + position ids: each sequence's batched log-probs equal its own unpadded forward."""
    agent = Agent.from_pretrained(qwen_bpe)
    gen = HFEngine().generate(agent, ["a", "def add(a, b): return"], 2, SamplingParams(max_new_tokens=5))
    batched = agent.completion_logprobs(
        gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask
    )
    for r in range(gen.prompt_ids.shape[0]):
        prompt = gen.prompt_ids[r][gen.prompt_mask[r].bool()]
        n = int(gen.completion_mask[r].sum())
        completion = gen.completion_ids[r, :n]
        ids = torch.cat([prompt, completion]).unsqueeze(0)
        logits = agent.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(batched[r, :n], expected, atol=1e-5, rtol=1e-4)


def test_eos_is_scored_and_padding_is_not(qwen_bpe):
    """The loss depends on the EOS token but not on anything after it."""
    agent = Agent.from_pretrained(qwen_bpe)
    eos = agent.eos_token_ids[0]
    prompt_ids, prompt_mask = agent.encode(["alice and bob"])
    completion = torch.tensor([[17, 23, eos, 5, 9]])
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    from comarl.engines import completion_mask

    assert completion_mask(completion, [eos]).tolist() == mask.tolist()
    base = agent.completion_logprobs(prompt_ids, prompt_mask, completion, mask)
    other_pad = agent.completion_logprobs(prompt_ids, prompt_mask, torch.tensor([[17, 23, eos, 99, 3]]), mask)
    assert torch.equal(base[:, :3], other_pad[:, :3])  # tokens after EOS do not reach the scored positions
    other_eos_logp = agent.completion_logprobs(
        prompt_ids, prompt_mask, torch.tensor([[17, 23, 42, 5, 9]]), mask
    )
    assert not torch.equal(base[:, 2], other_eos_logp[:, 2])  # the EOS position itself is scored


def test_eos_inside_the_prompt_does_not_cut_the_completion(qwen_bpe):
    """pad == eos and a prompt containing EOS (as chat templates do): the completion starts after the prompt."""
    agent = Agent.from_pretrained(qwen_bpe)
    assert agent.tokenizer.pad_token == agent.tokenizer.eos_token  # set because the tokenizer had none
    prompt = f"system{agent.tokenizer.eos_token}user: def add(a, b):"
    torch.manual_seed(0)
    gen = HFEngine().generate(agent, [prompt, "x"], 2, SamplingParams(max_new_tokens=4, min_new_tokens=4))
    prompt_ids, _ = agent.encode([prompt])
    assert (prompt_ids == agent.eos_token_ids[0]).any()  # the EOS really is in the prompt
    assert gen.completion_ids.shape[1] == 4
    assert gen.completion_mask.sum(dim=1).tolist() == [4, 4, 4, 4]  # min_new_tokens: no EOS in the completion
    assert all(len(c) > 0 for c in gen.completions)


# ---------------------------------------------------------------------------- one training step


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_heterogeneous_team_every_parameter_changes(qwen_bpe, llama_word):
    """Two architectures, two tokenizers, one run: every trainable tensor of both agents moves in one step."""
    trainer = MAGRPOTrainer(
        agents=[qwen_bpe, llama_word], train_dataset=DATA, reward_func=length_reward, args=small_args()
    )
    assert [type(a.model).__name__ for a in trainer.team] == ["Qwen2ForCausalLM", "LlamaForCausalLM"]
    assert len(trainer.team[0].tokenizer) != len(trainer.team[1].tokenizer)
    before = [_snapshot(a.model) for a in trainer.team]
    metrics = trainer.train()
    for i, agent in enumerate(trainer.team):
        unchanged = [
            n for n, p in agent.model.named_parameters() if p.requires_grad and torch.equal(p, before[i][n])
        ]
        assert unchanged == [], f"agent {i}: parameters not updated: {unchanged}"
    for key in ("reward", "agent_0/loss", "agent_1/loss", "agent_0/grad_norm", "agent_1/completion_length"):
        assert key in metrics


@pytest.mark.parametrize(
    ("trainer_cls", "config_cls"),
    [
        (MAGRPOTrainer, MAGRPOConfig),
        (MAREINFORCETrainer, MAREINFORCEConfig),
        (MARLOOTrainer, MARLOOConfig),
        (MAReMaxTrainer, MAReMaxConfig),
    ],
)
def test_each_family_trainer_runs_a_step(qwen_bpe, trainer_cls, config_cls):
    args = config_cls(
        prompts_per_step=2, num_generations=2, max_new_tokens=4, max_steps=1, progress_bar=False
    )
    trainer = trainer_cls(
        model=qwen_bpe, num_agents=2, train_dataset=DATA, reward_func=length_reward, args=args
    )
    metrics = trainer.train()
    assert trainer.step == 1 and "agent_1/loss" in metrics


def test_num_agents_1_is_grpo(qwen_bpe):
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda c: [len(x) for x in c],
        args=small_args(max_steps=2),
    )
    before = _snapshot(trainer.team[0].model)
    metrics = trainer.train()
    assert len(trainer.team) == 1 and "agent_0/loss" in metrics and "agent_1/loss" not in metrics
    assert any(not torch.equal(p, before[n]) for n, p in trainer.team[0].model.named_parameters())


@pytest.mark.parametrize("kl_penalty", ["loss", "reward"])
def test_ppo_iterations_and_kl_are_reported(qwen_bpe, kl_penalty):
    """num_iterations > 1 reuses the batch under the clipped ratio; beta > 0 adds a KL to the frozen start, to
    the loss or (kl_penalty='reward') to the rewards."""
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda c: [len(x) for x in c],
        args=small_args(max_steps=2, num_iterations=3, beta=0.1, learning_rate=1e-2, kl_penalty=kl_penalty),
    )
    metrics = trainer.train()
    # the policy moved away from the reference during step 1
    if kl_penalty == "loss":
        assert metrics["agent_0/kl"] > 0 and "agent_0/kl_penalty" not in metrics
    else:
        # k1 of a batch may be of either sign; its exact value: test_kl_in_reward_lowers_each_completions_return...
        assert metrics["agent_0/kl_penalty"] != 0 and "agent_0/kl" not in metrics
    assert 0 <= metrics["agent_0/clip_fraction"] <= 1
    assert trainer.schedulers[0].last_epoch == 2 * 3  # one optimizer step per iteration


def test_kl_in_reward_lowers_each_completions_return_by_its_own_k1(qwen_bpe, llama_word):
    """kl_penalty='reward': a completion's return drops by beta x (log pi(y) - log ref(y)), its own agent's, from
    the weights that sampled it; the task reward is still what is logged, and the loss has no KL term."""
    beta = 0.5
    trainer = MAGRPOTrainer(
        agents=[qwen_bpe, llama_word],
        train_dataset=DATA,
        reward_func=length_reward,
        args=small_args(beta=beta, kl_penalty="reward", joint_mode="cross", micro_batch_size=2),
    )
    torch.manual_seed(0)
    for reference in trainer.references:  # a reference that differs from the policy at step 1
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(0.05 * torch.randn_like(p))
    rollout = trainer._collect(DATA[:2])
    task, metrics = rollout.rewards.clone(), {}
    penalised = trainer._penalised(rollout, metrics)
    for i, agent in enumerate(trainer.team.agents):
        gen = rollout.generations[i]
        args = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
        with torch.no_grad():
            logp = agent.completion_logprobs(*args)
            ref = agent.completion_logprobs(*args, model=trainer.references[i])
        kl = ((logp - ref) * gen.completion_mask).sum(dim=1).view(2, 3)
        assert kl.abs().min() > 1e-3
        torch.testing.assert_close(penalised.returns[i], rollout.returns[i] - beta * kl, atol=1e-5, rtol=0)
        assert metrics[f"agent_{i}/kl_penalty"] == pytest.approx(beta * float(kl.mean()), abs=1e-5)
    assert torch.equal(rollout.rewards, task)  # the task's rewards are kept as they were
    stats = trainer.update_agent(0, rollout.generations[0], torch.ones(6))
    assert "kl" not in stats  # the loss's KL term is off


def test_zero_advantage_fraction_explains_a_zero_loss(qwen_bpe):
    """A group whose G samples all score the same has advantage 0 everywhere: no learning signal."""
    # step 1: group 0 flat, group 1 not; step 2: both flat
    rewards = iter([[1.0, 1.0, 1.0, 0.0, 2.0, 2.0], [5.0] * 6])
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda c: next(rewards),
        args=small_args(),
    )
    metrics, _ = trainer.training_step(DATA[:2])
    assert metrics["agent_0/zero_advantage_fraction"] == 0.5 and metrics["agent_0/grad_norm"] > 0
    metrics, _ = trainer.training_step(DATA[2:])
    assert metrics["agent_0/zero_advantage_fraction"] == 1.0
    assert metrics["agent_0/loss"] == 0.0 and metrics["agent_0/grad_norm"] == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.1], ids=["no-kl", "kl-in-the-loss"])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_rows_of_advantage_zero_are_not_run_and_the_updates_are_the_whole_batchs(
    qwen_bpe, monkeypatch, beta, num_iterations
):
    """A row of advantage 0 adds nothing to the loss or its gradient: the update runs the others alone (all of
    them when a KL term is in the loss), with the gradients and metrics of a run over every row; with every
    advantage 0, one row at weight 0 gives every weight its zero gradient, so AdamW still steps (on its
    momentum) as it would over the whole batch. With ``num_iterations > 1`` the behaviour log-probs are computed
    for the rows the loss runs alone."""
    import comarl.trainers.magrpo as magrpo

    agent = Agent.from_pretrained(qwen_bpe)
    gen = HFEngine().generate(
        agent, ["alice and bob", "the agents meet at"], 3, SamplingParams(max_new_tokens=4)
    )
    steps = [torch.tensor([0.0, 0.0, 0.0, 1.0, -0.5, -0.5]), torch.zeros(6)]

    def two_steps(every_row: bool):
        trainer = MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=1,
            train_dataset=DATA,
            reward_func=length_reward,
            args=small_args(beta=beta, micro_batch_size=2, learning_rate=1e-2, num_iterations=num_iterations),
        )
        if every_row:
            monkeypatch.setattr(
                magrpo, "learned_batches", lambda adv, ref, rows: list(torch.arange(len(adv)).split(rows))
            )
        model, ran, grads = trainer.team[0].model, [], []
        scoring, apply = trainer.team[0].completion_logprobs, trainer._apply_gradients

        def recording(prompt_ids, *rest, **kw):
            ran.append(prompt_ids.shape[0])
            return scoring(prompt_ids, *rest, **kw)

        def capture(i):
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            return apply(i)

        trainer.team[0].completion_logprobs, trainer._apply_gradients = recording, capture
        results = []
        for advantages in steps:
            ran.clear()
            before = [p.detach().clone() for p in model.parameters()]
            metrics = trainer.update_agent(0, gen, advantages)
            moved = not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            results.append((list(ran), metrics, grads[-1], moved))
        monkeypatch.undo()
        return results

    skipping, every_row = two_steps(every_row=False), two_steps(every_row=True)
    for (ran, metrics, grads, moved), (ran_all, metrics_all, grads_all, _), advantages in zip(
        skipping, every_row, steps
    ):
        # the KL's reference pass, the behaviour log-probs' pass, then the loss's at each iteration
        assert ran_all == [2, 2, 2] * ((beta > 0) + (num_iterations > 1) + num_iterations)
        if beta > 0:
            assert ran == ran_all
        elif advantages.any():  # rows 3-5 in every pass
            assert ran == [2, 1] * ((num_iterations > 1) + num_iterations)
        else:  # no behaviour pass; the zero-weight row alone at each iteration
            assert ran == [1] * num_iterations
        assert metrics.keys() == metrics_all.keys()
        for key in metrics:
            assert metrics[key] == pytest.approx(metrics_all[key], rel=1e-5, abs=1e-9), key
        assert all(g is not None for g in grads) and all(g is not None for g in grads_all)
        # behaviour log-probs from other micro-batches than the every-row run's differ in the last bits
        atol = 1e-7 if num_iterations == 1 else 1e-6
        for a, b in zip(grads, grads_all):
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)
        assert moved  # the second step too: AdamW's momentum
    if beta == 0:  # every advantage 0 and no KL term: a zero gradient for every weight
        assert all(not g.any() for g in skipping[1][2])


def test_mask_truncated_completions_leaves_cut_completions_out_of_the_loss(qwen_bpe):
    """A completion cut by max_new_tokens (no EOS) adds no gradient and no token to dapo's mean when masked."""
    import dataclasses

    def gradients_and_metrics(gen, advantages, **kw):
        trainer = MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=1,
            train_dataset=DATA,
            reward_func=length_reward,
            args=small_args(max_new_tokens=4, **kw),
        )
        grads = []
        step = trainer._apply_gradients

        def capture(i):
            grads.extend(p.grad.clone() for p in trainer.team[i].model.parameters())
            return step(i)

        trainer._apply_gradients = capture
        return grads, trainer.update_agent(0, gen, advantages)

    agent = Agent.from_pretrained(qwen_bpe)
    eos, pad = agent.eos_token_ids[0], agent.tokenizer.pad_token_id
    gen = HFEngine().generate(agent, ["alice and bob"], 2, SamplingParams(max_new_tokens=4))
    ids = torch.tensor([[17, 23, eos, pad], [17, 29, 31, 40]])  # ended; cut at max_new_tokens
    both = dataclasses.replace(
        gen, completion_ids=ids, completion_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    )
    ended = dataclasses.replace(
        both,
        prompt_ids=both.prompt_ids[:1],
        prompt_mask=both.prompt_mask[:1],
        completion_ids=ids[:1],
        completion_mask=both.completion_mask[:1],
    )
    masked, masked_metrics = gradients_and_metrics(
        both, torch.tensor([1.0, -1.0]), mask_truncated_completions=True
    )
    alone, _ = gradients_and_metrics(ended, torch.tensor([1.0]))
    scored, scored_metrics = gradients_and_metrics(both, torch.tensor([1.0, -1.0]))
    for a, b in zip(masked, alone):  # the cut row is as if absent: dapo's mean over the ended row's 3 tokens
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert masked_metrics["truncated_fraction"] == scored_metrics["truncated_fraction"] == 0.5
    assert masked_metrics["grad_norm"] == pytest.approx(
        float(torch.cat([g.flatten() for g in alone]).norm()), rel=1e-4
    )
    assert scored_metrics["grad_norm"] != pytest.approx(masked_metrics["grad_norm"], rel=1e-2)  # off: scored


def test_agent_settings_give_each_agent_its_sampling_micro_batches_and_learning_rate(qwen_bpe, llama_word):
    settings = [
        {"max_new_tokens": 2, "temperature": 0.5, "micro_batch_size": 1, "learning_rate": 0.25},
        {"min_new_tokens": 6, "top_k": 3},
    ]
    trainer = MAGRPOTrainer(
        agents=[qwen_bpe, llama_word],
        train_dataset=DATA,
        reward_func=length_reward,
        args=small_args(agent_settings=settings, num_iterations=2),
    )
    sampled, scored = {}, {0: [], 1: []}
    generate = trainer.engine.generate

    def recording_generate(agent, prompts, num_generations, params, seeds=None):
        sampled[trainer.team.agents.index(agent)] = params
        return generate(agent, prompts, num_generations, params, seeds)

    trainer.engine.generate = recording_generate
    for i, agent in enumerate(trainer.team):
        logprobs = agent.completion_logprobs

        def recording_logprobs(prompt_ids, prompt_mask, ids, mask, temperature, i=i, logprobs=logprobs, **kw):
            scored[i].append((len(ids), temperature))
            return logprobs(prompt_ids, prompt_mask, ids, mask, temperature, **kw)

        agent.completion_logprobs = recording_logprobs
    metrics, samples = trainer.training_step(DATA[:2])
    assert (sampled[0].max_new_tokens, sampled[0].temperature, sampled[0].top_k) == (2, 0.5, None)
    assert (sampled[1].max_new_tokens, sampled[1].min_new_tokens, sampled[1].top_k) == (6, 6, 3)
    assert sampled[1].temperature == 1.0
    assert metrics["agent_0/completion_length"] <= 2 and metrics["agent_1/completion_length"] == 6
    # Old log-probs and two iterations: every pass scores at the agent's temperature, in its micro-batches.
    assert scored[0] == [(1, 0.5)] * 6 * 3 and scored[1] == [(6, 1.0)] * 3
    assert [o.param_groups[0]["lr"] for o in trainer.optimizers] == [0.25, 1e-3]


def test_agent_settings_errors(qwen_bpe):
    with pytest.raises(
        ConfigError, match=r"agent_settings\[1\]: \['beta'\] cannot be set per agent; choose from"
    ):
        small_args(agent_settings=[{}, {"beta": 0.1}])
    with pytest.raises(
        ConfigError, match=r"^agent_settings\[0\]: temperature=0: must be a finite number > 0$"
    ):
        small_args(agent_settings=[{"temperature": 0}, {}])
    with pytest.raises(
        ConfigError, match=r"agent_settings\[0\]: min_new_tokens=9 > max_new_tokens=6: lower min_new_tokens"
    ):
        small_args(agent_settings=[{"min_new_tokens": 9}])
    with pytest.raises(
        ConfigError, match=r"^agent_settings=\{'temperature': 0.5\}: must be a list of mappings or null$"
    ):
        small_args(agent_settings={"temperature": 0.5})
    with pytest.raises(ConfigError, match="share_weights=True trains one model with one optimizer"):
        small_args(share_weights=True, agent_settings=[{"learning_rate": 0.1}, {}])
    with pytest.raises(
        ConfigError, match=r"agent_settings has 1 entries for 2 agents: give one dict per agent"
    ):
        MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=length_reward,
            args=small_args(agent_settings=[{}]),
        )


@pytest.mark.parametrize("bf16", [False, True])
def test_bf16_autocasts_generation_and_the_update_while_weights_stay_fp32(qwen_bpe, bf16):
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda c: [len(x) for x in c],
        args=small_args(bf16=bf16),
    )
    model = trainer.team[0].model
    before = _snapshot(model)
    seen = []  # (gradients on: the update; off: generation, logits dtype)
    model.lm_head.register_forward_hook(lambda m, i, out: seen.append((torch.is_grad_enabled(), out.dtype)))
    trainer.training_step(DATA[:2])
    assert {grad for grad, _ in seen} == {False, True}
    assert {dtype for _, dtype in seen} == {torch.bfloat16 if bf16 else torch.float32}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the AdamW master weights
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_bf16_per_agent_runs_each_agent_in_its_own_precision(qwen_bpe):
    """agent_settings=[{"bf16": True}, {}]: agent 0 generates and is scored under bf16 autocast, agent 1 in fp32
    (e.g. a large agent beside a small one); both keep fp32 weights."""
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=small_args(agent_settings=[{"bf16": True}, {}], beta=0.1),
    )
    seen = {0: [], 1: []}  # (gradients on, logits dtype) of each agent's forwards
    for i, agent in enumerate(trainer.team):
        agent.model.lm_head.register_forward_hook(
            lambda m, inputs, out, i=i: seen[i].append((torch.is_grad_enabled(), out.dtype))
        )
    trainer.training_step(DATA[:2])
    assert {grad for grad, _ in seen[0]} == {grad for grad, _ in seen[1]} == {False, True}
    assert {dtype for _, dtype in seen[0]} == {torch.bfloat16}
    assert {dtype for _, dtype in seen[1]} == {torch.float32}
    assert all(p.dtype == torch.float32 for agent in trainer.team for p in agent.model.parameters())


def test_cross_mode_credits_the_mean_over_joint_actions(qwen_bpe):
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=small_args(joint_mode="cross"),
    )
    from comarl.rollout import collect

    rollout = collect(
        trainer.env,
        trainer.team.agents,
        DATA[:2],
        engine=trainer.engine,
        num_generations=3,
        params=trainer._sampling(),
        joint_mode="cross",
    )
    assert rollout.joint_index.shape == (2, 9, 2)
    for i in range(2):
        for j in range(3):
            hits = rollout.joint_index[0, :, i] == j
            assert torch.isclose(rollout.returns[i][0, j], rollout.rewards[0, hits, i].mean())


def test_evaluate_and_save_model(qwen_bpe, tmp_path):
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        eval_dataset=DATA[:3],
        reward_func=length_reward,
        args=small_args(success_threshold=0.0, output_dir=str(tmp_path / "run")),
    )
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first == second  # greedy by default: deterministic
    assert set(first) >= {"eval/reward", "eval/success", "eval/reward/length_reward"}
    trainer.train()
    run = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl"):
        assert (run / name).exists(), name
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert set(sample) >= {"step", "prompts", "completions", "rewards", "advantages"}
    for i in range(2):
        model = AutoModelForCausalLM.from_pretrained(run / "agents" / f"agent_{i}")
        AutoTokenizer.from_pretrained(run / "agents" / f"agent_{i}")
        trained = trainer.team[i].model.state_dict()
        assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    # A one-agent run into the same folder leaves only its own agent there (and one_more/ is not comarl's).
    (run / "agents" / "one_more").mkdir()
    MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda a: [len(x) for x in a],
        args=small_args(max_steps=1, output_dir=str(run)),
    ).train()
    assert sorted(p.name for p in (run / "agents").iterdir()) == ["agent_0", "one_more"]


def test_logging_steps_and_the_last_step_decide_what_is_written(qwen_bpe, tmp_path):
    """logging_steps=2 over 3 steps: rows at steps 2 and 3 (the last step always), log_completions=1 joint action
    each; eval_at_end without an eval_dataset evaluates nothing (and does not fail)."""
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda c: [len(x) for x in c],
        args=small_args(
            max_steps=3, logging_steps=2, log_completions=1, eval_at_end=True, output_dir=str(tmp_path)
        ),
    )
    last = trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 3]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [sample["step"] for sample in samples] == [2, 3]
    assert "agent_0/loss" in last and not any(key.startswith("eval/") for key in last)


def test_seeded_runs_are_reproducible(qwen_bpe):
    def run():
        t = MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=length_reward,
            args=small_args(max_steps=2, seed=7),
        )
        t.train()
        return [p.detach().clone() for p in t.team[1].model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(), run()))


def test_copies_of_one_model_sample_from_streams_of_their_own(qwen_bpe):
    """A training_step called without seeds draws from each agent's own stream, seeded by its index: two copies of
    one model answer the same prompts differently."""
    trainer = MAGRPOTrainer(
        model=qwen_bpe, num_agents=2, train_dataset=DATA, reward_func=length_reward, args=small_args()
    )
    rollout = trainer._collect(DATA[:2])
    assert rollout.generations[0].completions != rollout.generations[1].completions


def test_each_epoch_takes_every_item_once_in_its_own_order(qwen_bpe):
    """prompts_per_step consecutive items of each epoch's order per step (drop last); shuffle=True draws a new
    seeded permutation every epoch, the same in every run; a resumed run takes the steps it has not taken."""

    def trainer(**settings):
        return MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=1,
            train_dataset=DATA * 2,
            reward_func=lambda c: [0.0] * len(c),
            args=small_args(max_steps=8, **settings),
        )

    assert list(trainer(shuffle=False)._batch_indices()) == [[0, 1], [2, 3], [4, 5], [6, 7]] * 2
    shuffled = trainer(seed=5)
    steps = list(shuffled._batch_indices())
    epochs = [sum(steps[:4], []), sum(steps[4:], [])]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(8))
    assert epochs[0] != epochs[1]  # reshuffled, not the first epoch's order again
    assert list(trainer(seed=5)._batch_indices()) == steps
    shuffled.step = 3
    assert list(shuffled._batch_indices()) == steps[3:]


def test_token_budget_micro_batches_give_the_full_batch_update(qwen_bpe):
    """micro_batch_tokens=1 runs one row per forward/backward; the accumulated step equals the one-pass step."""

    def run(budget):
        t = MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=length_reward,
            args=small_args(seed=3, micro_batch_tokens=budget),
        )
        metrics = t.train()
        return metrics, [p.detach().clone() for a in t.team for p in a.model.parameters()]

    (full, one_pass), (split, per_row) = run(None), run(1)
    for i in range(2):  # the gradient before clipping: equal up to float summation order
        assert split[f"agent_{i}/grad_norm"] == pytest.approx(full[f"agent_{i}/grad_norm"], rel=1e-5)
    # Adam divides by sqrt(v): float-order differences in tiny gradients move a weight by < 1e-5 (lr 1e-3).
    assert all(torch.allclose(a, b, atol=5e-5) for a, b in zip(one_pass, per_row))


def test_update_metrics_are_the_whole_batchs_over_token_budget_micro_batches(qwen_bpe):
    """micro_batch_tokens = one row's prompt + completion tokens: one row per forward (the budget counts the prompt
    too). The metrics are the batch's: dapo's loss at ratio 1 is -(2 x 3 - 1 x 4) / 7 summed over both micro-batches,
    advantage_abs the mean |A|, completion_length 7 / 2 tokens, one of two rows cut; num_iterations=1 scores no
    separate behaviour log-probs."""
    import dataclasses

    agent = Agent.from_pretrained(qwen_bpe)
    eos, pad = agent.eos_token_ids[0], agent.tokenizer.pad_token_id
    gen = HFEngine().generate(agent, ["alice and bob meet at noon"], 2, SamplingParams(max_new_tokens=4))
    ids = torch.tensor([[17, 23, eos, pad], [17, 29, 31, 40]])  # ended after 3 tokens; cut at max_new_tokens
    gen = dataclasses.replace(
        gen, completion_ids=ids, completion_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    )
    P = gen.prompt_ids.shape[1]
    assert P >= 4  # a budget of completion tokens alone would fit both rows in one forward
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=length_reward,
        args=small_args(max_new_tokens=4, micro_batch_tokens=P + 4),
    )
    rows, logprobs = [], trainer.team[0].completion_logprobs

    def counted(prompt_ids, *args, **kw):
        rows.append(len(prompt_ids))
        return logprobs(prompt_ids, *args, **kw)

    trainer.team[0].completion_logprobs = counted
    metrics = trainer.update_agent(0, gen, torch.tensor([2.0, -1.0]))
    assert rows == [1, 1]
    assert metrics["loss"] == pytest.approx(-2 / 7, abs=1e-6)
    assert (metrics["advantage_abs"], metrics["completion_length"], metrics["truncated_fraction"]) == (
        1.5,
        3.5,
        0.5,
    )


def test_step_times_split_generation_environment_and_update(qwen_bpe, monkeypatch):
    """Clock readings 100, 110, 130 around a step whose generate calls took 4 s: generate 4, environment 10 - 4,
    update 20, step 30, and 12 completions (2 agents x 2 items x 3) in 30 s."""
    import dataclasses
    from types import SimpleNamespace

    from comarl.trainers import magrpo

    trainer = MAGRPOTrainer(
        model=qwen_bpe, num_agents=2, train_dataset=DATA, reward_func=length_reward, args=small_args()
    )
    collect = trainer._collect
    trainer._collect = lambda items, seeds=None: dataclasses.replace(
        collect(items, seeds), generate_seconds=4.0
    )
    monkeypatch.setattr(magrpo, "time", SimpleNamespace(perf_counter=iter([100.0, 110.0, 130.0]).__next__))
    metrics, _ = trainer.training_step(DATA[:2])
    times = ("time/generate", "time/environment", "time/update", "time/step", "completions_per_s")
    assert {key: metrics[key] for key in times} == pytest.approx(
        {
            "time/generate": 4.0,
            "time/environment": 6.0,
            "time/update": 20.0,
            "time/step": 30.0,
            "completions_per_s": 0.4,
        }
    )


def test_lr_schedule_warmup_then_cosine(qwen_bpe):
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda c: [len(x) for x in c],
        args=small_args(max_steps=4, warmup_steps=1, lr_scheduler_type="cosine", learning_rate=1e-3),
    )
    lrs = []
    for items, seeds in trainer._batches():
        trainer.step += 1
        metrics, _ = trainer.training_step(items, seeds)
        lrs.append(metrics["agent_0/lr"])
    # factor(s): warmup s=0 -> 1/2; then cosine over 3 steps: s=1 -> 1, s=2 -> 0.75, s=3 -> 0.25. The metric is the
    # rate each update used (read after the schedule's step it was the next one's: 1, 0.75, 0.25, 0).
    assert lrs == pytest.approx([1e-3 * 0.5, 1e-3 * 1.0, 1e-3 * 0.75, 1e-3 * 0.25], abs=1e-12)


def test_alternating_agents_each_take_their_whole_schedule_over_their_own_turns(qwen_bpe):
    """alternate_agents_every=1 over 4 steps: each agent updates twice, so its linear decay spans those 2 updates
    (1, then 1/2), not the run's 4 steps (it stopped at 3/4 and warmups lasted N times longer)."""
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=small_args(
            max_steps=4, alternate_agents_every=1, lr_scheduler_type="linear", learning_rate=1e-3
        ),
    )
    lrs: dict[str, list[float]] = {"agent_0/lr": [], "agent_1/lr": []}
    for items, seeds in trainer._batches():
        trainer.step += 1
        metrics, _ = trainer.training_step(items, seeds)
        for key, seen in lrs.items():
            if key in metrics:
                seen.append(metrics[key])
    assert lrs == {"agent_0/lr": [1e-3, 0.5e-3], "agent_1/lr": [1e-3, 0.5e-3]}
    three = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=3,
        train_dataset=DATA * 2,
        reward_func=lambda a, b, c: [0.0] * len(a),
        args=small_args(max_steps=5, alternate_agents_every=2, frozen_agents=[1]),
    )
    # learners 0 and 2 in turns of 2 steps: 0, 0, 2, 2, 0
    assert [three.training_steps_of(i) for i in range(3)] == [3, 0, 2]


# ---------------------------------------------------------------------------- compatibility and errors


def test_comlrl_readme_call(qwen_bpe):
    """The CoMLRL README example, with only the import changed (and a local model path for the hub id)."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_bpe)
    dataset = [{"prompt": "def add(a, b):"}, {"prompt": "alice and bob"}]
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        tokenizer=tokenizer,
        train_dataset=dataset,
        reward_func=lambda a, b: [abs(max(len(b[0]), 1) / max(len(a[0]), 1) - 3.0)],
        formatters=[lambda example: example["prompt"]] * 2,
        args=MAGRPOConfig(per_device_train_batch_size=1, max_new_tokens=8, progress_bar=False),
    )
    trainer.train()
    assert trainer.step == 2  # one epoch, one prompt per step


def test_comlrl_agent_model_and_config_names(qwen_bpe):
    args = MAGRPOConfig(
        num_train_epochs=1,
        agent_learning_rate=1e-4,
        num_generations=2,
        max_new_tokens=4,
        rollout_buffer_size=2,
        advantage_mode="rloo",
        joint_mode="crossed",
        progress_bar=False,
    )
    trainer = MAGRPOTrainer(
        agent_model=qwen_bpe, num_agents=2, train_dataset=DATA, reward_func=length_reward, args=args
    )
    assert trainer.optimizers[0].param_groups[0]["lr"] == 1e-4
    assert (args.baseline, args.joint_mode, args.prompts_per_step) == ("leave_one_out", "cross", 2)
    trainer.train()


def test_config_is_checked_before_any_model_loads():
    with pytest.raises(ConfigError, match="prompts_per_step=8 but the training dataset has 4 items"):
        MAGRPOTrainer(
            model="/nonexistent/model",
            num_agents=2,
            train_dataset=DATA,
            reward_func=length_reward,
            args=MAGRPOConfig(prompts_per_step=8),
        )
    with pytest.raises(ConfigError, match=r"num_generations \*\* num_agents = 8 \*\* 5 = 32768"):
        MAGRPOTrainer(
            model="/nonexistent/model",
            num_agents=5,
            train_dataset=DATA,
            reward_func=length_reward,
            args=MAGRPOConfig(num_generations=8, joint_mode="cross", prompts_per_step=1),
        )
    # Without num_agents= the team size is args.num_agents (CoMLRL's IAC / MAAC take it from there alone)
    with pytest.raises(ConfigError, match=r"num_generations \*\* num_agents = 8 \*\* 5 = 32768"):
        MAGRPOTrainer(
            model="/nonexistent/model",
            train_dataset=DATA,
            reward_func=length_reward,
            args=MAGRPOConfig(num_agents=5, num_generations=8, joint_mode="cross", prompts_per_step=1),
        )
    with pytest.raises(RewardFunctionError, match="takes 1 positional"):
        MAGRPOTrainer(
            model="/nonexistent/model", num_agents=2, train_dataset=DATA, reward_func=lambda a: [1.0]
        )


def test_model_config(qwen_bpe):
    """CoMLRL's model_config: its loading keys reach from_pretrained; a key comarl does not read is refused by
    name before any model loads, never dropped."""
    with pytest.raises(
        ConfigError, match=r"^model_config: comarl reads .*, not \['special_tokens'\]. For special"
    ):
        MAGRPOTrainer(
            model="/nonexistent/model",
            train_dataset=DATA,
            reward_func=length_reward,
            model_config={"special_tokens": {"pad_token": "<pad>"}},
        )
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=length_reward,
        model_config={"attn_implementation": "eager", "model_kwargs": {"attn_implementation": "sdpa"}},
    )
    assert trainer.team[0].model.config._attn_implementation == "eager"


def test_team_errors(qwen_bpe):
    with pytest.raises(ConfigError, match="not model and agents"):
        MAGRPOTrainer(model=qwen_bpe, agents=[qwen_bpe], train_dataset=DATA, reward_func=length_reward)
    with pytest.raises(ConfigError, match="num_agents=3 but 2 agents"):
        MAGRPOTrainer(
            agents=[qwen_bpe, qwen_bpe], num_agents=3, train_dataset=DATA, reward_func=length_reward
        )
    with pytest.raises(ConfigError, match="needs args=MAREINFORCEConfig"):
        MAREINFORCETrainer(model=qwen_bpe, train_dataset=DATA, reward_func=length_reward, args=MAGRPOConfig())
    model = AutoModelForCausalLM.from_pretrained(qwen_bpe)
    with pytest.raises(
        ConfigError,
        match=r"^agent 1 is a model object \(Qwen2ForCausalLM\) without a tokenizer: give tokenizer= \(one for the "
        r"team, or a list with one per agent\); only a hub id or a path loads its own$",
    ):
        MAGRPOTrainer(agents=[qwen_bpe, model], train_dataset=DATA, reward_func=length_reward)


def test_the_task_is_given_once_and_whole_before_any_model_loads():
    from comarl.envs import FunctionEnv

    def transition(item, completions, history):
        return ["again"] * 2

    team = dict(model="/nonexistent/model", num_agents=2)
    with pytest.raises(
        ConfigError,
        match=r"^MAGRPOTrainer: train_dataset is required \(a datasets.Dataset or a list of dicts\)$",
    ):
        MAGRPOTrainer(**team, reward_func=length_reward)
    with pytest.raises(ConfigError, match=r"^MARLOOTrainer: give reward_func= \(with formatters=\) or env=$"):
        MARLOOTrainer(**team, train_dataset=DATA)
    with pytest.raises(
        ConfigError, match=r"^give transition= or external_transition= \(CoMLRL's\), not both$"
    ):
        MAGRPOTrainer(
            **team,
            train_dataset=DATA,
            reward_func=length_reward,
            transition=transition,
            external_transition=transition,
        )
    env = FunctionEnv(length_reward, None, 2)
    with pytest.raises(
        ConfigError, match=r"^give either env= or reward_func=/formatters=/transition=, not both$"
    ):
        MAGRPOTrainer(**team, train_dataset=DATA, env=env, reward_func=length_reward)
    with pytest.raises(ConfigError, match=r"^env.num_agents=2 but the team has 3 agents$"):
        MAGRPOTrainer(model="/nonexistent/model", num_agents=3, train_dataset=DATA, env=env)


def test_team_size_and_devices_are_checked_by_name(qwen_bpe):
    common = dict(train_dataset=DATA, reward_func=length_reward)
    with pytest.raises(
        ConfigError,
        match=r"^no team: give model= \(with num_agents=\), agents=\[...\] or team=Team\(\[...\]\)$",
    ):
        MAGRPOTrainer(**common)
    with pytest.raises(ConfigError, match=r"^num_agents=0: must be >= 1$"):
        MAGRPOTrainer(model="/nonexistent/model", num_agents=0, **common)
    with pytest.raises(
        ConfigError, match=r"^agent_devices has 3 entries for 2 agents: give one per agent or one for all$"
    ):
        MAGRPOTrainer(
            model="/nonexistent/model", num_agents=2, args=MAGRPOConfig(agent_devices=["cpu"] * 3), **common
        )
    with pytest.raises(
        ConfigError,
        match=r"^share_weights=True: the shared weights live on one device; agent_devices=\['cpu', 'cpu:0'\]$",
    ):
        MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=2,
            args=small_args(share_weights=True, agent_devices=["cpu", "cpu:0"]),
            **common,
        )
    assert MAGRPOTrainer(model=qwen_bpe, args=small_args(), **common).num_agents == 2  # README: default 2


def test_a_streaming_dataset_is_refused_naming_the_fix(qwen_bpe):
    from datasets import Dataset

    streamed = Dataset.from_list(DATA).to_iterable_dataset()
    for name, data in (
        ("train_dataset", {"train_dataset": streamed}),
        ("eval_dataset", {"eval_dataset": streamed}),
    ):
        with pytest.raises(
            ConfigError,
            match=rf"^{name}: IterableDataset has no length or indexing \(a streaming dataset\?\); give a "
            r"datasets.Dataset \(load_dataset without streaming=True\) or a list of dicts$",
        ):
            MAGRPOTrainer(model=qwen_bpe, reward_func=length_reward, **{"train_dataset": DATA, **data})


def test_reward_error_stops_the_run_naming_function_and_item(qwen_bpe):
    def picky(a, b, prompt):
        return [float("nan") if p == "alice and bob" else 1.0 for p in prompt]

    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=picky,
        args=small_args(prompts_per_step=4, reward_call="per_joint_action"),
    )
    with pytest.raises(
        RewardFunctionError, match=r"'picky' returned nan on item \{'prompt': 'alice and bob'\}"
    ):
        trainer.train()


def test_evaluate_overrides_dataset_samples_and_sampling(qwen_bpe):
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=small_args(max_new_tokens=3),
    )
    with pytest.raises(ConfigError, match="evaluate\\(\\) needs a dataset"):
        trainer.evaluate()
    calls = []
    trainer.env.rewards[0].func = lambda a, b: calls.append(len(a)) or [0.0] * len(a)
    streams = [agent.generator.get_state() for agent in trainer.team]
    trainer.evaluate(DATA[:2], num_generations=3, do_sample=True)
    assert calls == [6]  # one batched call: 2 items x 3 aligned joint actions
    # Sampled evaluation puts the agents' streams back: it never changes what training samples next
    assert all(torch.equal(agent.generator.get_state(), s) for agent, s in zip(trainer.team, streams))
    with pytest.raises(ConfigError, match=r"^evaluate\(num_generations=0\): must be an integer >= 1$"):
        trainer.evaluate(DATA, num_generations=0)
    with pytest.raises(ConfigError, match=r"^evaluate\(dataset\): the dataset is empty$"):
        trainer.evaluate([])


def test_evaluate_plays_eval_num_samples_items_and_samples_as_the_caller_says(qwen_bpe):
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=small_args(eval_num_samples=2, eval_do_sample=True),
    )
    played, sampled = [], []
    trainer.env.rewards[0].func = lambda a, b: played.append(len(a)) or [0.0] * len(a)
    generate = trainer.engine.generate

    def recording(agent, prompts, num_generations, params, seeds=None):
        sampled.append((len(prompts), params.do_sample))
        return generate(agent, prompts, num_generations, params, seeds)

    trainer.engine.generate = recording
    trainer.evaluate(DATA)  # the first 2 of 4 items, sampled (eval_do_sample)
    trainer.evaluate(DATA[:1], do_sample=False)  # fewer items than eval_num_samples: all; greedy, as asked
    assert played == [2, 1]
    assert sampled == [(2, True), (2, True), (1, False), (1, False)]


def test_sampled_evaluation_depends_on_the_seed_and_items_alone(qwen_bpe):
    """evaluate() drew from the agents' training streams: what training had drawn before, and prompts_per_step (the
    evaluation's batch size), changed the samples. Item j now draws from streams fixed by the seed and j."""

    def answers(prompts_per_step, seed=42, advance=False):
        trainer = MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=length_reward,
            args=small_args(prompts_per_step=prompts_per_step, seed=seed),
        )
        if advance:  # as a training step would
            for agent in trainer.team:
                torch.rand(100, generator=agent.generator)
        seen = []
        trainer.env.rewards[0].func = lambda a, b: seen.extend(zip(a, b)) or [0.0] * len(a)
        trainer.evaluate(DATA, num_generations=2, do_sample=True)
        return seen

    first = answers(prompts_per_step=1)
    assert len(first) == 8 and len(set(first)) == 8  # 4 items x 2 samples, each its own
    assert answers(prompts_per_step=3) == first
    assert answers(prompts_per_step=2, advance=True) == first
    assert answers(prompts_per_step=1, seed=0) != first


def test_data_shards_split_the_evaluation_and_report_one_process_numbers(qwen_bpe):
    """Under data parallelism every process evaluated every item (D times the work). Shard r now plays items r,
    r + D, ...; the pooled metrics and the CoMLRL hooks' episodes (in item order) equal one process's, sampled
    too, since an item's draws are its own. Two shards in one process here: a stand-in gather hands rank 0 the
    part rank 1 computed."""
    items = [{"prompt": p} for p in ("def add(a, b):", "the agents meet", "alice and bob", "return a", "x =")]
    logged = []

    def eval_logger(agent_completions_turns, batch_items, prompts):
        logged.append((agent_completions_turns, batch_items))
        return [{}]

    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=length_reward,
        args=small_args(prompts_per_step=2),
        eval_logger=eval_logger,
        eval_aggregator=lambda metrics, num_turns: {},
    )
    played = []
    trainer.env.rewards[0].func = lambda a, b: played.append(len(a)) or length_reward(a, b)
    one_process = trainer.evaluate(items, num_generations=2, do_sample=True)

    class Shard:
        def __init__(self, rank: int, other: object) -> None:
            self.rank, self.world_size, self.other = rank, 2, other

        def gather(self, obj: object) -> list:
            self.sent = obj
            return [obj, self.other] if self.rank == 0 else [self.other, obj]

    played.clear()
    trainer.data = Shard(1, ({}, []))
    trainer.evaluate(items, num_generations=2, do_sample=True)
    assert played == [2, 2]  # items 1 and 3, one at a time (prompts_per_step / 2), 2 joint actions each
    trainer.data = Shard(0, trainer.data.sent)
    played.clear()
    assert trainer.evaluate(items, num_generations=2, do_sample=True) == pytest.approx(one_process)
    assert played == [2, 2, 2]  # items 0, 2 and 4
    assert logged[2] == logged[0]  # every episode, in item order


def test_success_rate_counts_unflagged_ended_episodes_in_every_batch(qwen_bpe):
    """An environment that flags only wins: a batch (or data shard) whose episodes all lost reported no flag and
    dropped out of eval/success (1 win of 4 read 0.5 at two items per batch). Its episodes are unsolved."""
    from comarl import Env, StepResult

    class OnlyWinsFlagged(Env):
        num_agents = 2

        def reset(self, item):
            self.item = item
            return [item["prompt"]] * 2

        def step(self, joint_action):
            win = self.item["prompt"] == "win"
            return StepResult([float(win)] * 2, done=True, info={"success": True} if win else {})

    items = [{"prompt": p} for p in ("win", "lose", "lose", "lose")]
    for prompts_per_step in (4, 2, 1):
        trainer = MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=items,
            env=OnlyWinsFlagged(),
            args=small_args(prompts_per_step=prompts_per_step),
        )
        metrics = trainer.evaluate(items)
        assert (metrics["eval/success"], metrics["eval/reward"]) == (0.25, 0.25), prompts_per_step
    no_flags = MAGRPOTrainer(model=qwen_bpe, num_agents=2, train_dataset=items, reward_func=length_reward)
    assert not any(
        k.startswith("eval/success") for k in no_flags.evaluate(items)
    )  # a task without the notion


def test_rollout_metrics_reward_and_its_spread_by_hand():
    """One agent, single turn, no success flag: the mean reward and its (unbiased) spread, 0 for a single sample;
    nothing else (no nodes_per_item without a second turn)."""
    from comarl.rollout import Rollout
    from comarl.trainers.magrpo import rollout_metrics

    def rollout(rewards):
        r = torch.tensor(rewards).unsqueeze(-1)  # [items, K, 1]
        B, K = r.shape[:2]
        return Rollout(
            generations=[],
            joint_index=torch.zeros(B, K, 1, dtype=torch.long),
            rewards=r,
            returns=[r[..., 0]],
            node_returns=r,
            depth=torch.zeros(B, dtype=torch.long),
            terminal=torch.ones(B, K, dtype=torch.bool),
            child=torch.full((B, K), -1),
            done=torch.ones(B, K, dtype=torch.bool),
            success=None,
        )

    # mean 7/6; squared deviations 3 x 1/36 + 49/36 + 2 x 25/36 = 17/6, over 5
    metrics = rollout_metrics(rollout([[1.0, 1.0, 1.0], [0.0, 2.0, 2.0]]))
    assert metrics == pytest.approx({"reward": 7 / 6, "reward_std": (17 / 30) ** 0.5})
    assert rollout_metrics(rollout([[3.0]])) == {"reward": 3.0, "reward_std": 0.0}


def test_an_agents_own_formatter_makes_its_prompt(qwen_bpe):
    """Agent(formatter=) counted only when every agent had one (one without: all dropped, every agent read
    item["prompt"]), and with env= it was refused as if formatters= had been given."""
    from comarl.envs import FunctionEnv

    def agents():
        return [Agent.from_pretrained(qwen_bpe, formatter=lambda item: "Q:" + item["prompt"]), qwen_bpe]

    trainer = MAGRPOTrainer(agents=agents(), train_dataset=DATA, reward_func=length_reward, args=small_args())
    assert trainer.env.reset(DATA[0]) == ["Q:def add(a, b):", "def add(a, b):"]
    with pytest.raises(ConfigError, match=r"^Agent\(formatter=\) and formatters=/env= both say how"):
        MAGRPOTrainer(
            agents=agents(), train_dataset=DATA, reward_func=length_reward, formatters=str, args=small_args()
        )
    env = FunctionEnv(length_reward, None, 2)
    with pytest.raises(ConfigError, match=r"an env= makes its own prompts"):
        MAGRPOTrainer(agents=agents(), train_dataset=DATA, env=env, args=small_args())


def test_team_wide_loading_settings_are_refused_where_they_would_be_ignored(qwen_bpe):
    """A tokenizer= list of the wrong length failed with an IndexError after a model had loaded; tokenizer= and
    model_config= beside built Agents (agents=[Agent] or team=) were ignored without a word."""
    tok = AutoTokenizer.from_pretrained(qwen_bpe)
    common = dict(train_dataset=DATA, reward_func=length_reward, args=small_args())
    with pytest.raises(ConfigError, match=r"^tokenizer= holds 1 tokenizers for 2 agents: give one per agent"):
        MAGRPOTrainer(model=qwen_bpe, num_agents=2, tokenizer=[tok], **common)
    built = Agent.from_pretrained(qwen_bpe)
    for extra in (dict(tokenizer=tok), dict(model_config={"attn_implementation": "eager"})):
        with pytest.raises(
            ConfigError, match=r"^agent 0 is a built Agent, which holds its tokenizer and model"
        ):
            MAGRPOTrainer(agents=[built, qwen_bpe], **extra, **common)
    trainer = MAGRPOTrainer(agents=[built, qwen_bpe], tokenizer=[None, tok], **common)
    assert trainer.team[0] is built and trainer.team[1].tokenizer is tok


def test_agents_generate_concurrently_when_given_a_pool():
    """Agents on separate devices overlap their generate calls (here: a fake engine that waits for its partner)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from comarl.rollout import generate_all

    barrier = threading.Barrier(2, timeout=5)

    class WaitingEngine:
        def generate(self, agent, prompts, num_generations, params, seeds=None):
            barrier.wait()  # only returns if both agents are generating at the same time
            return agent

    with ThreadPoolExecutor(max_workers=2) as pool:
        assert generate_all(
            WaitingEngine(), ["a0", "a1"], [["p"], ["p"]], 1, [SamplingParams()] * 2, pool
        ) == [
            "a0",
            "a1",
        ]


@pytest.mark.parametrize("trainer_name", ["MAGRPO", "IPPO"])
def test_agents_with_devices_of_their_own_update_at_the_same_time_to_the_same_weights(
    qwen_bpe, llama_word, trainer_name
):
    """With a pool (agents on accelerators of their own: here forced on the CPU) the agents' updates overlap, and
    the team ends with the weights of one-after-another updates."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import comarl

    trainer_cls, config_cls = (
        getattr(comarl, f"{trainer_name}Trainer"),
        getattr(comarl, f"{trainer_name}Config"),
    )
    update = "update_agents" if trainer_name == "MAGRPO" else "update_actor"

    def trained(pool):
        trainer = trainer_cls(
            agents=[qwen_bpe, llama_word],
            train_dataset=DATA,
            reward_func=length_reward,
            args=config_cls(
                prompts_per_step=2,
                num_generations=3,
                max_new_tokens=6,
                max_steps=2,
                progress_bar=False,
                seed=3,
            ),
        )
        if pool is not None:
            barrier, original = threading.Barrier(2, timeout=10), getattr(trainer, update)

            def waiting(*args):
                barrier.wait()  # returns only while both agents are updating
                return original(*args)

            setattr(trainer, update, waiting)
            trainer.pool = pool
        trainer.train()
        return [{k: v.clone() for k, v in agent.model.state_dict().items()} for agent in trainer.team]

    with ThreadPoolExecutor(max_workers=2) as pool:
        together = trained(pool)
    for mine, theirs in zip(together, trained(None)):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


# ---------------------------------------------------------------------------- the update against hand-written math


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_magrpo_update_is_the_gradient_of_the_hand_written_loss(qwen_bpe, beta):
    """dapo with ratio 1: L = -(1/7) sum_i A_i sum_t m_it logp_it (+ beta/7 sum m k3), EOS scored, padding not.

    Catches a skipped last token (loss -1), scored padding (-1.5), a flipped sign (+10/7) and a KL sign or
    weight error in the trainer's wiring of aggregate_loss, clipped_surrogate and kl_k3."""
    import dataclasses

    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=length_reward,
        args=small_args(max_new_tokens=4, beta=beta, max_grad_norm=None),
    )
    agent = trainer.team[0]
    if beta:  # a reference that differs from the policy, so that k3 and its gradient are not 0
        torch.manual_seed(0)
        with torch.no_grad():
            for p in trainer.references[0].parameters():
                p.add_(0.05 * torch.randn_like(p))
    eos, pad = agent.eos_token_ids[0], agent.tokenizer.pad_token_id
    gen = HFEngine().generate(agent, ["alice and bob"], 2, SamplingParams(max_new_tokens=4))
    ids = torch.tensor([[17, 23, eos, pad], [17, 29, 31, 40]])  # 3 scored tokens (EOS included), 4 scored
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    gen = dataclasses.replace(gen, completion_ids=ids, completion_mask=mask)
    adv = torch.tensor([2.0, 1.0])
    params = [p for p in agent.model.parameters() if p.requires_grad]
    logp = agent.completion_logprobs(gen.prompt_ids, gen.prompt_mask, ids, mask)
    loss = -(adv[:, None] * logp * mask).sum() / 7
    if beta:
        with torch.no_grad():
            ref = agent.completion_logprobs(
                gen.prompt_ids, gen.prompt_mask, ids, mask, model=trainer.references[0]
            )
        d = torch.where(mask.bool(), ref - logp, 0.0)
        loss = loss + beta * ((torch.exp(d) - d - 1) * mask).sum() / 7
    expected = torch.autograd.grad(loss, params)
    got = []
    trainer.optimizers[0].step = lambda *a, **k: got.extend(p.grad.clone() for p in params)
    metrics = trainer.update_agent(0, gen, adv)
    if not beta:
        assert metrics["loss"] == pytest.approx(-10 / 7, abs=1e-6)  # -(2 * 3 + 1 * 4) / 7
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    ("name", "greedy", "expected"),
    [
        ("MAREINFORCE", None, [1.0, 2.0, 3.0, 6.0]),  # the raw return
        ("MARLOO", None, [-8 / 3, -4 / 3, 0.0, 4.0]),  # R minus the mean of the other three
        ("MAReMax", torch.tensor([4.0]), [-3.0, -2.0, -1.0, 2.0]),  # R minus the greedy return
        ("MAGRPO", None, [x / (14 / 3) ** 0.5 for x in (-2.0, -1.0, 0.0, 3.0)]),  # (R - mean) / std
    ],
)
def test_each_family_trainer_uses_its_own_advantages(qwen_bpe, name, greedy, expected):
    """Returns [1, 2, 3, 6] of one group through each trainer's own defaults (CoMLRL's four are identical)."""
    import comarl

    args = getattr(comarl, f"{name}Config")(prompts_per_step=1, num_generations=4, progress_bar=False)
    trainer = getattr(comarl, f"{name}Trainer")(
        model=qwen_bpe, num_agents=1, train_dataset=DATA, reward_func=lambda a: [0.0] * len(a), args=args
    )
    adv, _ = trainer._advantages(
        torch.tensor([[1.0, 2.0, 3.0, 6.0]]), greedy, torch.zeros(1, dtype=torch.long)
    )
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-3, rtol=0)  # std's eps: 1e-4


def test_trainer_discount_reaches_the_returns(qwen_bpe):
    """Two turns paid 1 then 4 with discount 0.5: the first turn's return is 1 + 0.5 * 4 = 3 (ignored: 5)."""
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA[:1],
        reward_func=lambda a, prompts: [4.0 if p.startswith("again") else 1.0 for p in prompts[0]],
        transition=lambda item, completions, history: ["again"],
        args=MAGRPOConfig(
            prompts_per_step=1,
            num_generations=2,
            max_new_tokens=2,
            num_turns=2,
            discount=0.5,
            progress_bar=False,
            reward_call="batched",
        ),
    )
    rollout = trainer._collect(DATA[:1])
    torch.testing.assert_close(rollout.returns[0][0], torch.tensor([3.0, 3.0]))


def test_a_model_object_is_agent_0_and_the_others_train_copies(qwen_bpe):
    """model= given as an object: agent 0 trains that object in place (as TRL does), every other agent a deep copy
    with the same starting weights (docs/comlrl.md)."""
    model = AutoModelForCausalLM.from_pretrained(qwen_bpe)
    trainer = MAGRPOTrainer(
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(qwen_bpe),
        num_agents=3,
        train_dataset=DATA,
        reward_func=lambda a, b, c: [0.0] * len(a),
        args=MAGRPOConfig(num_generations=2, prompts_per_step=2, max_new_tokens=4, progress_bar=False),
    )
    models = [agent.model for agent in trainer.team]
    assert models[0] is model and models[1] is not model and models[2] is not models[1]
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[2].parameters()))
    tokenizers = [agent.tokenizer for agent in trainer.team]  # one tokenizer= object: each agent its own copy
    tokenizers[1].chat_template = "{{ messages }}"
    assert tokenizers[0].chat_template != "{{ messages }}" and tokenizers[2].chat_template != "{{ messages }}"


def test_automatic_placement_keeps_a_shared_model_on_one_gpu(monkeypatch):
    """With 2 GPUs, agent i goes to GPU i mod 2; agents sharing one model (share_weights, lora_shared_base) all go
    to the first, where the one model lives (they were refused: "the shared weights live on one device")."""
    from comarl.trainers.magrpo import _agent_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _agent_devices(None, 3) == ["cuda:0", "cuda:1", "cuda:0"]
    assert _agent_devices("auto", 2, one_model=True) == ["cuda:0", "cuda:0"]
    assert _agent_devices(["cuda:1"], 2, one_model=True) == ["cuda:1", "cuda:1"]  # what the user names stands
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert _agent_devices(None, 2, one_model=True) == ["cpu", "cpu"]


def test_a_device_name_torch_does_not_know_is_a_config_error(qwen_bpe):
    with pytest.raises(
        ConfigError,
        match=r"^agent_devices: 'gpu' is not a torch device; use e.g. 'cpu', 'cuda', 'cuda:1' or 'mps'$",
    ):
        MAGRPOTrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=length_reward,
            args=MAGRPOConfig(agent_devices=["cpu", "gpu"], prompts_per_step=2),
        )


def test_logged_samples_show_the_task_rewards_under_a_kl_reward_penalty(qwen_bpe):
    """kl_penalty='reward' subtracts beta x KL from the returns the update learns from; samples.jsonl shows the
    task's rewards, as the reward metric does (it showed r - beta KL: -0.017, 0.787, 1.576 for a reward of 1)."""
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA[:2],
        reward_func=lambda a, b: [1.0] * len(a),
        args=small_args(prompts_per_step=2, beta=0.5, kl_penalty="reward", log_completions=2),
    )
    torch.manual_seed(0)
    with torch.no_grad():  # a reference unlike the policy, so the penalty is not 0
        for reference in trainer.references:
            for p in reference.parameters():
                p.add_(0.05 * torch.randn_like(p))
    metrics, samples = trainer.training_step(DATA[:2])
    assert metrics["reward"] == 1.0 and metrics["agent_0/kl_penalty"] != 0.0
    assert [s["rewards"] for s in samples] == [[1.0, 1.0], [1.0, 1.0]]


def test_logged_samples_show_each_items_own_joint_action(qwen_bpe):
    """Sample b is item b's first joint action: its prompts, the completions that joint action joined and the reward
    they got (length_reward of those two completions, every agent's)."""
    trainer = MAGRPOTrainer(
        model=qwen_bpe, num_agents=2, train_dataset=DATA, reward_func=length_reward, args=small_args()
    )
    _, samples = trainer.training_step(DATA[:2])
    assert [sample["prompts"] for sample in samples] == [[DATA[0]["prompt"]] * 2, [DATA[1]["prompt"]] * 2]
    for sample in samples:
        (reward,) = length_reward(*[[c] for c in sample["completions"]])
        assert sample["rewards"] == pytest.approx([reward, reward])
