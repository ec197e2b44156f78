"""Agent: what it accepts as prompts and tokenizers, and the errors that name what to fix."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comarl.agents import Agent, Team
from comarl.engines import HFEngine, SamplingParams

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
GREEDY = SamplingParams(max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (
            None,
            r"agent 1 \(role 'critic'\): prompts\[1\]: got NoneType None \(a formatter that forgot to return\?\)",
        ),
        (
            3,
            r"agent 1 \(role 'critic'\): prompts\[1\]: got int 3; a prompt is a string or a list of chat messages",
        ),
        (
            {"role": "user", "content": "hi"},
            r"prompts\[1\]: got dict \{'role': 'user', 'content': 'hi'\} \(wrap a single message in a list\)",
        ),
        (["hi"], r"prompts\[1\]: got list \['hi'\]; .*make the formatter return one"),
    ],
)
def test_a_formatter_output_that_is_no_prompt_names_the_agent_and_the_prompt(qwen_bpe, prompt, message):
    """None, an int or a single message dict were reported as "chat messages but the tokenizer has no chat_template"
    (or a bare TypeError from the template): the error now names the agent, the prompt's position and its type."""
    agents = [Agent.from_pretrained(qwen_bpe), Agent.from_pretrained(qwen_bpe, role="critic")]
    Team(agents)
    agents[1].tokenizer.chat_template = CHAT_TEMPLATE
    with pytest.raises(TypeError, match=message):
        agents[1].encode([[{"role": "user", "content": "a"}], prompt])
    agents[1].tokenizer.chat_template = None
    with pytest.raises(TypeError, match=message):
        agents[1].encode(["a", prompt])


def test_chat_messages_may_be_a_tuple(qwen_bpe):
    agent = Agent.from_pretrained(qwen_bpe)
    agent.tokenizer.chat_template = CHAT_TEMPLATE
    as_list, _ = agent.encode([[{"role": "user", "content": "hi"}]])
    as_tuple, _ = agent.encode([({"role": "user", "content": "hi"},)])
    assert torch.equal(as_list, as_tuple)


@pytest.mark.parametrize("prompts", [["alice and bob", ""], ["", ""]])
def test_a_prompt_of_no_tokens_is_refused(qwen_bpe, prompts):
    """With a tokenizer that adds no BOS, '' encoded to nothing: generation ran on a fully masked context (one empty
    prompt) or failed in a reshape (all empty)."""
    agent = Agent.from_pretrained(qwen_bpe)
    position = prompts.index("")
    with pytest.raises(ValueError, match=rf"Agent: prompts\[{position}\] \(''\) encodes to no tokens"):
        HFEngine().generate(agent, prompts, 2, GREEDY)


