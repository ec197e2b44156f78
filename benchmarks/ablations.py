"""Measure each optimisation of comarl's hot paths on its own, on the benchmark workload.

For one epoch's prompts (in steps of 1 or 8 prompts, G = 4 samples each, 32 new tokens) it times:

- generation: ``model.generate`` as comarl called it before (one GenerationConfig per call, every
  prompt repeated G times), comarl's own decode loop on the repeated prompts, the decode loop with
  the prompt run once per group (drawing with torch.multinomial), with the inverse-CDF draw, and with
  comarl's own decode step (``LlamaDecoder``) instead of the model's forward, with that step's weights
  packed for oneDNN once per generate call always, and only where ``packing_pays`` times it faster (the engine
  now: whether oneDNN's packing pays depends on the machine's state, docs/benchmarks.md), and, as a candidate,
  packed for MKL's packed GEMM instead;
- the training forward + backward of the log-probs: the model's forward over prompt+completion per row, the
  model's forward with the prompt once per group (its KV cache gathered to the rows), and comarl's own forward
  (``llama_decoder.shared_prompt_logits``: the prompts once and the rows in one pass; the agent now).

Variants run interleaved, ``--repeats`` times; the table gives the median CPU seconds per epoch
(CPU time is steadier than wall time on a shared machine) and the speed-up over the first variant::

    python benchmarks/ablations.py --repeats 3     # builds benchmarks/.workload first if it is missing
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from common import NEW_TOKENS, NUM_GENERATIONS, load_prompts, model_path
from workload import build_workload


def timed(fn: Callable[[], object]) -> float:
    """CPU seconds of one call."""
    started = time.process_time()
    fn()
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", default=str(Path(__file__).parent / ".workload"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    build_workload(args.workload)  # the benchmark's model and prompts (reused when already built)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    from transformers import GenerationConfig

    import comarl.agents
    import comarl.engines
    import comarl.llama_decoder
    from comarl.agents import Agent
    from comarl.engines import HFEngine, SamplingParams, sample_completions

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    agent = Agent.from_pretrained(model_path(args.workload))
    texts = [item["prompt"] for item in load_prompts(args.workload, args.prompts)]
    G, params = NUM_GENERATIONS, SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    engine, model, pad = HFEngine(), agent.model, agent.tokenizer.pad_token_id

    def hf_generate(ids: torch.Tensor, mask: torch.Tensor) -> None:
        config = GenerationConfig(
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            num_beams=1,
            eos_token_id=agent.eos_token_ids,
            pad_token_id=pad,
            use_cache=True,
        )
        model.generate(
            input_ids=ids.repeat_interleave(G, 0),
            attention_mask=mask.repeat_interleave(G, 0),
            generation_config=config,
        )

    def own_loop_repeated(ids: torch.Tensor, mask: torch.Tensor) -> None:
        rows = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
        sample_completions(model, *rows, 1, params, agent.eos_token_ids, pad, fast_decoding=False)

    def own_loop_shared(ids: torch.Tensor, mask: torch.Tensor, fast: bool = False) -> None:
        sample_completions(model, ids, mask, G, params, agent.eos_token_ids, pad, fast_decoding=fast)

    def decoding_packed(packs: bool | None) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """The decode step with its weights never packed (False), always (True), or as packing_pays decides from
        the trial of the first call (None: the engine now)."""

        def run(ids: torch.Tensor, mask: torch.Tensor) -> None:
            timed_choice = comarl.llama_decoder.packing_pays
            if packs is not None:
                comarl.llama_decoder.packing_pays = lambda model, rows, steps: packs
            try:
                own_loop_shared(ids, mask, fast=True)
            finally:
                comarl.llama_decoder.packing_pays = timed_choice

        return run

    def own_loop_shared_llama_decoder_mkl_packed(ids: torch.Tensor, mask: torch.Tensor) -> None:
        """A candidate: MKL's packed GEMM (cblas_sgemm_pack, inductor's choice for fp32 CPU linears) instead of
        oneDNN's packed product; each weight packed at its first product of the call, for that call's rows."""
        packing, product = comarl.llama_decoder.packed_weights, comarl.llama_decoder.packed_linear
        timed_choice = comarl.llama_decoder.packing_pays

        def mkl_product(layer: torch.nn.Linear, holder: list, x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // x.shape[-1]
            if not holder:
                holder.append(torch.ops.mkl._mkl_reorder_linear_weight(layer.weight, rows))
            return torch.ops.mkl._mkl_linear(x, holder[0], layer.weight, layer.bias, rows)

        comarl.llama_decoder.packed_weights = lambda model: {
            layer: [] for layer in comarl.llama_decoder.packable_layers(model)
        }
        comarl.llama_decoder.packed_linear = mkl_product
        comarl.llama_decoder.packing_pays = lambda model, rows, steps: True
        try:
            own_loop_shared(ids, mask, fast=True)
        finally:
            comarl.llama_decoder.packed_weights, comarl.llama_decoder.packed_linear = packing, product
            comarl.llama_decoder.packing_pays = timed_choice

    def multinomial_draw(
        logits: torch.Tensor,
        params: SamplingParams,
        eos: torch.Tensor,
        suppress_eos: bool = False,
        generator: torch.Generator | None = None,
        draw: torch.Tensor | None = None,  # the inverse-CDF draw's uniforms: multinomial draws its own
    ) -> torch.Tensor:
        scores = comarl.engines.sampling_scores(logits, params, eos, suppress_eos)
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1, generator=generator).squeeze(1)

    def own_loop_shared_multinomial(ids: torch.Tensor, mask: torch.Tensor) -> None:
        inverse_cdf = comarl.engines.next_tokens
        comarl.engines.next_tokens = multinomial_draw  # the draw sample_completions used at first
        try:
            own_loop_shared(ids, mask)
        finally:
            comarl.engines.next_tokens = inverse_cdf

    def update(shared: bool, own: bool) -> Callable[[object], None]:
        def run(gen: object) -> None:
            sharing, support = comarl.agents._shared_prompts, comarl.agents.unsupported_reason
            if not shared:  # the forward comarl did first: the prompt once per row
                comarl.agents._shared_prompts = lambda *a: None
            if not own:  # the model's forward (the distinct prompts' KV cache gathered to the rows)
                comarl.agents.unsupported_reason = lambda model: "the model's forward"
            try:
                logp = agent.completion_logprobs(
                    gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask
                )
                (logp * gen.completion_mask).sum().backward()
                model.zero_grad(set_to_none=True)
            finally:
                comarl.agents._shared_prompts, comarl.agents.unsupported_reason = sharing, support

        return run

    for per_step in (1, 8):
        steps = [texts[s : s + per_step] for s in range(0, len(texts) - per_step + 1, per_step)]
        encoded = [agent.encode(step) for step in steps]
        with torch.no_grad():
            model.eval()
            generations = [engine.generate(agent, step, G, params) for step in steps]
        model.train()
        generate_without_grad = {
            "generate: model.generate, prompts repeated G times": torch.no_grad()(hf_generate),
            "generate: own decode loop, prompts repeated": torch.no_grad()(own_loop_repeated),
            "generate: + prompt once per group (torch.multinomial)": torch.no_grad()(
                own_loop_shared_multinomial
            ),
            "generate: + inverse-CDF draw": torch.no_grad()(own_loop_shared),
            "generate: + LlamaDecoder instead of the model's forward": torch.no_grad()(
                decoding_packed(False)
            ),
            "generate: + its weights packed for oneDNN, always": torch.no_grad()(decoding_packed(True)),
            "generate: + packing decided by a trial (the engine now)": torch.no_grad()(decoding_packed(None)),
            "generate: + MKL's packed GEMM instead (a candidate)": torch.no_grad()(
                own_loop_shared_llama_decoder_mkl_packed
            ),
        }
        variants: dict[str, Callable[[], object]] = {
            name: functools.partial(lambda fn, batches: [fn(*b) for b in batches], fn, encoded)
            for name, fn in generate_without_grad.items()
        }
        for name, shared, own in (
            ("prompt per row", False, False),
            ("prompt once per group", True, False),
            ("+ comarl's own forward (the trainer now)", True, True),
        ):
            variants[f"log-prob forward+backward: {name}"] = functools.partial(
                lambda fn, gens: [fn(g) for g in gens], update(shared, own), generations
            )
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, fn in variants.items():
                model.eval() if name.startswith("generate") else model.train()
                seconds[name].append(timed(fn))
        print(
            f"\n{per_step} prompt(s) per step x G={G}, {len(steps)} steps (one epoch), CPU seconds (median):"
        )
        baseline, width = {}, max(map(len, seconds))
        for name, values in seconds.items():
            kind = name.split(":")[0]
            median = statistics.median(values)
            baseline.setdefault(kind, median)
            print(f"  {name:<{width}} {median:7.2f} s   x{baseline[kind] / median:4.2f}")
    records = [
        f"{rows} rows {trial.plain * 1e3:.2f} / {trial.packed * 1e3:.2f} ms per step, "
        f"packing {trial.packing * 1e3:.1f} ms"
        for (_, rows), trial in comarl.llama_decoder.PACKING_TRIALS.items()
    ]
    print("\nThe packing trial's record (plain / packed): " + "; ".join(records))


if __name__ == "__main__":
    main()
