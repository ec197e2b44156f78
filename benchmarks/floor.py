"""The floor: a hand-written minimal torch loop doing the same generate + batched update as the trainers.

Per step and per agent: one batched ``model.generate`` over the step's prompts x G (left padding,
KV cache), the shared reward, group-normalised advantages, one batched forward over
prompt+completion, token log-probs, a token-mean policy-gradient loss, and one AdamW step.
No logging, no checks, no environment protocol: what is left is the work itself.
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


def main() -> None:
    args = runner_args(__doc__)
    if args.bf16:
        raise SystemExit(
            "floor.py: --bf16 is for comarl and TRL only; this runner measures the fp32 workload"
        )
    set_threads(args.threads)
    started = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    prompts = [item["prompt"] for item in load_prompts(args.workload, args.prompts)]
    per_step = min(PROMPTS_PER_STEP[args.mode], len(prompts))
    G = NUM_GENERATIONS
    tokenizer = AutoTokenizer.from_pretrained(model_path(args.workload), padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    models = [
        AutoModelForCausalLM.from_pretrained(model_path(args.workload)).to(args.device)
        for _ in range(args.agents)
    ]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LEARNING_RATE) for m in models]
    generation_config = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=True,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    clock = Clock()
    setup_seconds = time.perf_counter() - started
    with clock:
        for start in range(0, len(prompts) - per_step + 1, per_step):
            enc = tokenizer(prompts[start : start + per_step], return_tensors="pt", padding=True).to(
                args.device
            )
            prompt_ids = enc["input_ids"].repeat_interleave(G, dim=0)
            prompt_mask = enc["attention_mask"].repeat_interleave(G, dim=0)
            completions, texts = [], []
            for model in models:
                model.eval()
                with torch.no_grad():
                    out = model.generate(
                        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config
                    )
                ids = out[:, prompt_ids.shape[1] :]
                completions.append(ids)
                texts.append(tokenizer.batch_decode(ids, skip_special_tokens=True))
                clock.completions += ids.shape[0]
                clock.tokens += ids.numel()  # min_new_tokens = max_new_tokens: no EOS, no padding
            rewards = torch.tensor(team_reward(*texts), device=args.device).view(-1, G)
            advantages = (
                (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
            ).view(-1)
            for model, optimizer, ids in zip(models, optimizers, completions):
                model.train()
                input_ids = torch.cat([prompt_ids, ids], dim=1)
                attention_mask = torch.cat([prompt_mask, torch.ones_like(ids)], dim=1)
                position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
                T = ids.shape[1]
                logits = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    logits_to_keep=T + 1,
                ).logits[:, :-1]
                logp = (
                    torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
                )
                loss = -(logp * advantages.unsqueeze(1)).mean()
                loss.backward()
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
