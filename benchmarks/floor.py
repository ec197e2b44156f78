"""The floor: a hand-written minimal torch loop doing the same generate + batched update as comarl.

Per step and per agent, the same algorithm as comarl's trainer, written out with nothing around it:

- generate: each of the step's prompts prefilled once (left padding), its KV cache repeated G times,
  then one decode step per new token over all rows (comarl's ``LlamaDecoder``, the step comarl's engine
  takes for this Qwen2 model; ``--plain-decoding``: the model's own forward), EOS masked
  (``min_new_tokens = max_new_tokens``), each token drawn by inverse CDF (cheaper than ``torch.multinomial``);
- the shared reward and group-normalised advantages;
- malloc keeps freed memory for the next step's tensors (``comarl.memory.keep_freed_memory``, as comarl's
  trainer does on the CPU; ``--glibc-malloc``: glibc's defaults);
- update: each prompt (all but its last token) once and its G rows (last prompt token + completion) in one
  pass of comarl's training forward (``llama_decoder.shared_prompt_logits``, what comarl's agent runs for this
  model on the CPU); token log-probs, a token-mean policy-gradient loss, gradient clipping at 1.0 and a fused AdamW step
  (weight decay 0).

No logging, no checks, no environment protocol, no micro-batches: what is left is the work itself.
"""

from __future__ import annotations

import time

from common import (
    LEARNING_RATE,
    NEW_TOKENS,
    NUM_GENERATIONS,
    PROMPTS_PER_STEP,
    TEMPERATURE,
    Clock,
    load_prompts,
    model_path,
    report,
    runner_args,
    set_threads,
    team_reward,
)


def _cache_argument(model) -> str:  # noqa: ANN001
    """transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns until 5.40)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def generate(model, prompt_ids, prompt_mask, eos_token_id, plain, G=NUM_GENERATIONS, T=NEW_TOKENS):  # noqa: ANN001, ANN201
    """Completion ids [B * G, T], row b * G + j = sample j of prompt b."""
    import torch
    from transformers import DynamicCache

    from comarl.llama_decoder import LlamaDecoder

    with torch.no_grad():  # sampling needs no graph
        cache_argument = _cache_argument(model)
        positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
        if plain:
            cache = DynamicCache(config=model.config)
            logits = model(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                position_ids=positions,
                **{cache_argument: cache},
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            cache.batch_repeat_interleave(G)
        else:
            decoder = LlamaDecoder(model, prompt_mask, G, T)
            logits = decoder.prefill(prompt_ids)
        logits = logits.repeat_interleave(G, dim=0)
        rows, P = logits.shape[0], prompt_ids.shape[1]
        attention = torch.cat([prompt_mask.repeat_interleave(G, dim=0), prompt_mask.new_ones(rows, T)], dim=1)
        next_position = positions[:, -1:].repeat_interleave(G, dim=0) + 1
        tokens = torch.empty(rows, T, dtype=torch.long, device=prompt_ids.device)
        for t in range(T):
            logits[:, eos_token_id] = float("-inf")  # min_new_tokens = max_new_tokens
            cdf = torch.softmax(logits / TEMPERATURE, dim=-1).cumsum(dim=-1)
            u = (1 - torch.rand(rows, 1, device=cdf.device)) * cdf[:, -1:]
            tokens[:, t] = torch.searchsorted(cdf, u).squeeze(1)
            if t + 1 == T:
                break
            if not plain:
                logits = decoder.next_logits(tokens[:, t])
            else:
                logits = model(
                    input_ids=tokens[:, t : t + 1],
                    attention_mask=attention[:, : P + t + 1],
                    position_ids=next_position + t,
                    **{cache_argument: cache},
                    use_cache=True,
                ).logits[:, -1]
        return tokens


def completion_logprobs(model, prompt_ids, prompt_mask, ids, G=NUM_GENERATIONS):  # noqa: ANN001, ANN201
    """Log-probs [B * G, T] of the completions: each prompt (but its last token) once and its G rows in one pass."""
    import torch

    from comarl.llama_decoder import shared_prompt_logits

    rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device).repeat_interleave(G)
    logits = shared_prompt_logits(model, prompt_ids, prompt_mask, ids, rows).view(*ids.shape, -1)
    return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def main() -> None:
    args = runner_args(__doc__)
    if args.bf16:
        raise SystemExit(
            "floor.py: --bf16 is for comarl and TRL only; this runner measures the fp32 workload"
        )
    set_threads(args.threads)
    started = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comarl.memory import keep_freed_memory

    if args.device == "cpu" and not args.glibc_malloc:
        keep_freed_memory()  # malloc set as comarl's trainer sets it: the overhead measured is the code's

    prompts = [item["prompt"] for item in load_prompts(args.workload, args.prompts)]
    per_step = min(PROMPTS_PER_STEP[args.mode], len(prompts))
    G = NUM_GENERATIONS
    tokenizer = AutoTokenizer.from_pretrained(model_path(args.workload), padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    models = [
        AutoModelForCausalLM.from_pretrained(model_path(args.workload)).to(args.device)
        for _ in range(args.agents)
    ]
    optimizers = [
        torch.optim.AdamW(m.parameters(), lr=LEARNING_RATE, weight_decay=0.0, fused=True) for m in models
    ]

    clock = Clock()
    setup_seconds = time.perf_counter() - started
    with clock:
        for start in range(0, len(prompts) - per_step + 1, per_step):
            enc = tokenizer(prompts[start : start + per_step], return_tensors="pt", padding=True).to(
                args.device
            )
            completions, texts = [], []
            for model in models:
                model.eval()
                ids = generate(
                    model,
                    enc["input_ids"],
                    enc["attention_mask"],
                    tokenizer.eos_token_id,
                    args.plain_decoding,
                )
                completions.append(ids)
                texts.append(tokenizer.batch_decode(ids, skip_special_tokens=True))
                clock.completions += ids.shape[0]
                clock.tokens += ids.numel()  # min_new_tokens = max_new_tokens: no EOS, no padding
            rewards = torch.tensor(team_reward(*texts), device=args.device).view(-1, G)
            advantages = (
                (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
            ).view(-1, 1)
            for model, optimizer, ids in zip(models, optimizers, completions):
                model.train()
                logp = completion_logprobs(model, enc["input_ids"], enc["attention_mask"], ids)
                loss = -(logp * advantages).mean()  # every completion has T tokens: the token mean
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    report(
        "floor",
        args,
        clock,
        setup_seconds,
        expected_completions=len(prompts) // per_step * per_step * G * args.agents,
    )


if __name__ == "__main__":
    main()
