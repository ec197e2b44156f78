"""The generation engine and the shared-prompt log-prob forward against transformers' own reference paths. The
tests after "gaps found by mutation testing" each pin a behaviour a mutant of engines.py or agents.py once changed
unseen (the tiny fixtures' pad == EOS and RoPE positions hid several)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import comarl.agents
from comarl.agents import (
    CACHE_ARGUMENT,
    Agent,
    Team,
    _cache_argument,
    _shared_prompts,
    checkpointing_on,
    set_activation_checkpointing,
)
from comarl.engines import (
    HFEngine,
    SamplingParams,
    learned_position_limit,
    next_tokens,
    sampling_scores,
    seeded_draws,
)

PROMPTS = ["a", "def add(a, b): return a", "alice and bob meet at the"]


@pytest.fixture(params=["own forward", "model forward"])
def scoring(request, monkeypatch) -> str:
    """Runs a test with ``completion_logprobs`` through comarl's own training forward (``shared_prompt_logits``, for
    the models the decode step accepts, on the CPU) and through the model's forward (any other model), and checks
    afterwards that the first ran exactly where it should."""
    calls = []
    own = comarl.agents.shared_prompt_logits
    monkeypatch.setattr(comarl.agents, "shared_prompt_logits", lambda *args: calls.append(1) or own(*args))
    if request.param == "model forward":
        monkeypatch.setattr(
            comarl.agents, "unsupported_reason", lambda model: "this test takes the model forward"
        )
    yield request.param
    assert bool(calls) == (request.param == "own forward")


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
def test_shared_prompt_forward_equals_one_forward_per_row(fixture, request, scoring):
    """Log-probs and gradients of the shared-prompt forward equal those of each row on its own, through comarl's own
    forward and through the model's."""
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
    """A GPT-2 model with 64 learned absolute positions: position ids that ignore left padding change its output
    (RoPE models such as the Qwen2 and Llama fixtures only see position differences)."""
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


# ============================================================================= gaps found by mutation testing


def eos_prone(agent: Agent, token: int, boost: float) -> torch.utils.hooks.RemovableHandle:
    """Add ``boost`` to the logit of ``token`` (a hook on the model's output layer, so ``model.generate`` sees it too).
    The tiny Qwen2 model repeats one token per prompt; with a boost of about 1 some prompts end and others do not."""
    bias = torch.zeros(agent.model.config.vocab_size)
    bias[token] = boost
    return agent.model.get_output_embeddings().register_forward_hook(lambda module, args, out: out + bias)


def reference_generate(agent: Agent, prompts: list[str], G: int, config: GenerationConfig) -> torch.Tensor:
    ids, mask = agent.encode(prompts)
    return agent.model.generate(
        input_ids=ids.repeat_interleave(G, 0),
        attention_mask=mask.repeat_interleave(G, 0),
        generation_config=config,
    )[:, ids.shape[1] :]


