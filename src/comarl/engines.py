"""Generation backends. ``HFEngine``: one batched decode loop per agent per call, KV cache shared by the G samples."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from comarl.agents import CACHE_ARGUMENT, Agent, Prompt, check_cache_filled
from comarl.llama_decoder import LlamaDecoder, unsupported_reason


@dataclass
class SamplingParams:
    """How completions are drawn. ``do_sample=False`` is greedy decoding."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    do_sample: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams: max_new_tokens={self.max_new_tokens!r} must be an integer >= 1"
            )
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"SamplingParams: min_new_tokens={self.min_new_tokens!r} must be in [0, max_new_tokens="
                f"{self.max_new_tokens}]"
            )
        if self.do_sample and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"SamplingParams: temperature={self.temperature!r} must be a finite number > 0 when sampling; "
                "for greedy decoding use do_sample=False"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k={self.top_k!r} must be >= 0 (0 or None = off)")


@dataclass
class Generation:
    """Completions of one agent for ``len(prompts) x num_generations`` samples, prompt-major.

    Row ``b * G + j`` is sample ``j`` of prompt ``b``. Ids are left-padded prompts and right-padded
    completions; ``completion_mask`` is 1 up to and including the first EOS.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    prompts: list[Prompt]
    completions: list[str]

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def to(self, device: torch.device | str) -> Generation:
        """This generation with its tensors on ``device`` (itself when they are there already)."""
        if self.prompt_ids.device == torch.device(device):
            return self
        return Generation(
            self.prompt_ids.to(device),
            self.prompt_mask.to(device),
            self.completion_ids.to(device),
            self.completion_mask.to(device),
            self.prompts,
            self.completions,
        )


class Engine(Protocol):
    """What the rollout and evaluation need of a generation backend (:class:`HFEngine` is the one built in).

    It returns token ids and masks, not log-probs: the trainer scores the samples itself, in the training
    precision and without the sampling filters (top-k / top-p), and only when the loss needs them, so that the
    first PPO ratio is exactly 1 (a sampler's own log-probs under bf16, a KV cache or filtering would not be).
    """

    def generate(
        self,
        agent: Agent,
        prompts: Sequence[Prompt],
        num_generations: int,
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
    ) -> Generation:
        """``len(prompts) x num_generations`` completions of ``agent``, prompt-major (see :class:`Generation`).

        ``seeds``, one per prompt: prompt b's samples are drawn from a stream seeded with ``seeds[b]`` (vLLM's
        per-request seed), so they do not depend on the other prompts of the call; None: ``agent.generator``.
        """
        ...


class HFEngine:
    """Batched sampling from a ``transformers`` causal LM: every prompt x G samples in one decode loop.

    Each distinct prompt is run through the model once and its KV cache copied to its G samples
    (``model.generate`` would run every prompt G times), then :func:`sample_completions` draws
    all rows together, one forward per new token. For an agent with ``bf16`` set the whole call runs under
    bf16 autocast (CPU or CUDA), the precision the trainer then scores the samples in: the fp32 weights
    are cast once per call (autocast's cache), and decoding reads half the bytes.

    ``fast_decoding`` (default True): Llama, Mistral, Qwen2 and Qwen3 models decode through comarl's own step,
    :class:`~comarl.llama_decoder.LlamaDecoder` (the same logits; generation 1.3-1.5x faster on one CPU core in
    both machine states measured: docs/benchmarks.md);
    False: every model through its own forward.
    """

    def __init__(self, fast_decoding: bool = True) -> None:
        self.fast_decoding = fast_decoding

    @torch.no_grad()
    def generate(
        self,
        agent: Agent,
        prompts: Sequence[Prompt],
        num_generations: int,
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
    ) -> Generation:
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(
                f"HFEngine.generate: {len(seeds)} seeds for {len(prompts)} prompts; pass one per prompt"
            )
        tok = agent.tokenizer
        prompt_ids, prompt_mask = agent.encode(prompts)
        check_context(agent, prompt_ids.shape[1], params.max_new_tokens)
        was_training = agent.model.training
        agent.model.eval()
        try:
            with (
                on_device(prompt_ids.device),
                bf16_autocast(prompt_ids.device, agent.bf16),
                whole_weights(agent.model),
            ):
                completion_ids = sample_completions(
                    agent.model,
                    prompt_ids,
                    prompt_mask,
                    num_generations,
                    params,
                    agent.eos_token_ids,
                    tok.pad_token_id,
                    agent.generator,
                    seeds,
                    self.fast_decoding,
                )
        finally:
            agent.model.train(was_training)
        mask = completion_mask(completion_ids, agent.eos_token_ids)
        # Decoding: one host copy of the ids, then each row cut at its length (pad ids are never decoded).
        lengths = mask.sum(dim=1).tolist()
        rows = completion_ids.tolist()
        texts = tok.batch_decode([row[:n] for row, n in zip(rows, lengths)], skip_special_tokens=True)
        repeated = [p for p in prompts for _ in range(num_generations)]
        return Generation(
            prompt_ids.repeat_interleave(num_generations, dim=0),
            prompt_mask.repeat_interleave(num_generations, dim=0),
            completion_ids,
            mask,
            repeated,
            texts,
        )


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 for every generated token up to and including the first EOS, 0 after it.

    ``completion_ids[B, T]`` are only the generated tokens (the prompt is sliced off by length, so
    an EOS inside the prompt does not matter). The EOS token is scored because choosing to stop
    is an action; the padding after it is not.
    """
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for eos in eos_token_ids:
        is_eos |= completion_ids == eos
    # Tokens strictly after the first EOS have at least one EOS before them.
    eos_before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()
    return (eos_before == 0).to(torch.long)


def learned_position_limit(model: Any) -> tuple[str, int] | None:
    """``(config field, limit)`` for a model with learned absolute position embeddings (GPT-2's ``wpe``, OPT's
    ``embed_positions``): positions from the limit on index past the table. None for any other model: RoPE and ALiBi
    compute any position (past ``max_position_embeddings`` quality may drop, but nothing fails)."""
    # The embedding tables by their own names (peft wraps a table it adapts as '<name>.base_layer').
    tables = [
        name.removesuffix(".base_layer").rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Embedding)
    ]
    if not any("pos" in table or table == "wpe" for table in tables):
        return None
    for field in ("n_positions", "max_position_embeddings"):
        limit = getattr(model.config, field, None)
        if isinstance(limit, int):
            return field, limit
    return None


