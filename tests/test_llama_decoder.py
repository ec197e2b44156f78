"""comarl's own decode step (``LlamaDecoder``) against the model's forward: the same logits step by step, the same
samples through ``sample_completions``, and the models it must leave to their own forward."""

from __future__ import annotations

import time
from types import SimpleNamespace

import peft
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from comarl import llama_decoder
from comarl.engines import HFEngine, SamplingParams, sample_completions
from comarl.llama_decoder import (
    LlamaDecoder,
    PackingTrial,
    packed_weights,
    packing_pays,
    packing_possible,
    shared_prompt_logits,
    unsupported_reason,
)

# RoPE types: four fixed by position, then 'dynamic', its Llama 3 variant, 'longrope', and a per-layer-type dict.
ROPE_TYPES = [
    "default",
    "linear",
    "llama3",
    "yarn",
    "dynamic",
    "llama3_dynamic",
    "longrope",
    {"full": "default"},
]

SMALL = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


@pytest.fixture(autouse=True, params=["packed", "plain"])
def packing(request, monkeypatch) -> bool:
    """Every test here runs with the decoder's weights packed wherever they can be, and with the plain products:
    which of the two a decoder uses is timed on the machine (``packing_pays``, tested on its own below)."""
    packs = request.param == "packed"
    monkeypatch.setattr(
        llama_decoder, "packing_pays", lambda model, rows, steps: packs and packing_possible(model)
    )
    return packs


def randomized(model):
    """Biases and RMSNorm weights away from their initial 0 and 1, so that a step leaving one out shows."""
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
            elif param.dim() == 1:
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
    return model.eval()


def llama(**overrides) -> LlamaForCausalLM:
    """A random Llama with every optional part on: biases, a head size of its own, llama3 RoPE scaling."""
    torch.manual_seed(0)
    config = LlamaConfig(
        **SMALL,
        attention_bias=True,
        mlp_bias=True,
        head_dim=16,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        **overrides,
    )
    return randomized(LlamaForCausalLM(config))


def mistral(**overrides) -> MistralForCausalLM:
    """A random Mistral without a sliding window (as Mistral-7B-v0.3's config has it), a head size of its own."""
    torch.manual_seed(3)
    return randomized(
        MistralForCausalLM(MistralConfig(**{**SMALL, "head_dim": 16, "sliding_window": None, **overrides}))
    )


def qwen2(**overrides) -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    return randomized(Qwen2ForCausalLM(Qwen2Config(**SMALL, **overrides)))


def qwen3(**overrides) -> Qwen3ForCausalLM:
    """A random Qwen3: an RMSNorm over each head's query and key, a head size set apart from the hidden size."""
    torch.manual_seed(2)
    return randomized(Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16, **overrides)))


