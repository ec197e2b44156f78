"""The generation engine and the shared-prompt log-prob forward against transformers' own reference paths."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from comarl.agents import (
    CACHE_ARGUMENT,
    Agent,
    Team,
    _cache_argument,
    _shared_prompts,
    checkpointing_on,
    set_activation_checkpointing,
)
from comarl.engines import HFEngine, SamplingParams, learned_position_limit, next_tokens, sampling_scores

PROMPTS = ["a", "def add(a, b): return a", "alice and bob meet at the"]


@pytest.mark.parametrize("fixture", ["qwen_bpe", "llama_word"])
def test_greedy_decoding_equals_transformers_generate(fixture, request):
    """Same tokens as model.generate(do_sample=False) on left-padded prompts, rows ending at EOS included."""
    agent = Agent.from_pretrained(request.getfixturevalue(fixture))
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    gen = HFEngine().generate(agent, PROMPTS, 2, params)
    ids, mask = agent.encode(PROMPTS)
    config = GenerationConfig(
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=agent.eos_token_ids,
        pad_token_id=agent.tokenizer.pad_token_id,
    )
    expected = agent.model.generate(
        input_ids=ids.repeat_interleave(2, 0),
        attention_mask=mask.repeat_interleave(2, 0),
        generation_config=config,
    )[:, ids.shape[1] :]
    width = gen.completion_ids.shape[1]
    assert torch.equal(gen.completion_ids, expected[:, :width])
    # after every row ended, generate only added padding
    assert (expected[:, width:] == agent.tokenizer.pad_token_id).all()


def test_sampling_scores_equal_transformers_warpers():
    """Temperature, then top-k, then top-p, exactly as transformers' warpers filter the scores."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
    expected = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
        expected = warper(None, expected)
    assert torch.equal(sampling_scores(logits, params, torch.tensor([0])), expected)


def test_min_new_tokens_masks_every_eos_and_greedy_keeps_the_logits():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    eos = torch.tensor([0, 2])
    greedy = SamplingParams(do_sample=False)
    assert next_tokens(logits, greedy, eos).tolist() == [0]
    assert next_tokens(logits, greedy, eos, suppress_eos=True).tolist() == [1]
    assert sampling_scores(logits, greedy, eos, suppress_eos=True).tolist() == [
        [-float("inf"), 1.0, -float("inf"), 0.0]
    ]


def test_inverse_cdf_draw_never_picks_impossible_tokens_and_matches_the_probabilities():
    """p = [0, 1/4, 0, 3/4]: tokens 0 and 2 never come up; token 3 about three times as often as token 1."""
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([0.0, 0.25, 0.0, 0.75])).expand(8000, 4)
    draws = next_tokens(logits, SamplingParams(), torch.tensor([9]))
    counts = torch.bincount(draws, minlength=4).tolist()
    assert counts[0] == 0 and counts[2] == 0
    assert abs(counts[3] / 8000 - 0.75) < 0.02


def test_min_new_tokens_gives_full_length_completions(qwen_bpe):
    agent = Agent.from_pretrained(qwen_bpe)
    torch.manual_seed(0)
    gen = HFEngine().generate(agent, PROMPTS, 3, SamplingParams(max_new_tokens=6, min_new_tokens=6))
    assert gen.completion_ids.shape == (9, 6)
    assert gen.completion_mask.sum().item() == 54
    assert gen.prompts == [p for p in PROMPTS for _ in range(3)]


def test_seeded_prompts_draw_the_same_samples_whatever_shares_the_call(qwen_bpe):
    """With one seed per prompt, a prompt's samples depend on its seed alone: not on the other prompts of the
    call (their number, their padding) nor on G (sample j is the same); agent.generator is not used."""
    agent = Agent.from_pretrained(qwen_bpe)
    engine, params = HFEngine(), SamplingParams(max_new_tokens=8)
    agent.generator = torch.Generator().manual_seed(0)
    state = agent.generator.get_state()
    alone = engine.generate(agent, PROMPTS[:1], 2, params, seeds=[11]).completions  # "a": left-padded below
    together = engine.generate(agent, PROMPTS, 4, params, seeds=[11, 7, 13]).completions
    assert together[:2] == alone  # prompt 0, samples 0 and 1
    assert torch.equal(agent.generator.get_state(), state)
    assert engine.generate(agent, PROMPTS[:1], 2, params, seeds=[12]).completions != alone
    assert len(set(together)) > 1  # sampled, not one answer repeated
    with pytest.raises(ValueError, match=r"^HFEngine.generate: 1 seeds for 2 prompts; pass one per prompt$"):
        engine.generate(agent, PROMPTS[:2], 1, params, seeds=[1])