def check_context(agent: Agent, prompt_length: int, max_new_tokens: int) -> None:
    """Refuse, before decoding, a prompt + ``max_new_tokens`` beyond a model's learned positions (once per call)."""
    found = learned_position_limit(agent.model)
    if found is not None and prompt_length + max_new_tokens > found[1]:
        field, limit = found
        raise ValueError(
            f"HFEngine.generate: {agent.label}: the longest prompt ({prompt_length} tokens) + max_new_tokens="
            f"{max_new_tokens} is {prompt_length + max_new_tokens} positions, past the {limit} learned positions of "
            f"{type(agent.model).__name__} (config.{field}); shorten the prompts or lower max_new_tokens"
        )


@contextmanager
def whole_weights(model: Any) -> Iterator[None]:
    """Inside the block, a model sharded by FSDP2 (``shard_weights``) keeps each layer whole from its first
    forward on: one all-gather per layer per generate call instead of one per new token. The shards are
    restored at the end (layers reshard after each forward again, the root keeps its weights, FSDP2's default).
    Any other model is unchanged."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        yield  # nothing is sharded, and no FSDP import
        return
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
                module.set_reshard_after_forward(module is not model, recurse=False)


def on_device(device: torch.device | str) -> AbstractContextManager[Any]:
    """``device`` as the current CUDA device inside the block, for code that launches on the current device rather
    than the tensors' (custom kernels): agents generate and update in threads of their own, whose current device
    would otherwise be the first GPU. Nothing changes for any other device."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def bf16_autocast(device: torch.device, enabled: bool) -> AbstractContextManager[Any]:
    """bf16 autocast on ``device`` when ``enabled`` and the device is a CPU or a CUDA GPU; else nothing changes."""
    if enabled and device.type in ("cuda", "cpu"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def sample_completions(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    num_generations: int,
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
    seeds: Sequence[int] | None = None,
    fast_decoding: bool = True,
) -> torch.Tensor:
    """Completion ids ``[B * G, T]`` (row ``b * G + j`` = sample j of prompt b) from left-padded prompts ``[B, P]``.

    One prefill over the B prompts, the KV cache repeated G times, then one forward per new token
    over all rows. Row r stops at its first EOS (later positions hold ``pad_token_id``); the loop
    ends when every row has stopped or after ``max_new_tokens``. Position ids follow the attention
    mask, as in ``model.generate`` with left padding. Tokens are drawn by :func:`next_tokens`, from
    ``generator`` (torch's global stream when None), or with ``seeds`` (one per prompt) from
    :func:`seeded_draws`, which makes a prompt's samples independent of the other prompts of the call. Logits
    that are NaN or infinite (a model that overflowed) make the call raise once decoding ends. With
    ``fast_decoding``, a model that :func:`comarl.llama_decoder.unsupported_reason` accepts prefills and decodes
    through :class:`~comarl.llama_decoder.LlamaDecoder` (the same logits without the forward's per-step overhead);
    any other model, or ``fast_decoding=False``, through its own forward.
    """
    from transformers import DynamicCache

    G, T = num_generations, params.max_new_tokens
    device = prompt_ids.device
    eos = torch.tensor(list(eos_token_ids), device=device)
    positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
    decoder = None
    if fast_decoding and unsupported_reason(model) is None:
        decoder = LlamaDecoder(model, prompt_mask, G, T)
        logits = decoder.prefill(prompt_ids)  # its buffers hold the prompts' keys and values G times over
    else:
        cache = DynamicCache(config=model.config)
        logits = model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{CACHE_ARGUMENT: cache},
        ).logits[:, -1]
        check_cache_filled(cache, model)
        if G > 1:
            cache.batch_repeat_interleave(G)
    logits = logits.repeat_interleave(G, dim=0)
    rows, P = logits.shape[0], prompt_ids.shape[1]
    # The whole attention mask up front; step t attends to the prompt and the t tokens before it.
    attention = torch.cat([prompt_mask.repeat_interleave(G, dim=0), prompt_mask.new_ones(rows, T)], dim=1)
    first_position = positions[:, -1:].repeat_interleave(G, dim=0) + 1
    tokens = torch.full((rows, T), pad_token_id, dtype=prompt_ids.dtype, device=device)
    running = torch.ones(rows, dtype=torch.bool, device=device)
    # Each row's largest logits summed over the steps: NaN or infinite once the row's logits were (checked once, below).
    top_logits = torch.zeros(rows, device=device)
    draws = seeded_draws(seeds, G, T, device) if seeds is not None and params.do_sample else None
    live = None  # the rows the decoder still runs once it dropped rows that had ended (None: every row)
    for t in range(T):
        draw = None if draws is None else draws[:, t : t + 1]
        if live is not None and params.do_sample:
            if draw is None:  # the generator's numbers for every row, as if no row had been dropped
                draw = torch.rand(rows, 1, device=device, dtype=torch.float32, generator=generator)
            draw = draw[live]
        chosen = next_tokens(
            logits, params, eos, suppress_eos=t < params.min_new_tokens, generator=generator, draw=draw
        )
        if live is None:
            top_logits += logits.amax(dim=-1)
        else:  # back to every row: the dropped rows have ended, padding below
            top_logits.index_add_(0, live, logits.amax(dim=-1))
            chosen = tokens.new_full((rows,), pad_token_id).index_copy_(0, live, chosen)
        tokens[:, t] = torch.where(running, chosen, pad_token_id)
        running &= ~torch.isin(chosen, eos)
        # One host sync per step, as generate's stopping check: stop once every row has ended.
        still = int(running.sum())
        if t + 1 == T or still == 0:
            break
        if decoder is not None:
            # Half the decoder's rows or more have ended: it drops them (one copy of the rest's keys and values)
            # and runs fewer rows per step; not while it times its products (packing trial), for the same rows.
            if still <= decoder.rows // 2 and decoder.trial_key is None:
                kept = (running if live is None else running[live]).nonzero().squeeze(1)
                decoder.keep_rows(kept)
                live = kept if live is None else live[kept]
            logits = decoder.next_logits(tokens[:, t] if live is None else tokens[live, t])
        else:
            logits = model(
                input_ids=tokens[:, t : t + 1],
                attention_mask=attention[:, : P + t + 1],
                position_ids=first_position + t,
                use_cache=True,
                **{CACHE_ARGUMENT: cache},
            ).logits[:, -1]
    broken = int((~top_logits.isfinite()).sum())
    if broken:
        raise FloatingPointError(
            f"sample_completions: {type(model).__name__} gave NaN or infinite next-token logits for "
            f"{broken} of {rows} rows, nothing to draw from: its weights hold NaN/inf (a diverged "
            "update?) or its activations overflowed; check the weights, or run in fp32 (bf16=False, also in "
            "agent_settings)"
        )
    return tokens[:, : t + 1]