def test_a_pad_token_outside_the_embeddings_is_refused(qwen_bpe):
    """add_special_tokens({'pad_token': ...}) without resizing the embeddings: Agent() accepted it and generation
    died in torch's embedding lookup."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_bpe)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    message = (
        r"Agent: tokenizer.pad_token_id=1024 is outside the model's 1024 embedding rows; resize them "
        r"\(model.resize_token_embeddings\(len\(tokenizer\)\)\) or leave the pad token unset so that EOS pads"
    )
    with pytest.raises(ValueError, match=message):
        Agent(AutoModelForCausalLM.from_pretrained(qwen_bpe), tokenizer)


def test_an_eos_outside_the_embeddings_is_refused(qwen_bpe):
    model = AutoModelForCausalLM.from_pretrained(qwen_bpe)
    model.generation_config.eos_token_id = 5000
    with pytest.raises(
        ValueError, match=r"Agent: EOS id 5000 \(.*\) is outside the model's 1024 embedding rows"
    ):
        Agent(model, AutoTokenizer.from_pretrained(qwen_bpe))


def test_a_tokenizer_that_returns_no_attention_mask(qwen_bpe):
    """Tokenizers whose model_input_names leave out attention_mask made encode fail with KeyError."""
    plain = Agent.from_pretrained(qwen_bpe)
    bare = Agent(plain.model, AutoTokenizer.from_pretrained(qwen_bpe, model_input_names=["input_ids"]))
    prompts = ["alice", "alice and bob"]
    for got, expected in zip(bare.encode(prompts), plain.encode(prompts)):
        assert torch.equal(got, expected)


def test_right_padding_set_after_the_agent_still_pads_on_the_left(qwen_bpe):
    """The tokenizer is the caller's object: padding_side='right' set on it later made generation condition on pads
    (other tokens than each prompt alone) and the log-probs wrong."""
    agent = Agent.from_pretrained(qwen_bpe)
    prompts = ["alice", "alice and bob meet at the park"]
    alone = [HFEngine().generate(agent, [p], 1, GREEDY).completion_ids[0] for p in prompts]
    agent.tokenizer.padding_side = "right"
    ids, mask = agent.encode(prompts)
    assert mask[0, 0] == 0 and mask[0, -1] == 1  # left padded
    batched = HFEngine().generate(agent, prompts, 1, GREEDY).completion_ids
    for row, expected in zip(batched, alone):
        assert torch.equal(row[: len(expected)], expected)


def test_the_models_own_tokenizer_comes_from_where_the_model_came_from(qwen_bpe, llama_word, monkeypatch):
    """model_kwargs' revision/token/trust_remote_code reached the model only: a gated model's tokenizer failed without
    the token, and a pinned revision's model got the newest tokenizer. A tokenizer named apart keeps its own."""
    import transformers

    calls = []
    load = transformers.AutoTokenizer.from_pretrained

    def recording(name, *args, **kwargs):
        calls.append((name, kwargs))
        return load(name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    hub = {"revision": "main", "local_files_only": True, "trust_remote_code": False}
    Agent.from_pretrained(qwen_bpe, model_kwargs={**hub, "attn_implementation": "eager"})
    Agent.from_pretrained(qwen_bpe, llama_word, model_kwargs=hub)
    assert calls == [(qwen_bpe, hub), (llama_word, {})]


def test_agents_sharing_one_model_must_agree_on_the_learning_rate(qwen_bpe):
    """One model, one optimizer: Team(share_weights=True) took agents with different learning rates and the trainer
    then used agent 0's for every role, silently."""
    first = Agent.from_pretrained(qwen_bpe, learning_rate=1e-3)
    second = Agent(first.model, AutoTokenizer.from_pretrained(qwen_bpe), learning_rate=1e-4)
    with pytest.raises(
        ValueError, match=r"learning_rate values \[0.001, 0.0001\] differ, but they share one model"
    ):
        Team([first, second], share_weights=True)
    second.learning_rate = 1e-3
    assert Team([first, second], share_weights=True).share_weights


def test_model_kwargs_for_a_model_object_are_refused_not_ignored(qwen_bpe):
    model = AutoModelForCausalLM.from_pretrained(qwen_bpe)
    with pytest.raises(
        ValueError,
        match=r"Agent.from_pretrained: model_kwargs=\{'attn_implementation': 'eager'\} apply to a model loaded from "
        r"a hub id or path, and this one is a model object",
    ):
        Agent.from_pretrained(model, qwen_bpe, model_kwargs={"attn_implementation": "eager"})
    assert Agent.from_pretrained(model, qwen_bpe, model_kwargs={}).model is model


def test_every_weight_becomes_fp32_not_only_the_first(qwen_bpe):
    """Only the first parameter's dtype was checked: a model with a bf16 weight further on kept it, and AdamW
    stepped it in bf16."""
    model = AutoModelForCausalLM.from_pretrained(qwen_bpe)
    model.lm_head.weight.data = model.lm_head.weight.data.bfloat16()
    model.model.norm.weight.data = model.model.norm.weight.data.bfloat16()
    agent = Agent(model, AutoTokenizer.from_pretrained(qwen_bpe))
    assert {p.dtype for p in agent.model.parameters()} == {torch.float32}


def test_a_process_that_does_not_train_an_agent_loads_its_tokenizer_as_the_one_that_does(
    qwen_bpe, monkeypatch
):
    """Under agent parallelism the other processes loaded agent i's own tokenizer without the hub settings
    (revision, token, remote code) of model_config['model_kwargs']."""
    from transformers import AutoTokenizer as Loader

    from comarl.trainers.magrpo import _remote_agent

    calls, load = [], Loader.from_pretrained
    monkeypatch.setattr(Loader, "from_pretrained", lambda name, **kw: calls.append(kw) or load(name, **kw))
    settings = {
        "model_kwargs": {"revision": "main", "local_files_only": True, "attn_implementation": "eager"}
    }
    _remote_agent(qwen_bpe, None, 1, settings)
    assert calls == [{"revision": "main", "local_files_only": True}]


@pytest.mark.parametrize("rate", [0, -1e-5, float("nan"), "1e-5"])
def test_an_agents_own_learning_rate_is_checked_when_it_is_built(qwen_bpe, rate):
    with pytest.raises(ValueError, match=r"^Agent: learning_rate=.* must be a finite number > 0 \(or None"):
        Agent.from_pretrained(qwen_bpe, learning_rate=rate)