@pytest.mark.parametrize(
    ("pad", "ending", "boost", "lengths"),
    [
        ("eos", "tokenizer", 1.0, [3, 3, 8, 8, 3, 3]),
        ("other", "tokenizer", 1.0, [3, 3, 8, 8, 3, 3]),
        ("eos", "generation_config", 0.8, [3, 3, 8, 8, 6, 6]),
    ],
)
def test_rows_end_at_their_eos_after_min_new_tokens_as_in_transformers_generate(
    qwen_bpe, pad, ending, boost, lengths
):
    """An EOS-prone model, greedy, min_new_tokens = 2: the ids equal model.generate's (MinNewTokensLengthLogitsProcessor
    and its pad-after-EOS), with rows ending mid-way (at step 2, the first allowed, or later) and others running to
    max_new_tokens. The EOS itself stays in the row, pads follow it (also with a pad token other than EOS), the mask
    covers up to and including the EOS, and the text is the decoded ids up to that EOS. The ending token is the
    tokenizer's EOS, or a second EOS id (200) that only the model's generation_config names.

    Mutations killed: EOS suppressed for one step too many / too few (``t <= min`` / ``t < min - 1``), rows not stopped
    at EOS, a stopped row restarting, the loop stopping once any row ends, the pad written in place of the EOS, the
    text decoded past the EOS, generate's mask built from the first EOS id only."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_bpe)
    if pad == "other":
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(5)
    model = AutoModelForCausalLM.from_pretrained(qwen_bpe)
    if ending == "generation_config":
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, 200]
    agent = Agent(model, tokenizer)
    pad_id, eos_ids = agent.tokenizer.pad_token_id, agent.eos_token_ids
    assert (pad_id == eos_ids[0]) == (pad == "eos")
    assert eos_ids == ([0] if ending == "tokenizer" else [0, 200])
    hook = eos_prone(agent, eos_ids[-1], boost)
    params = SamplingParams(max_new_tokens=8, min_new_tokens=2, do_sample=False)
    gen = HFEngine().generate(agent, PROMPTS, 2, params)
    config = GenerationConfig(
        max_new_tokens=8, min_new_tokens=2, do_sample=False, eos_token_id=eos_ids, pad_token_id=pad_id
    )
    expected = reference_generate(agent, PROMPTS, 2, config)
    hook.remove()
    assert torch.equal(gen.completion_ids, expected)
    assert gen.completion_mask.sum(dim=1).tolist() == lengths
    for r, n in enumerate(lengths):
        row = gen.completion_ids[r]
        if n < 8:
            assert row[n - 1] == eos_ids[-1] and not torch.isin(row[: n - 1], torch.tensor(eos_ids)).any()
        assert (row[n:] == pad_id).all()
        assert gen.completions[r] == agent.tokenizer.decode(row[:n], skip_special_tokens=True)


def test_decoding_stops_when_every_row_has_ended(qwen_bpe):
    """Every row ends with EOS at step 2 (min_new_tokens = 2, EOS-prone model): the completions are 3 tokens wide,
    as model.generate's, not max_new_tokens (mutation killed: the ids returned untrimmed, 8 wide)."""
    agent = Agent.from_pretrained(qwen_bpe)
    hook = eos_prone(agent, agent.eos_token_ids[0], 1.0)
    prompts = [PROMPTS[0], PROMPTS[2]]
    gen = HFEngine().generate(
        agent, prompts, 2, SamplingParams(max_new_tokens=8, min_new_tokens=2, do_sample=False)
    )
    config = GenerationConfig(
        max_new_tokens=8,
        min_new_tokens=2,
        do_sample=False,
        eos_token_id=agent.eos_token_ids,
        pad_token_id=agent.tokenizer.pad_token_id,
    )
    expected = reference_generate(agent, prompts, 2, config)
    hook.remove()
    assert expected.shape == (4, 3)
    assert torch.equal(gen.completion_ids, expected)


def test_a_row_that_ended_stays_ended(qwen_bpe):
    """Rows 0 and 1 are forced to EOS at step 2 (a hook on the third forward: prefill, steps 1 and 2) and EOS is
    forbidden from then on (the tiny model copies its last token, so it would repeat the EOS): rows 0 and 1 hold pads
    after their EOS while the other rows run on, as in model.generate, which calls the model in the same order
    (mutation killed: ``running = ~isin(chosen, eos)``, a row that ended starts again once it draws anything else)."""
    agent = Agent.from_pretrained(qwen_bpe)
    eos, pad = agent.eos_token_ids[0], agent.tokenizer.pad_token_id
    calls = []

    def end_rows_0_and_1_at_step_2_only(module, args, out):  # noqa: ANN001, ANN202
        calls.append(None)
        out = out.clone()
        if len(calls) == 3:
            out[:2, -1, eos] = 1e4
        elif len(calls) > 3:
            out[..., eos] = -1e4
        return out

    hook = agent.model.get_output_embeddings().register_forward_hook(end_rows_0_and_1_at_step_2_only)
    gen = HFEngine().generate(agent, PROMPTS, 2, SamplingParams(max_new_tokens=6, do_sample=False))
    calls.clear()
    config = GenerationConfig(
        max_new_tokens=6, do_sample=False, eos_token_id=agent.eos_token_ids, pad_token_id=pad
    )
    expected = reference_generate(agent, PROMPTS, 2, config)
    hook.remove()
    assert torch.equal(gen.completion_ids, expected)
    assert gen.completion_ids[:2, 2].tolist() == [eos, eos] and (gen.completion_ids[:2, 3:] == pad).all()
    assert gen.completion_mask.sum(dim=1).tolist() == [3, 3, 6, 6, 6, 6]