def next_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    eos: torch.Tensor,
    suppress_eos: bool = False,
    generator: torch.Generator | None = None,
    draw: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row from next-token ``logits[rows, V]``: the argmax, or a draw from :func:`sampling_scores`.

    The draw is by inverse CDF: with ``c = cumsum(softmax(z))`` and ``u = (1 - U[0, 1)) * c[-1]`` in
    ``(0, c[-1]]``, the token is the first ``i`` with ``c[i] >= u``, so ``P(i) = p[i] / c[-1]`` and a
    token of probability 0 is never drawn (``torch.multinomial`` draws the same distribution, more
    slowly on CPU). ``U`` is ``draw[rows, 1]`` when given, else drawn from ``generator``. A row with nothing to
    draw from (NaN or infinite scores) still gets an id inside the vocabulary; the caller refuses such rows
    (:func:`sample_completions` does, once per call: checking each draw here would wait on the device at every
    token).
    """
    scores = sampling_scores(logits, params, eos, suppress_eos)
    if not params.do_sample:
        return scores.argmax(dim=-1)
    probs = scores.softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    if cdf.device.type != "cpu":
        # CUDA's cumsum adds in tree order: a token of probability 0 could sit one rounding step above its left
        # neighbour and be drawn. Zeroing its entry and taking the running max gives it a window of exactly 0. The
        # CPU's adds in order, so such a token's entry already equals its neighbour's (~70 us a step at 32 rows).
        cdf = cdf.masked_fill(probs == 0, 0).cummax(dim=-1).values
    if draw is None:
        draw = torch.rand(cdf.shape[0], 1, device=cdf.device, dtype=cdf.dtype, generator=generator)
    u = (1 - draw) * cdf[:, -1:]
    # A NaN CDF (NaN scores) makes searchsorted answer V, one past the vocabulary.
    return torch.searchsorted(cdf, u).squeeze(1).clamp_(max=cdf.shape[-1] - 1)


def seeded_draws(
    seeds: Sequence[int], num_generations: int, max_new_tokens: int, device: torch.device | str
) -> torch.Tensor:
    """Uniform draws ``[len(seeds) * G, T]`` for :func:`next_tokens`: the G rows of prompt b (row ``b * G + j``,
    step t in column t) are the first ``G * T`` values of a CPU stream seeded with ``seeds[b]`` alone. Sample j
    of a prompt therefore gets the same draws whatever else shares the call and whatever G is (row j is the
    stream's j-th T values), on every device: the numbers are drawn on the CPU and copied to ``device`` once
    per call (a CUDA generator lays its numbers out by the size drawn, so sample j would depend on G)."""
    streams = [torch.Generator().manual_seed(seed) for seed in seeds]
    draws = torch.cat([torch.rand(num_generations, max_new_tokens, generator=g) for g in streams])
    return draws.to(device)


def stream_seed(*keys: int) -> int:
    """A seed in ``[0, 2**63)`` fixed by the integers ``keys`` alone (their BLAKE2b digest): e.g.
    ``stream_seed(seed, item)`` for an item's episodes, the same in every process and Python version."""
    digest = hashlib.blake2b(repr(tuple(int(k) for k in keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sampling_scores(
    logits: torch.Tensor, params: SamplingParams, eos: torch.Tensor, suppress_eos: bool = False
) -> torch.Tensor:
    """The scores ``z`` that tokens are drawn from, ``softmax(z)``, filtered as transformers' logits processors do.

    In order: EOS gets ``-inf`` while ``suppress_eos`` (``min_new_tokens`` not reached); then, when
    sampling, ``z = logits / temperature``; only the ``top_k`` largest ``z`` are kept (ties kept);
    and the tokens whose cumulative probability, summed from the least likely up, stays
    ``<= 1 - top_p`` are dropped (at least one token always survives). Greedy decoding gets the
    logits with only the EOS rule applied.
    """
    scores = logits.float()
    if suppress_eos:
        scores = scores.index_fill(1, eos, -math.inf)
    if not params.do_sample:
        return scores
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k:
        kth_largest = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth_largest, -math.inf)
    if params.top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - params.top_p
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), -math.inf)
    return scores


def concat_generations(generations: Sequence[Generation], pad_token_id: int) -> Generation:
    """Stack generations of one agent (e.g. the turns of a rollout tree) into one batch.

    Prompts are re-padded on the left and completions on the right to the widest of each.
    """
    if len(generations) == 1:
        return generations[0]
    P = max(g.prompt_ids.shape[1] for g in generations)
    T = max(g.completion_ids.shape[1] for g in generations)

    def pad(t: torch.Tensor, width: int, value: int, left: bool) -> torch.Tensor:
        extra = width - t.shape[1]
        if extra == 0:
            return t
        block = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
        return torch.cat([block, t] if left else [t, block], dim=1)

    return Generation(
        prompt_ids=torch.cat([pad(g.prompt_ids, P, pad_token_id, True) for g in generations]),
        prompt_mask=torch.cat([pad(g.prompt_mask, P, 0, True) for g in generations]),
        completion_ids=torch.cat([pad(g.completion_ids, T, pad_token_id, False) for g in generations]),
        completion_mask=torch.cat([pad(g.completion_mask, T, 0, False) for g in generations]),
        prompts=[p for g in generations for p in g.prompts],
        completions=[c for g in generations for c in g.completions],
    )