def test_shared_prompt_groups_by_hand():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    distinct, row_to_prompt = _shared_prompts(ids, mask)
    assert sorted(distinct.tolist()) == [0, 2]  # the first row of each distinct prompt
    assert torch.equal(ids[distinct][row_to_prompt], ids)
    assert torch.equal(mask[distinct][row_to_prompt], mask)
    assert _shared_prompts(ids[:3][[0, 2]], mask[:3][[0, 2]]) is None  # nothing repeats
    assert _shared_prompts(ids[:, -1:], mask[:, -1:]) is None  # a one-token prompt has nothing to share
    same_ids_other_mask = torch.tensor([[0, 0, 6], [0, 5, 6]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert _shared_prompts(*same_ids_other_mask) is None


@pytest.mark.parametrize("fixture", ["qwen_bpe", "llama_word"])
def test_shared_prompt_forward_equals_one_forward_per_row(fixture, request):
    """Log-probs and gradients of the shared-prompt forward equal those of each row on its own."""
    agent = Agent.from_pretrained(request.getfixturevalue(fixture))
    torch.manual_seed(0)
    gen = HFEngine().generate(agent, PROMPTS, 3, SamplingParams(max_new_tokens=7))
    assert _shared_prompts(gen.prompt_ids, gen.prompt_mask) is not None

    def grads_of(rows: slice) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        agent.model.zero_grad(set_to_none=True)
        args = (
            gen.prompt_ids[rows],
            gen.prompt_mask[rows],
            gen.completion_ids[rows],
            gen.completion_mask[rows],
        )
        logp = agent.completion_logprobs(*args)
        (logp * gen.completion_mask[rows]).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in agent.model.named_parameters()}

    shared_logp, shared_grads = grads_of(slice(None))
    summed = {n: torch.zeros_like(g) for n, g in shared_grads.items()}
    for r in range(gen.completion_ids.shape[0]):
        logp, grads = grads_of(slice(r, r + 1))  # one row: the plain forward
        mask = gen.completion_mask[r].bool()
        torch.testing.assert_close(shared_logp[r][mask], logp[0][mask], atol=1e-5, rtol=1e-4)
        for n in summed:
            summed[n] += grads[n]
    for n, g in shared_grads.items():
        torch.testing.assert_close(g, summed[n], atol=1e-4, rtol=1e-3, msg=n)


def test_gradient_checkpointing_takes_the_plain_forward(qwen_bpe):
    """transformers drops caches under activation checkpointing, so the shared-prompt path must not run there."""
    agent = Agent.from_pretrained(qwen_bpe)
    torch.manual_seed(0)
    gen = HFEngine().generate(agent, PROMPTS, 2, SamplingParams(max_new_tokens=5))
    args = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    shared = agent.completion_logprobs(*args).detach()
    assert not checkpointing_on(agent.model)
    set_activation_checkpointing(agent.model, True)
    agent.model.train()
    assert checkpointing_on(agent.model)
    checkpointed = agent.completion_logprobs(*args)
    torch.testing.assert_close(checkpointed.detach(), shared, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("version", "name"),
    [("5.0.0", "past_key_values"), ("5.23.1", "past_key_values"), ("5.24.0", "cache"), ("6.1.0", "cache")],
)
def test_cache_argument_follows_the_transformers_rename(version, name):
    assert _cache_argument(version) == name


def test_kl_reference_of_a_checkpointed_agent_keeps_the_shared_prompt_path(qwen_bpe):
    """The reference copy is made after the agent turns activation checkpointing on; it never runs a backward, so
    it turns it off and scores completions on the shared-prompt path (one prompt forward per group)."""
    import comarl

    trainer = comarl.MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        reward_func=lambda completions, **_: [0.0] * len(completions),
        train_dataset=[{"prompt": "a b"}],
        args=comarl.MAGRPOConfig(beta=0.1, gradient_checkpointing=True, prompts_per_step=1, report_to=[]),
    )
    assert checkpointing_on(trainer.team[0].model)
    assert not checkpointing_on(trainer.references[0])


