"""Generation backends. ``HFEngine``: one batched ``generate`` per agent per call, KV cache on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from comarl.agents import Agent, Prompt
from comarl.algorithms import completion_mask


@dataclass
class SamplingParams:
    """How completions are drawn. ``do_sample=False`` is greedy decoding."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    do_sample: bool = True


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


class HFEngine:
    """Batched sampling with ``transformers``' ``generate``: every prompt x G samples in one call."""

    @torch.no_grad()
    def generate(
        self, agent: Agent, prompts: Sequence[Prompt], num_generations: int, params: SamplingParams
    ) -> Generation:
        from transformers import GenerationConfig

        prompt_ids, prompt_mask = agent.encode(prompts)
        prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)
        tok = agent.tokenizer
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_new_tokens,
            do_sample=params.do_sample,
            # Explicit values: a model's own generation_config (e.g. top_k=50) must not silently
            # truncate the distribution the loss assumes.
            temperature=params.temperature if params.do_sample else None,
            top_p=params.top_p if params.do_sample else None,
            top_k=(params.top_k or 0) if params.do_sample else None,
            num_beams=1,
            eos_token_id=agent.eos_token_ids,
            pad_token_id=tok.pad_token_id,
            use_cache=True,
        )
        was_training = agent.model.training
        agent.model.eval()
        try:
            out = agent.model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config
            )
        finally:
            agent.model.train(was_training)
        completion_ids = out[:, prompt_ids.shape[1] :]
        mask = completion_mask(completion_ids, agent.eos_token_ids)
        # Padding after EOS becomes the pad id so decoding and logs never show stray tokens.
        completion_ids = torch.where(
            mask.bool(), completion_ids, torch.full_like(completion_ids, tok.pad_token_id)
        )
        lengths = mask.sum(dim=1).tolist()
        rows = completion_ids.tolist()
        texts = tok.batch_decode([row[:n] for row, n in zip(rows, lengths)], skip_special_tokens=True)
        repeated = [p for p in prompts for _ in range(num_generations)]
        return Generation(prompt_ids, prompt_mask, completion_ids, mask, repeated, texts)


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