def left_padded(lengths: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    P = max(lengths)
    ids = torch.randint(vocab, (len(lengths), P), generator=generator)
    mask = torch.zeros(len(lengths), P, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, P - n :] = 1
    return ids, mask


def forward_logits(model, ids, mask, G, continuation):
    """Logits of every step by the model's own forward (the engine's plain path), teacher-forced on ``continuation``."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    first = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    cache.batch_repeat_interleave(G)
    attention = torch.cat(
        [mask.repeat_interleave(G, 0), mask.new_ones(mask.shape[0] * G, continuation.shape[1])], 1
    )
    next_position = positions[:, -1:].repeat_interleave(G, 0) + 1
    steps = [first.logits[:, -1].repeat_interleave(G, 0)]
    for t in range(continuation.shape[1]):
        out = model(
            input_ids=continuation[:, t : t + 1],
            attention_mask=attention[:, : ids.shape[1] + t + 1],
            position_ids=next_position + t,
            cache=cache,
            use_cache=True,
        )
        steps.append(out.logits[:, -1])
    return torch.stack(steps, 1)


def decoder_logits(model, ids, mask, G, continuation):
    """The same logits from the decoder: its prefill, then a step per token of ``continuation``."""
    decoder = LlamaDecoder(model, mask, G, continuation.shape[1])
    steps = [decoder.prefill(ids).repeat_interleave(G, 0)]
    steps += [decoder.next_logits(continuation[:, t]) for t in range(continuation.shape[1])]
    return torch.stack(steps, 1)


@pytest.mark.parametrize("build", [llama, mistral, qwen2, qwen3], ids=["llama", "mistral", "qwen2", "qwen3"])
@torch.no_grad()
def test_decoder_logits_equal_the_model_forward_step_by_step(build):
    """Left-padded prompts of different lengths (one unpadded), G = 3 rows each, 6 teacher-forced steps: every
    step's logits equal the forward's, with the Llama's biases, own head size and llama3 RoPE scaling."""
    model = build()
    assert unsupported_reason(model) is None  # the engine decodes it through the step
    ids, mask = left_padded([5, 9, 2], model.config.vocab_size)
    continuation = torch.randint(model.config.vocab_size, (9, 6), generator=torch.Generator().manual_seed(3))
    expected = forward_logits(model, ids, mask, 3, continuation)
    got = decoder_logits(model, ids, mask, 3, continuation)
    assert got.shape == (9, 7, model.config.vocab_size)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("build", [llama, qwen3], ids=["llama", "qwen3"])
@torch.no_grad()
def test_a_decoder_that_keeps_some_rows_goes_on_as_the_forward_of_those_rows(build):
    """After keep_rows (rows that ended dropped), each step's logits of the kept rows, in the order given, equal the
    forward's for those rows: their keys, values, padding and positions went with them; twice over."""
    model = build()
    ids, mask = left_padded([5, 9, 2], model.config.vocab_size)
    continuation = torch.randint(model.config.vocab_size, (9, 7), generator=torch.Generator().manual_seed(3))
    expected = forward_logits(model, ids, mask, 3, continuation)
    decoder = LlamaDecoder(model, mask, 3, 7)
    decoder.prefill(ids)
    live = torch.arange(9)
    for t in range(7):
        if t == 3:
            decoder.keep_rows(torch.tensor([7, 1, 4]))  # rows of the third, first and second prompt
            live = live[[7, 1, 4]]
        if t == 5:
            decoder.keep_rows(torch.tensor([2]))  # of those: row 4 alone
            live = live[[2]]
        got = decoder.next_logits(continuation[live, t])
        assert decoder.rows == len(live)
        torch.testing.assert_close(got, expected[live, t + 1], atol=2e-5, rtol=1e-5)


@torch.no_grad()
def test_a_dynamic_rope_rescales_step_by_step_as_in_the_forward():
    """A 'dynamic' RoPE changes its frequencies once positions pass the original 8: the decoder takes cos and sin
    from the model's rotary_emb at every step, as the forward does, so its logits still match."""
    torch.manual_seed(0)
    config = LlamaConfig(
        **{**SMALL, "max_position_embeddings": 8},
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    model = LlamaForCausalLM(config).eval()
    ids, mask = left_padded([5, 3], config.vocab_size)
    continuation = torch.randint(config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(5))
    expected = forward_logits(model, ids, mask, 2, continuation)
    got = decoder_logits(model, ids, mask, 2, continuation)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("rope_parameters", "calls"),
    [
        ({"rope_type": "default", "rope_theta": 10000.0}, 1),
        ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 5),
    ],
    ids=["default", "dynamic"],
)
@torch.no_grad()
def test_rotary_cos_and_sin_are_made_once_per_call_unless_the_rope_is_dynamic(
    monkeypatch, rope_parameters, calls
):
    """A RoPE fixed by position gives the decoder the cos and sin of all its steps in one call of rotary_emb, at its
    first step; a 'dynamic' one is asked at every step. The logits are the forward's either way."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, rope_parameters=rope_parameters)).eval()
    ids, mask = left_padded([5, 3], model.config.vocab_size)
    continuation = torch.randint(model.config.vocab_size, (4, 5), generator=torch.Generator().manual_seed(5))
    expected = forward_logits(model, ids, mask, 2, continuation)
    decoder = LlamaDecoder(model, mask, 2, continuation.shape[1])
    first = decoder.prefill(ids)  # one rotary_emb call of its own, at the prompts' positions
    rotary_emb, asked = model.model.rotary_emb, []
    forward = rotary_emb.forward
    monkeypatch.setattr(
        rotary_emb, "forward", lambda x, position_ids: asked.append(1) or forward(x, position_ids)
    )
    steps = [first.repeat_interleave(2, 0)]
    steps += [decoder.next_logits(continuation[:, t]) for t in range(continuation.shape[1])]
    assert len(asked) == calls
    torch.testing.assert_close(torch.stack(steps, 1), expected, atol=2e-5, rtol=1e-5)


def test_which_rope_types_are_fixed_by_position():
    fixed = [llama_decoder.rope_fixed_by_position(SimpleNamespace(rope_type=kind)) for kind in ROPE_TYPES]
    assert fixed == [True, True, True, True, False, False, False, False]


def test_rotate_is_rotate_half_exactly():
    x, cos, sin = torch.randn(3, 2, 1, 8), torch.randn(3, 1, 1, 8), torch.randn(3, 1, 1, 8)
    x1, x2 = x.chunk(2, dim=-1)
    expected = x * cos + torch.cat((-x2, x1), dim=-1) * sin  # transformers' apply_rotary_pos_emb
    assert torch.equal(llama_decoder.rotate(x, cos, llama_decoder.signed_sin(sin)), expected)


@torch.no_grad()
def test_decoder_follows_the_forward_under_bf16_autocast():
    """Under bf16 autocast (an agent with bf16 set) the step runs the forward's operations in the same precisions."""
    model = qwen2()
    ids, mask = left_padded([4, 7], model.config.vocab_size)
    continuation = torch.randint(model.config.vocab_size, (4, 5), generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = forward_logits(model, ids, mask, 2, continuation)
        got = decoder_logits(model, ids, mask, 2, continuation)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=0)