@pytest.mark.parametrize(
    ("version", "called"),
    [("5.22.0", "gradient_checkpointing_enable"), ("5.23.0", "activation_checkpointing_enable")],
)
def test_checkpointing_follows_the_transformers_rename(version, called):
    """transformers 5.23 renamed gradient_checkpointing_enable to activation_checkpointing_enable; the old name
    warns (FutureWarning) until v6, and older releases lack the new one."""
    calls = []

    class Model:
        def __getattr__(self, name):  # noqa: ANN001, ANN204
            return lambda: calls.append(name)

    set_activation_checkpointing(Model(), True, version)
    set_activation_checkpointing(Model(), False, version)
    assert calls == [called, called.replace("enable", "disable")]


def test_no_dropout_in_training_mode_whatever_form_it_takes(qwen_bpe):
    """transformers models apply attention dropout (Qwen2's attention_dropout, StarCoder2's residual_dropout) from
    float attributes in training mode, not through nn.Dropout: the trainer's train-mode scoring then differed from
    the eval-mode sampling policy (by 0.06 in a log-prob here). An Agent zeroes both kinds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(qwen_bpe, attention_dropout=0.3)
    assert model.config.attention_dropout == 0.3
    agent = Agent(model, AutoTokenizer.from_pretrained(qwen_bpe))
    torch.manual_seed(0)
    gen = HFEngine().generate(agent, PROMPTS, 2, SamplingParams(max_new_tokens=5))
    args = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    with torch.no_grad():
        agent.model.train()
        trained = [agent.completion_logprobs(*args) for _ in range(2)]
        agent.model.eval()
        sampled = agent.completion_logprobs(*args)
    torch.testing.assert_close(trained[0], sampled, atol=0, rtol=0)
    torch.testing.assert_close(trained[1], sampled, atol=0, rtol=0)
    assert model.config.attention_dropout == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, r"max_new_tokens=0 must be an integer >= 1"),
        ({"min_new_tokens": -1}, r"min_new_tokens=-1 must be in \[0, max_new_tokens=128\]"),
        (
            {"min_new_tokens": 10, "max_new_tokens": 3},
            r"min_new_tokens=10 must be in \[0, max_new_tokens=3\]",
        ),
        (
            {"temperature": 0.0},
            r"temperature=0.0 must be a finite number > 0 when sampling; for greedy .*do_sample=False",
        ),
        ({"temperature": -1.0}, r"temperature=-1.0 must be a finite number > 0"),
        ({"temperature": float("inf")}, r"temperature=inf must be a finite number > 0"),
        ({"temperature": float("nan")}, r"temperature=nan must be a finite number > 0"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
        ({"top_k": -1}, r"top_k=-1 must be >= 0 \(0 or None = off\)"),
    ],
)
def test_sampling_params_refuse_values_that_cannot_be_sampled(kwargs, message):
    """temperature=0 drew token id V (past the vocabulary), a negative one the inverted distribution, top_k=-1
    failed deep in torch.topk: SamplingParams refuses them, naming the field."""
    with pytest.raises(ValueError, match=r"SamplingParams: " + message):
        SamplingParams(**kwargs)


def test_greedy_decoding_takes_any_temperature():
    assert SamplingParams(temperature=0.0, do_sample=False).temperature == 0.0


def test_nan_scores_never_draw_an_id_past_the_vocabulary():
    """A NaN row made the inverse-CDF draw answer V (searchsorted past a NaN CDF): an id the embedding cannot take."""
    logits = torch.randn(3, 5)
    logits[1] = float("nan")
    ids = next_tokens(logits, SamplingParams(), torch.tensor([0]))
    assert ((ids >= 0) & (ids < 5)).all()


@pytest.mark.parametrize("do_sample", [True, False])
def test_generation_refuses_nan_logits(qwen_bpe, do_sample):
    """A model that gives NaN logits (one NaN row of the output layer here) raises once decoding ends, instead of
    returning tokens drawn from nothing."""
    agent = Agent.from_pretrained(qwen_bpe)
    with torch.no_grad():
        agent.model.get_output_embeddings().weight[7] = float("nan")
    params = SamplingParams(max_new_tokens=4, do_sample=do_sample)
    with pytest.raises(
        FloatingPointError,
        match=r"sample_completions: Qwen2ForCausalLM gave NaN or infinite next-token logits for 6 of 6 rows",
    ):
        HFEngine().generate(agent, PROMPTS, 2, params)


@pytest.fixture(scope="module")
def gpt2_bpe(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A GPT-2 model (learned absolute positions) with 64 of them."""
    from comarl.tiny import tiny_model

    path = tmp_path_factory.mktemp("models") / "gpt2-bpe"
    return str(tiny_model(path, kind="bpe", arch="gpt2", seed=0, max_position_embeddings=64))