def test_seeded_sampling_equals_a_per_row_loop_over_the_unpadded_prompt(qwen_bpe):
    """With seeds, row r = b * G + j at step t is next_tokens(logits, draw = seeded_draws(seeds)[r, t]) where the logits
    come from a plain forward of prompt b alone (no padding, no cache) followed by the row's own earlier tokens, under
    temperature, top-k, top-p and min_new_tokens together.

    Mutations killed: one uniform reused at every step, the first-step logits or the KV cache of another prompt given
    to a row (tiled instead of interleaved), pads attended in the prefill or the decode steps."""
    agent = Agent.from_pretrained(qwen_bpe)
    G, seeds = 3, [11, 7, 5]
    params = SamplingParams(max_new_tokens=6, min_new_tokens=1, temperature=0.7, top_k=40, top_p=0.9)
    gen = HFEngine().generate(agent, PROMPTS, G, params, seeds=seeds)
    draws = seeded_draws(seeds, G, params.max_new_tokens, "cpu")
    eos = torch.tensor(agent.eos_token_ids)
    expected = torch.full((len(PROMPTS) * G, params.max_new_tokens), agent.tokenizer.pad_token_id)
    with torch.no_grad():
        for r in range(len(PROMPTS) * G):
            ids = agent.tokenizer(PROMPTS[r // G], return_tensors="pt")["input_ids"]
            for t in range(params.max_new_tokens):
                logits = agent.model(input_ids=ids).logits[:, -1]
                token = next_tokens(
                    logits, params, eos, t < params.min_new_tokens, draw=draws[r : r + 1, t : t + 1]
                )
                expected[r, t] = token
                if token in eos:
                    break
                ids = torch.cat([ids, token[:, None]], dim=1)
    assert torch.equal(gen.completion_ids, expected[:, : gen.completion_ids.shape[1]])
    assert (expected[:, gen.completion_ids.shape[1] :] == agent.tokenizer.pad_token_id).all()
    assert len({tuple(row.tolist()) for row in gen.completion_ids}) > G  # really sampled


def test_greedy_decoding_of_a_model_with_learned_positions_equals_transformers_generate(gpt2_bpe):
    """GPT-2 adds a learned embedding per position id: left-padded prompts must take the ids of the mask
    (cumsum - 1), as model.generate does, not 0..P-1, and decoding continues from the last one + 1 (mutations killed:
    positions ignore left padding, decode positions off by one, another prompt's positions given to a row; the
    Qwen2/Llama comparison in test_engines misses them: RoPE depends only on position differences, and the tiny
    models' greedy tokens hardly depend on positions)."""
    agent = Agent.from_pretrained(gpt2_bpe)
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    gen = HFEngine().generate(agent, PROMPTS, 2, params)
    config = GenerationConfig(
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=agent.eos_token_ids,
        pad_token_id=agent.tokenizer.pad_token_id,
    )
    expected = reference_generate(agent, PROMPTS, 2, config)
    assert torch.equal(gen.completion_ids, expected[:, : gen.completion_ids.shape[1]])


def assert_logprobs_equal_per_row_forwards(agent: Agent, gen, temperature: float = 1.0) -> None:  # noqa: ANN001
    """``agent.completion_logprobs`` of ``gen``'s rows equal, row by row, log softmax(logits / T) of a forward over
    the row's unpadded prompt + scored completion alone."""
    with torch.no_grad():
        got = agent.completion_logprobs(
            gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask, temperature=temperature
        )
        for r in range(gen.prompt_ids.shape[0]):
            prompt = gen.prompt_ids[r][gen.prompt_mask[r].bool()]
            n = int(gen.completion_mask[r].sum())
            completion = gen.completion_ids[r, :n]
            logits = agent.model(input_ids=torch.cat([prompt, completion])[None]).logits[
                0, len(prompt) - 1 : -1
            ]
            row = torch.log_softmax(logits / temperature, -1).gather(-1, completion[:, None]).squeeze(-1)
            torch.testing.assert_close(got[r, :n], row, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shared", [True, False])
def test_completion_logprobs_divide_by_the_temperature_on_both_paths(qwen_bpe, shared, scoring):
    """log softmax(logits / T)[token] at T = 0.6, on the shared-prompt path (rows repeat a prompt) and on the plain
    one (every prompt distinct), each against a per-row forward (mutations killed: T dropped on either path)."""
    agent = Agent.from_pretrained(qwen_bpe)
    torch.manual_seed(0)
    gen = HFEngine().generate(agent, PROMPTS, 2 if shared else 1, SamplingParams(max_new_tokens=5))
    assert (_shared_prompts(gen.prompt_ids, gen.prompt_mask) is not None) == shared
    assert_logprobs_equal_per_row_forwards(agent, gen, temperature=0.6)


def test_completion_logprobs_stop_at_each_rows_end(qwen_bpe, scoring, monkeypatch):
    """Rows that end at different lengths (one after its first token, none at the last column): up to its end each
    row's log-probs equal its own forward's, after it they are 0, on both paths; the model's forward runs the columns
    up to the longest row's end alone (comarl's own runs each row's, test_llama_decoder)."""
    import dataclasses

    agent = Agent.from_pretrained(qwen_bpe)
    torch.manual_seed(0)
    gen = HFEngine().generate(agent, PROMPTS, 2, SamplingParams(max_new_tokens=6, min_new_tokens=6))
    ends = torch.tensor([4, 1, 3, 4, 2, 4])
    gen = dataclasses.replace(gen, completion_mask=(torch.arange(6) < ends[:, None]).long())
    columns, forward = [], comarl.agents.Agent._forward_logprobs
    monkeypatch.setattr(
        comarl.agents.Agent,
        "_forward_logprobs",
        staticmethod(
            lambda model, p, pm, ids, *rest: columns.append(ids.shape[1]) or forward(model, p, pm, ids, *rest)
        ),
    )
    assert_logprobs_equal_per_row_forwards(agent, gen)
    with torch.no_grad():
        logp = agent.completion_logprobs(
            gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask
        )
    assert logp.shape == (6, 6)
    scored = gen.completion_mask.bool()
    assert not logp[~scored].any() and (logp[scored] < 0).all()
    assert columns == ([] if scoring == "own forward" else [4, 4])


def test_completion_logprobs_of_a_model_with_learned_positions_follow_the_mask(gpt2_bpe):
    """GPT-2 log-probs of left-padded rows equal each row's unpadded forward (mutation killed: scoring position ids
    0..P+T-1 instead of the mask's cumsum - 1; invisible to RoPE models)."""
    agent = Agent.from_pretrained(gpt2_bpe)
    torch.manual_seed(0)
    gen = HFEngine().generate(agent, PROMPTS, 2, SamplingParams(max_new_tokens=5))
    assert_logprobs_equal_per_row_forwards(agent, gen)


def test_prompts_of_equal_ids_but_different_masks_are_not_shared(qwen_bpe, scoring):
    """pad == EOS: "<|endoftext|>alice" and the one token shorter "alice" left-padded with EOS encode to the same ids
    with different masks (chat templates put EOS in prompts). They are two prompts: each row's log-probs equal its
    own unpadded forward (mutation killed: distinct prompts found from the ids alone, so the "alice" rows got the
    cache of the prompt that attends to the EOS)."""
    agent = Agent.from_pretrained(qwen_bpe)
    eos = agent.tokenizer.eos_token
    prompts = [f"{eos}alice", "alice"]
    ids, mask = agent.encode(prompts)
    assert torch.equal(ids[0], ids[1]) and not torch.equal(mask[0], mask[1])
    distinct, row_to_prompt = _shared_prompts(ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0))
    assert len(distinct) == 2 and row_to_prompt[0] != row_to_prompt[2]
    torch.manual_seed(0)
    gen = HFEngine().generate(agent, prompts, 2, SamplingParams(max_new_tokens=4, min_new_tokens=4))
    assert_logprobs_equal_per_row_forwards(agent, gen)


def test_generation_rows_pair_each_completion_with_its_own_prompt(qwen_bpe):
    """Row b * G + j holds prompt b's ids and mask (mutation killed: ``repeat`` instead of ``repeat_interleave``,
    which paired completions with other prompts while gen.prompts stayed right)."""
    agent = Agent.from_pretrained(qwen_bpe)
    gen = HFEngine().generate(agent, PROMPTS, 2, SamplingParams(max_new_tokens=2, do_sample=False))
    ids, mask = agent.encode(PROMPTS)
    assert torch.equal(gen.prompt_ids, ids.repeat_interleave(2, 0))
    assert torch.equal(gen.prompt_mask, mask.repeat_interleave(2, 0))


def test_greedy_scores_are_the_logits_whatever_the_sampling_settings():
    """Greedy decoding gets the logits with only the EOS rule applied (sampling_scores' docstring): no temperature
    (here 0, which SamplingParams allows with do_sample=False: dividing would give inf and NaN), no top-k / top-p
    (mutation killed: the temperature applied before the greedy return)."""
    logits = torch.tensor([[2.0, -1.0, 0.0, 0.5]])
    eos = torch.tensor([9])
    for temperature in (0.0, 0.5):
        params = SamplingParams(temperature=temperature, top_k=1, top_p=0.1, do_sample=False)
        assert torch.equal(sampling_scores(logits, params, eos), logits)
        assert next_tokens(logits, params, eos).tolist() == [0]


def test_top_k_of_zero_filters_nothing():
    """top_k = 0 is "off" (SamplingParams and the config say so): scores unchanged (mutation killed:
    ``if top_k is not None`` ran torch.topk with k = 0 and failed)."""
    logits = torch.tensor([[0.5, -1.0, 2.0]])
    assert torch.equal(sampling_scores(logits, SamplingParams(top_k=0), torch.tensor([9])), logits)


def test_the_draw_is_from_the_filtered_distribution():
    """p = [.1, .2, .3, .4] (logits log p), top_k = 2 keeps tokens 2 and 3 renormalised to [3/7, 4/7]:
    cdf = [0, 0, 3/7, 1] and u = 1 - U.
        U = 0.5  -> u = .5  -> token 3 (3/7 = .4286 < .5)
        U = 0.6  -> u = .4  -> token 2
        U = 0.95 -> u = .05 -> token 2 (unfiltered: cdf [.1, .3, .6, 1] -> token 0)
    top_p = 0.5 keeps the smallest set from the top reaching 0.5 (ascending cumsum [.1, .3, .6, 1]: drop <= .5,
    i.e. tokens 0 and 1): the same two tokens, the same answers. Mutation killed: the CDF built from the raw logits
    (filters ignored by the draw)."""
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).expand(3, 4)
    draw = torch.tensor([[0.5], [0.6], [0.95]])
    eos = torch.tensor([9])
    for params in (SamplingParams(top_k=2), SamplingParams(top_p=0.5)):
        assert next_tokens(logits, params, eos, draw=draw).tolist() == [3, 2, 2]
    assert next_tokens(logits, SamplingParams(), eos, draw=draw).tolist() == [2, 2, 0]
