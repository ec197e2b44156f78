"""Build the benchmark workload once, offline: a tiny Qwen2 model, its tokenizer and 32 prompts.

The folder holds ``model/`` (Qwen2: hidden 256, 4 layers, 4 heads / 2 KV heads, MLP 1024, a
byte-level BPE tokenizer with a 1024-token vocabulary trained on ``comarl.tiny.default_corpus``)
and ``prompts.json`` (32 prompts of 32-72 tokens). Every runner loads both by path.
"""

from __future__ import annotations

import json
from pathlib import Path

NUM_PROMPTS = 32
MIN_PROMPT_TOKENS = 32
MAX_PROMPT_TOKENS = 72
MODEL_SPEC = {
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 1024,
    "max_position_embeddings": 256,
}


def prompt_lengths(count: int = NUM_PROMPTS) -> list[int]:
    """Target token counts spread evenly over [32, 72]: ``32 + round(40 * i / (count - 1))``."""
    span = MAX_PROMPT_TOKENS - MIN_PROMPT_TOKENS
    return [MIN_PROMPT_TOKENS + round(span * i / max(count - 1, 1)) for i in range(count)]


def build_workload(folder: str | Path) -> Path:
    """Write ``folder/model`` and ``folder/prompts.json`` (reused when already built with this spec)."""
    from transformers import AutoTokenizer

    from comarl.tiny import default_corpus, tiny_model

    folder = Path(folder)
    model_dir = tiny_model(folder / "model", kind="bpe", vocab_size=1024, arch="qwen2", seed=0, **MODEL_SPEC)
    prompts_file = folder / "prompts.json"
    if prompts_file.exists() and json.loads(prompts_file.read_text()).get("spec") == MODEL_SPEC:
        return folder
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    corpus = default_corpus()
    items, lengths = [], []
    for i, target in enumerate(prompt_lengths()):
        # Consecutive corpus lines from a different start for every prompt, cut to the target length.
        text, line = "", i * 11
        while len(tokenizer(text)["input_ids"]) < target + 8:
            text += corpus[line % len(corpus)] + "\n"
            line += 1
        ids = tokenizer(text)["input_ids"][:target]
        prompt = tokenizer.decode(ids)
        items.append({"prompt": prompt})
        lengths.append(len(tokenizer(prompt)["input_ids"]))
    if min(lengths) < MIN_PROMPT_TOKENS - 2 or max(lengths) > MAX_PROMPT_TOKENS + 2:
        raise RuntimeError(
            f"build_workload: prompt lengths {min(lengths)}..{max(lengths)} left the 32-72 range"
        )
    prompts_file.write_text(
        json.dumps({"spec": MODEL_SPEC, "token_lengths": lengths, "items": items}, indent=1)
    )
    return folder


if __name__ == "__main__":
    import sys

    print(build_workload(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / ".workload"))