def packed_names(model) -> list[str]:
    """The layers whose weight a decoder for ``model`` packs (``packed_weights``), by name."""
    packed = packed_weights(model)
    return sorted(name for name, module in model.named_modules() if module in packed)


def packed_products(monkeypatch, delay: float = 0.0) -> list:
    """The layer of every packed product (``packed_linear``) from now on, each made ``delay`` seconds slower."""
    calls, pack = [], llama_decoder.packed_linear

    def product(*args):
        calls.append(args[0])
        if delay:  # even sleep(0) costs tens of us
            time.sleep(delay)
        return pack(*args)

    monkeypatch.setattr(llama_decoder, "packed_linear", product)
    return calls


@torch.no_grad()
def test_plain_projections_are_packed_on_the_cpu_in_fp32_only(monkeypatch, packing):
    """On the CPU in fp32 the weight of every plain nn.Linear among the layers' projections and the head is packed
    (the step-by-step tests above run through them); none under autocast, with oneDNN turned off, with bf16
    weights, on an Arm CPU without ACL; the LoRA layers of a peft model are left to their module call, its other
    projections packed."""
    model = qwen2()
    calls = packed_products(monkeypatch)
    decoder_logits(model, *left_padded([3, 5], SMALL["vocab_size"]), 2, torch.zeros(4, 2, dtype=torch.long))
    if packing:
        assert len(calls) == 2 * 15 and len(set(calls)) == 15  # two steps, every packed layer once per step
    else:
        assert calls == []  # packing_pays said no: every product plain
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    layer_names = [
        f"model.layers.{i}.{kind}.{name}"
        for i in range(2)
        for kind, name in [("self_attn", p) for p in projections[:4]] + [("mlp", p) for p in projections[4:]]
    ]
    assert packed_names(model) == sorted(layer_names + ["lm_head"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert packed_names(model) == []
    # oneDNN turned off (the switch that torch.backends.mkldnn.flags sets)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert packed_names(model) == []
    monkeypatch.undo()
    assert packed_names(qwen2().to(torch.bfloat16)) == []
    # an Arm CPU without ACL's kernels
    monkeypatch.setattr(llama_decoder.platform, "machine", lambda: "arm64")
    assert not torch.ops.mkldnn._is_mkldnn_acl_supported() and packed_names(model) == []
    monkeypatch.undo()
    adapted = lora(qwen2(), targets=("q_proj", "down_proj"))
    assert packed_names(adapted) == sorted(
        f"base_model.model.{name}"
        for name in layer_names + ["lm_head"]
        if not name.endswith(("q_proj", "down_proj"))
    )


def test_packing_pays_from_the_trials_times(monkeypatch, packing):
    """``packing + steps * packed < steps * plain`` from the trial's times for these weight shapes and rows: with
    3 ms plain, 2 ms packed and 10 ms to pack, 10 steps tie (30 ms either way: plain), 11 steps pay (32 < 33 ms).
    Without times: None (try) for a call of more than TRIAL_STEPS steps, False for a shorter one."""
    model = qwen2()
    trials = {llama_decoder.packing_key(model, 4): PackingTrial(3.0, 2.0, 10.0)}
    monkeypatch.setattr(llama_decoder, "PACKING_TRIALS", trials)
    assert packing_pays(model, 4, 10) is False
    assert packing_pays(model, 4, 11) is True
    assert llama_decoder.TRIAL_STEPS == 8
    assert packing_pays(model, 8, 9) is None  # other rows
    assert packing_pays(model, 8, 8) is False
    assert packing_pays(qwen3(), 4, 11) is None  # other weight shapes
    # A record decides RECORD_CALLS calls; then the next call long enough for a trial tries again.
    assert llama_decoder.RECORD_CALLS == 500
    monkeypatch.setattr(llama_decoder, "RECORD_CALLS", 3)
    assert packing_pays(model, 4, 11) is True  # the third call it decides
    assert packing_pays(model, 4, 11) is None
    # a short call still follows it: packing pays from 6 steps with 5 ms to pack (5 + 6 * 2 = 17 < 18 ms)
    trials[llama_decoder.packing_key(model, 4)] = PackingTrial(3.0, 2.0, 5.0, uses=3)
    assert packing_pays(model, 4, 6) is True


def test_packing_is_not_tried_where_it_cannot_be_or_under_deterministic_algorithms(monkeypatch, packing):
    """bf16 weights, oneDNN turned off: nothing to pack. Under torch.use_deterministic_algorithms the products
    stay the forward's own rather than follow a timing, whatever a trial found."""
    model = qwen2()
    monkeypatch.setattr(
        llama_decoder, "PACKING_TRIALS", {llama_decoder.packing_key(model, 4): PackingTrial(3.0, 2.0, 1.0)}
    )
    assert packing_pays(model, 4, 31) is True
    assert packing_pays(qwen2().to(torch.bfloat16), 4, 31) is False
    with monkeypatch.context() as off:
        # the switch that torch.backends.mkldnn.flags sets
        off.setattr(torch.backends.mkldnn, "enabled", False)
        assert packing_pays(model, 4, 31) is False
    torch.use_deterministic_algorithms(True)
    try:
        assert packing_pays(model, 4, 31) is False
        assert packing_pays(model, 8, 31) is False
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("slower", ["packed", "plain"])
@torch.no_grad()
def test_a_decoder_without_times_tries_both_ways_and_keeps_the_faster(monkeypatch, packing, slower):
    """The first decoder long enough for a trial decodes its first step plain, packs, then times 4 plain and 4
    packed steps in turn (steps 1-8), records the fastest of each and the packing, and keeps the faster products for
    the rest of the call; the next decoder of the same size decodes as the record says, without a trial. A
    product slowed by 0.3 ms makes its way the slower. The logits are the forward's throughout."""
    monkeypatch.setattr(llama_decoder, "packing_pays", packing_pays)  # the real rule, not the fixture's
    monkeypatch.setattr(llama_decoder, "PACKING_TRIALS", {})
    calls = packed_products(monkeypatch, delay=3e-4 if slower == "packed" else 0.0)
    if slower == "plain":
        plain = llama_decoder.linear
        monkeypatch.setattr(llama_decoder, "linear", lambda *args: time.sleep(3e-4) or plain(*args))
    model = qwen2()
    ids, mask = left_padded([3, 5], SMALL["vocab_size"])
    short = torch.randint(SMALL["vocab_size"], (4, 5), generator=torch.Generator().manual_seed(1))
    decoder_logits(model, ids, mask, 2, short)  # 4 steps after the prefill's token: too short for a trial
    assert llama_decoder.PACKING_TRIALS == {} and calls == []
    continuation = torch.randint(SMALL["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(2))
    expected = forward_logits(model, ids, mask, 2, continuation)
    torch.testing.assert_close(
        decoder_logits(model, ids, mask, 2, continuation), expected, atol=2e-5, rtol=1e-5
    )
    ((key, trial),) = llama_decoder.PACKING_TRIALS.items()
    assert key == llama_decoder.packing_key(model, 4)
    if slower == "packed":
        assert trial.packed > trial.plain + 15 * 3e-4
    else:
        assert trial.plain > trial.packed + 15 * 3e-4
    assert 0 < trial.packing < 1 and trial.uses == 0
    # 15 packed layers: 4 packed trial steps, then the call's last 3 steps (of 12) packed where plain is slower
    assert len(calls) == 15 * (4 if slower == "packed" else 7)
    calls.clear()
    torch.testing.assert_close(
        decoder_logits(model, ids, mask, 2, continuation), expected, atol=2e-5, rtol=1e-5
    )
    assert len(calls) == (0 if slower == "packed" else 15 * 12)
    assert list(llama_decoder.PACKING_TRIALS.values()) == [trial] and trial.uses == 1
    # After RECORD_CALLS calls the next one tries again: a new trial, its count from 0.
    monkeypatch.setattr(llama_decoder, "RECORD_CALLS", 1)
    calls.clear()
    decoder_logits(model, ids, mask, 2, continuation)
    assert len(calls) == 15 * (4 if slower == "packed" else 7)
    assert llama_decoder.PACKING_TRIALS[key] is not trial and llama_decoder.PACKING_TRIALS[key].uses == 0


@torch.no_grad()
def test_a_decoder_asks_packing_pays_for_its_rows_and_steps(monkeypatch, packing):
    """B * G rows and T - 1 steps (the first token comes from the prefill); its answer decides the products."""
    asked, calls = [], packed_products(monkeypatch)
    monkeypatch.setattr(
        llama_decoder, "packing_pays", lambda model, rows, steps: asked.append((rows, steps)) or packing
    )
    model = qwen2()
    ids, mask = left_padded([3, 5, 4], SMALL["vocab_size"])
    continuation = torch.zeros(6, 4, dtype=torch.long)
    got = decoder_logits(model, ids, mask, 2, continuation)
    assert asked == [(6, 3)]  # the engine decodes T - 1 steps; this helper all T
    assert len(calls) == (4 * 15 if packing else 0)
    torch.testing.assert_close(got, forward_logits(model, ids, mask, 2, continuation), atol=2e-5, rtol=1e-5)


@torch.no_grad()
def test_each_decoder_packs_the_weights_as_they_are_when_it_starts():
    """The weights change at every optimizer step: a decoder made after a change decodes with the new weights."""
    model = qwen2()
    ids, mask = left_padded([4, 6], SMALL["vocab_size"])
    continuation = torch.randint(SMALL["vocab_size"], (4, 3), generator=torch.Generator().manual_seed(9))
    before = decoder_logits(model, ids, mask, 2, continuation)
    for param in model.parameters():
        param.mul_(1.1)
    after = decoder_logits(model, ids, mask, 2, continuation)
    assert not torch.allclose(before, after, atol=1e-3)
    torch.testing.assert_close(after, forward_logits(model, ids, mask, 2, continuation), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("do_sample", [True, False], ids=["sampled", "greedy"])
@torch.no_grad()
def test_sample_completions_draw_the_same_tokens_with_and_without_the_decoder(qwen_bpe, do_sample):
    """The same seeded draws give the same completions through either path, rows ending at EOS included."""
    model = AutoModelForCausalLM.from_pretrained(qwen_bpe).eval()
    ids, mask = left_padded([6, 3, 11], model.config.vocab_size)
    eos = [int(model.config.eos_token_id)]
    params = SamplingParams(max_new_tokens=10, do_sample=do_sample)
    fast, plain = (
        sample_completions(model, ids, mask, 4, params, eos, 0, seeds=[7, 8, 9], fast_decoding=fast)
        for fast in (True, False)
    )
    assert fast.shape[0] == 12
    assert torch.equal(fast, plain)


@pytest.mark.parametrize("draws", ["seeds", "generator"])
@torch.no_grad()
def test_rows_that_ended_leave_the_decoder_and_the_completions_stay_the_same(qwen_bpe, monkeypatch, draws):
    """With a third of the vocabulary as EOS, sampled rows end at different steps: once half of the decoder's rows
    or more have ended it drops them (keep_rows, more than once here), and every completion equals the model
    forward's, which runs every row to the end, draw for draw (a generator's numbers are still drawn for every
    row)."""
    model = AutoModelForCausalLM.from_pretrained(qwen_bpe).eval()
    ids, mask = left_padded([6, 3, 11], model.config.vocab_size)
    eos = list(range(0, model.config.vocab_size, 3))
    params = SamplingParams(max_new_tokens=8)
    kept, keep_rows = [], LlamaDecoder.keep_rows

    def recording(decoder, rows):
        kept.append(len(rows))
        keep_rows(decoder, rows)

    monkeypatch.setattr(LlamaDecoder, "keep_rows", recording)

    def completions(fast):
        return sample_completions(
            model,
            ids,
            mask,
            8,
            params,
            eos,
            0,
            generator=torch.Generator().manual_seed(5) if draws == "generator" else None,
            seeds=[7, 8, 9] if draws == "seeds" else None,
            fast_decoding=fast,
        )

    fast = completions(True)
    assert len(kept) >= 2 and kept == sorted(kept, reverse=True) and kept[0] <= 12
    plain = completions(False)
    assert torch.equal(fast, plain)
    ended_at = torch.isin(fast, torch.tensor(eos)).float().argmax(1)
    assert len(set(ended_at.tolist())) > 2  # rows ended at different steps


def test_the_engine_decodes_through_the_decoder_unless_told_not_to(qwen_bpe, monkeypatch):
    from comarl.agents import Agent

    calls = []
    step = LlamaDecoder.next_logits
    monkeypatch.setattr(
        LlamaDecoder, "next_logits", lambda self, ids: calls.append(len(ids)) or step(self, ids)
    )
    agent = Agent.from_pretrained(qwen_bpe)
    params = SamplingParams(max_new_tokens=5, min_new_tokens=5)
    plain = HFEngine(fast_decoding=False).generate(agent, ["a b", "c"], 2, params, seeds=[1, 2])
    assert calls == []
    fast = HFEngine().generate(agent, ["a b", "c"], 2, params, seeds=[1, 2])
    assert calls == [4, 4, 4, 4]  # 5 tokens: the prefill's logits, then 4 steps of 4 rows
    assert fast.completions == plain.completions


def test_models_the_decoder_cannot_stand_in_for():
    assert unsupported_reason(llama()) is None
    assert unsupported_reason(qwen2()) is None
    assert unsupported_reason(qwen3()) is None
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    assert (
        unsupported_reason(gpt2)
        == "GPT2LMHeadModel is not LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM"
    )

    class Custom(Qwen2ForCausalLM):
        pass

    assert (
        unsupported_reason(Custom(Qwen2Config(**SMALL)))
        == "Custom is not LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM"
    )
    sliding = qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert unsupported_reason(sliding) == "sliding-window attention layers"
    # MistralConfig's default window; its config has no layer types
    assert (
        unsupported_reason(mistral(sliding_window=4096)) == "sliding-window attention (sliding_window=4096)"
    )
    dropout = qwen2(attention_dropout=0.1)
    assert unsupported_reason(dropout) is None  # in eval mode, as the engine runs it
    assert unsupported_reason(dropout.train()) == "attention dropout while training"
    wrapped = lora(qwen2())
    wrapped.register_forward_pre_hook(lambda *args: None)
    assert unsupported_reason(wrapped) == "the model has forward hooks"
    hooked = qwen2()
    hooked.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert unsupported_reason(hooked) == "model.layers.1.mlp has forward hooks"
    split = qwen2()
    split.model.layers[1].to("meta")
    assert unsupported_reason(split) == "weights on several devices"
    swapped = qwen2()
    swapped.model.layers[0].input_layernorm = torch.nn.LayerNorm(SMALL["hidden_size"])
    assert unsupported_reason(swapped) == (
        "model.layers.0.input_layernorm is a torch.nn.modules.normalization.LayerNorm"
    )


def lora(
    model, names=("first",), targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj", "embed_tokens")
):
    """``model`` with a LoRA adapter per name, none of them a no-op (peft starts every adapter at one)."""
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=list(targets))
    model = peft.get_peft_model(model, config, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "lora_B" in key or "lora_embedding_A" in key:  # (an embedding's A starts at 0, its B random)
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()


@torch.no_grad()
def test_lora_models_decode_with_their_adapters_step_by_step():
    """A peft LoRA model (adapters on projections and on the embedding) decodes through the step, its LoRA layers
    called as modules; with two adapters, the logits follow whichever is active, as the forward's do."""
    model = lora(qwen2(), names=("first", "second"))
    assert unsupported_reason(model) is None
    ids, mask = left_padded([4, 6], SMALL["vocab_size"])
    continuation = torch.randint(SMALL["vocab_size"], (4, 5), generator=torch.Generator().manual_seed(8))
    logits = {}
    for name in ("first", "second"):
        model.set_adapter(name)
        logits[name] = decoder_logits(model, ids, mask, 2, continuation)
        torch.testing.assert_close(
            logits[name], forward_logits(model, ids, mask, 2, continuation), atol=2e-5, rtol=1e-5
        )
    assert not torch.allclose(logits["first"], logits["second"], atol=1e-3)
    with model.disable_adapter():
        plain = decoder_logits(model, ids, mask, 2, continuation)
        torch.testing.assert_close(
            plain, forward_logits(model, ids, mask, 2, continuation), atol=2e-5, rtol=1e-5
        )


def test_peft_adapters_other_than_lora_keep_the_model_forward():
    ia3 = peft.get_peft_model(
        qwen2(), peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    )
    assert unsupported_reason(ia3) == "PeftModel holds peft adapters other than LoRA"


# ---------------------------------------------------------------------------- the training forward


def rows_forward_logits(model, prompt_ids, prompt_mask, completion_ids, row_to_prompt):
    """Each row's completion logits from the model's forward over its own left-padded prompt + completion."""
    ids = torch.cat([prompt_ids[row_to_prompt], completion_ids], dim=1)
    mask = torch.cat([prompt_mask[row_to_prompt], torch.ones_like(completion_ids)], dim=1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return logits[:, prompt_ids.shape[1] - 1 : -1]


def training_case(model, lengths=(5, 9, 2), T=6):
    """Three left-padded prompts (one unpadded) and seven rows continuing them out of order, one prompt alone."""
    ids, mask = left_padded(list(lengths), model.config.vocab_size)
    row_to_prompt = torch.tensor([1, 0, 1, 2, 0, 1, 0])
    completion = torch.randint(model.config.vocab_size, (7, T), generator=torch.Generator().manual_seed(4))
    return ids, mask, completion, row_to_prompt


def whole_rows_logits(model, prompt_ids, prompt_mask, completion_ids, row_to_prompt):
    """:func:`shared_prompt_logits` of every position of every row, ``[B, T, V]``."""
    logits = shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, row_to_prompt)
    return logits.view(*completion_ids.shape, -1)


def logits_and_grads(model, forward, *case):
    model.zero_grad(set_to_none=True)
    logits = forward(model, *case)
    (logits.float().square().mean() + logits[..., 3].sum()).backward()  # every logit reaches the loss
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [llama, mistral, qwen2, qwen3], ids=["llama", "mistral", "qwen2", "qwen3"])
def test_shared_prompt_logits_and_gradients_equal_each_rows_own_forward(build):
    """One pass over the distinct prompts and the rows gives the logits of the model's forward over each row's own
    prompt + completion, and the gradients of every weight (the shared prompts' included), with the Llama's
    biases, head size and llama3 RoPE scaling and Qwen3's query and key norms."""
    model = build().train()
    case = training_case(model)
    expected, expected_grads = logits_and_grads(model, rows_forward_logits, *case)
    got, grads = logits_and_grads(model, whole_rows_logits, *case)
    assert got.shape == (7, 6, model.config.vocab_size)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert grads.keys() == expected_grads.keys() and len(grads) == len(list(model.parameters()))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def product_rows(monkeypatch, model) -> dict[str, int]:
    """Each weight's name -> the rows its ``F.linear`` products saw, recorded until the test ends."""
    seen, real_linear = {}, torch.nn.functional.linear
    names = {p: name.removesuffix(".weight") for name, p in model.named_parameters()}

    def recording(x, weight, bias=None):
        seen[names[weight]] = seen.get(names[weight], 0) + x.reshape(-1, x.shape[-1]).shape[0]
        return real_linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", recording)
    return seen


def assert_last_layer_cut(seen: dict[str, int], model, every: int, last: int) -> None:
    """``seen`` (:func:`product_rows`) holds every weight of ``model``: each layer's q/k/v and all but the last
    layer's other projections over ``every`` rows, the last layer's o_proj and MLP and the head over ``last``."""
    last_layer = f"model.layers.{model.config.num_hidden_layers - 1}."
    assert len(seen) == 7 * model.config.num_hidden_layers + 1
    for name, count in seen.items():
        before_attention = name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")
        cut = name == "lm_head" or (name.startswith(last_layer) and not before_attention)
        assert count == (last if cut else every), name


@torch.no_grad()
def test_shared_prompt_logits_run_the_last_layer_past_its_keys_and_values_for_the_rows_only(monkeypatch):
    """The products' rows: every layer's queries, keys and values over both sets (each distinct prompt's tokens but
    its last once, its padding left out, then every row's T tokens), and the rest of every layer but the last too;
    the last layer's o_proj and MLP and the head over the rows' tokens alone (the prompt tokens' outputs there reach
    no logit)."""
    model = qwen2()
    case = training_case(model)  # prompts of 5, 9 and 2 tokens padded to 9, 7 rows of 6 tokens
    both, rows = (4 + 8 + 1) + 7 * 6, 7 * 6  # the prompts' tokens in their first 8 columns
    seen = product_rows(monkeypatch, model)
    shared_prompt_logits(model, *case)
    assert_last_layer_cut(seen, model, every=both, last=rows)


@pytest.mark.parametrize("build", [llama, qwen3], ids=["llama", "qwen3"])
def test_shared_prompt_logits_of_each_rows_first_positions_equal_the_whole_rows(build):
    """With ``lengths``, the logits of each row's first lengths[r] positions, row after row, and the gradients of a
    loss on them alone: those of the forward over whole rows (later positions reach no earlier one), a row of
    length 0 included."""
    model = build().train()
    case = training_case(model)
    lengths = torch.tensor([6, 2, 0, 5, 1, 3, 2])
    asked = torch.arange(6) < lengths[:, None]
    expected, expected_grads = logits_and_grads(model, lambda *c: rows_forward_logits(*c)[asked], *case)
    got, grads = logits_and_grads(model, lambda *c: shared_prompt_logits(*c, lengths), *case)
    assert got.shape == (int(lengths.sum()), model.config.vocab_size)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@torch.no_grad()
def test_shared_prompt_logits_run_each_rows_positions_up_to_its_length_alone(monkeypatch):
    """Every product runs over the distinct prompts' tokens and each row's first lengths[r] positions: a batch whose
    rows end early costs their tokens, not the longest row's times the rows; one whose rows all end early runs the
    columns up to the longest alone."""
    model = qwen2()
    case = training_case(model)  # prompts of 5, 9 and 2 tokens padded to 9 (4 + 8 + 1 run once), 7 rows of 6
    seen = product_rows(monkeypatch, model)
    for lengths in (torch.tensor([6, 2, 0, 5, 1, 3, 2]), torch.full((7,), 4)):
        seen.clear()
        shared_prompt_logits(model, *case, lengths)
        total = int(lengths.sum())
        assert_last_layer_cut(seen, model, every=(4 + 8 + 1) + total, last=total)


@torch.no_grad()
def test_the_prefill_runs_the_last_layer_past_its_keys_and_values_for_the_last_token_only(monkeypatch):
    """The decoder's prefill: every layer's queries, keys and values over the prompts' tokens (their padding left
    out), the rest of every layer but the last too; the last layer's o_proj and MLP and the head at each prompt's
    last token alone."""
    model = qwen2()
    ids, mask = left_padded([5, 3, 7], model.config.vocab_size)
    decoder = LlamaDecoder(model, mask, 2, 4)
    seen = product_rows(monkeypatch, model)
    decoder.prefill(ids)
    assert_last_layer_cut(seen, model, every=5 + 3 + 7, last=3)


def test_shared_prompt_logits_rescale_a_dynamic_rope_over_every_position_at_once():
    """A 'dynamic' RoPE rescales once positions pass the original 8: the one pass asks rotary_emb for every position
    together, as the model's forward over whole rows does (a prompt-then-rows pass would rotate the prompt's keys
    with the frequencies of a shorter call)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        **{**SMALL, "max_position_embeddings": 8},
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    model = LlamaForCausalLM(config)
    case = training_case(model, lengths=(6, 4, 3), T=7)
    with torch.no_grad():
        expected = rows_forward_logits(model, *case)
        torch.testing.assert_close(whole_rows_logits(model, *case), expected, atol=2e-5, rtol=1e-5)


def test_shared_prompt_logits_of_a_lora_model_follow_its_active_adapter():
    """A peft LoRA model (adapters on projections and on the embedding): the logits and the adapters' gradients of
    whichever adapter is active, and the base's logits with the adapters off."""
    model = lora(qwen2(), names=("first", "second")).train()
    case = training_case(model.get_base_model())
    for name in ("first", "second"):
        model.set_adapter(name)
        expected, expected_grads = logits_and_grads(model, rows_forward_logits, *case)
        got, grads = logits_and_grads(model, whole_rows_logits, *case)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
        assert grads.keys() == expected_grads.keys() and all(
            f".{name}." in n or n.endswith(name) for n in grads
        )
        for key, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[key], atol=1e-5, rtol=1e-4, msg=key)
    with torch.no_grad(), model.disable_adapter():
        torch.testing.assert_close(
            whole_rows_logits(model, *case), rows_forward_logits(model, *case), atol=2e-5, rtol=1e-5
        )


@torch.no_grad()
def test_shared_prompt_logits_follow_the_forward_under_bf16_autocast():
    model = qwen2()
    case = training_case(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = rows_forward_logits(model, *case)
        got = whole_rows_logits(model, *case)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=0)