def test_context_past_learned_positions_is_refused_before_decoding(gpt2_bpe):
    """GPT-2 indexes a table of n_positions positions: a longer context failed mid-generation with a bare IndexError.
    Prompt + max_new_tokens up to the limit decode and score; one more is refused up front, naming the numbers."""
    agent = Agent.from_pretrained(gpt2_bpe)
    prompt = " ".join(["alice meets bob at the park"] * 8)
    P = agent.encode([prompt])[0].shape[1]
    assert P < 60
    fits = SamplingParams(max_new_tokens=64 - P, min_new_tokens=64 - P)
    gen = HFEngine().generate(agent, [prompt], 1, fits)
    assert gen.completion_ids.shape == (1, 64 - P)
    agent.completion_logprobs(gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    too_long = SamplingParams(max_new_tokens=65 - P)
    Team([agent])
    expected = (
        rf"HFEngine.generate: agent 0: the longest prompt \({P} tokens\) \+ max_new_tokens={65 - P} is 65 positions, "
        r"past the 64 learned positions of GPT2LMHeadModel \(config.n_positions\); shorten the prompts or lower"
    )
    with pytest.raises(ValueError, match=expected):
        HFEngine().generate(agent, [prompt], 2, too_long)


def test_only_learned_absolute_positions_have_a_limit(gpt2_bpe, qwen_bpe):
    """RoPE computes any position (past max_position_embeddings quality may drop, but nothing fails): no limit."""
    assert learned_position_limit(Agent.from_pretrained(gpt2_bpe).model) == ("n_positions", 64)
    assert learned_position_limit(Agent.from_pretrained(qwen_bpe).model) is None


class CacheIgnoringModel(torch.nn.Module):
    """A trust_remote_code model written for an older transformers: it takes the cache as past_key_values and
    swallows the cache= argument in **kwargs."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config, self.generation_config = inner, inner.config, inner.generation_config

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        past_key_values=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):  # noqa: ANN001, ANN201, E501
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **{CACHE_ARGUMENT: past_key_values},
        )


def test_a_model_that_ignores_the_cache_is_refused(qwen_bpe):
    """Both the decode loop and the shared-prompt log-probs silently ran without the prompt (log-probs off by 0.3)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = CacheIgnoringModel(AutoModelForCausalLM.from_pretrained(qwen_bpe))
    agent = Agent(model, AutoTokenizer.from_pretrained(qwen_bpe))
    message = r"CacheIgnoringModel ignored the KV cache passed as .*make its forward accept"
    with pytest.raises(RuntimeError, match=message):
        HFEngine().generate(agent, PROMPTS, 2, SamplingParams(max_new_tokens=3))
    ids, mask = agent.encode(PROMPTS[1:] * 2)
    completion = torch.ones(4, 3, dtype=torch.long)
    with pytest.raises(RuntimeError, match=message):
        agent.completion_logprobs(ids, mask, completion, torch.ones_like(completion))
