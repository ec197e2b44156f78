"""Tiny local models and tokenizers, built in about a second and saved to disk.

Tests and the offline demo load these folders *by path*, exactly as they would load a hub id::

    path = tiny_model("/tmp/tiny-qwen")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

Nothing here touches the network: tokenizers are trained on local text (by default
:func:`default_corpus`) and model weights are random, seeded for reproducibility.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

ARCHS = ("qwen2", "llama", "gpt2")
TOKENIZER_KINDS = ("bpe", "word")
CACHE_FILE = ".comarl-tiny.json"

BPE_EOS = "<|endoftext|>"
WORD_EOS = "</s>"
WORD_UNK = "<unk>"


def train_tokenizer(
    texts: Iterable[str], path: str | Path, *, kind: str = "bpe", vocab_size: int = 1024
) -> Path:
    """Train a tokenizer on ``texts`` and save it to ``path`` as a ``PreTrainedTokenizerFast``.

    ``kind="bpe"`` gives a GPT-2 style byte-level BPE (any text round-trips) with eos
    ``<|endoftext|>``. ``kind="word"`` gives a word-level tokenizer that splits on whitespace and
    punctuation, maps unseen words to ``<unk>`` and has eos ``</s>``; decoding joins words with
    single spaces. ``vocab_size`` is an upper bound: a small corpus may yield fewer tokens.

    The eos token is set; pad and bos are deliberately left unset, and so is the padding side.
    """
    if kind == "bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[BPE_EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        special = {"eos_token": BPE_EOS}
    elif kind == "word":
        tokenizer = Tokenizer(models.WordLevel(unk_token=WORD_UNK))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        # No decoder on purpose: without one, `tokenizers` joins the tokens with single spaces,
        # which is exactly the word-level round trip we want.
        trainer = trainers.WordLevelTrainer(
            vocab_size=vocab_size, special_tokens=[WORD_UNK, WORD_EOS], show_progress=False
        )
        special = {"eos_token": WORD_EOS, "unk_token": WORD_UNK}
    else:
        raise ValueError(f"kind must be one of {TOKENIZER_KINDS}, got {kind!r}")

    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False, **special)
    path = Path(path)
    fast.save_pretrained(path)
    return path


def build_tiny_model(
    path: str | Path,
    tokenizer_path: str | Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> Path:
    """Build a randomly initialised causal LM for the tokenizer at ``tokenizer_path``.

    The model (fp32 safetensors) and the tokenizer are both saved into ``path``, so ``path`` alone
    loads with ``AutoModelForCausalLM`` and ``AutoTokenizer``. ``arch`` is one of ``"qwen2"``,
    ``"llama"`` or ``"gpt2"`` (gpt2 ignores ``num_kv_heads``). Weights depend only on ``seed``;
    the global torch RNG is left as it was.

    transformers loads the tokenizer of every ``qwen2`` folder as ``Qwen2Tokenizer``: a byte-level BPE
    rebuilt from the saved vocabulary and merges with Qwen's normaliser and pre-tokenizer, and with pad set
    to ``<|endoftext|>``. A BPE tokenizer still round-trips (its ids may differ from the trained one's); a
    word-level one would be garbled, so ``arch="qwen2"`` takes BPE tokenizers only.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    _check_tokenizer_for_arch(arch, type(tokenizer.backend_tokenizer.model).__name__)
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": True,
    }
    config: PretrainedConfig
    if arch == "gpt2":
        config = GPT2Config(
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_inner=intermediate_size,
            n_positions=max_position_embeddings,
            **common,
        )
    else:
        config_class = Qwen2Config if arch == "qwen2" else LlamaConfig
        config = config_class(
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
            **common,
        )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)

    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_model(
    path: str | Path,
    *,
    texts: Iterable[str] | None = None,
    kind: str = "bpe",
    vocab_size: int = 1024,
    arch: str = "qwen2",
    seed: int = 0,
    **model_kwargs: int,
) -> Path:
    """Train a tokenizer and build a tiny model in ``path``, reusing it when already built.

    ``texts`` defaults to :func:`default_corpus`; ``model_kwargs`` go to :func:`build_tiny_model`.
    The arguments (with a hash of the texts) are recorded in ``path/.comarl-tiny.json``; a later
    call with the same arguments returns at once without rebuilding.
    """
    _check_tokenizer_for_arch(arch, "WordLevel" if kind == "word" else "BPE")
    texts = default_corpus() if texts is None else list(texts)
    record = {
        "texts_sha256": hashlib.sha256(json.dumps(texts).encode()).hexdigest(),
        "kind": kind,
        "vocab_size": vocab_size,
        "arch": arch,
        "seed": seed,
        "model_kwargs": model_kwargs,
    }
    path = Path(path)
    if _built(path, record):
        return path
    # Built beside the target and renamed into place: processes that build the same model at once (one per agent
    # under torchrun) never see a half-written folder, and all of them end with the same path.
    building = path.with_name(f".{path.name}.{os.getpid()}.building")
    shutil.rmtree(building, ignore_errors=True)
    train_tokenizer(texts, building, kind=kind, vocab_size=vocab_size)
    build_tiny_model(building, building, arch=arch, seed=seed, **model_kwargs)
    (building / CACHE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
    try:
        os.replace(building, path)
    except OSError:  # path is there: another process's identical build, or an older one to replace
        if _built(path, record):
            shutil.rmtree(building, ignore_errors=True)
            return path
        shutil.rmtree(path)
        os.replace(building, path)
    return path


def _check_tokenizer_for_arch(arch: str, tokenizer_model: str) -> None:
    """``arch="qwen2"`` needs a BPE tokenizer: transformers loads a qwen2 folder's tokenizer as
    ``Qwen2Tokenizer``, which turns a word-level vocabulary into garbled byte-level BPE (one token larger)."""
    if arch == "qwen2" and tokenizer_model != "BPE":
        raise ValueError(
            f"arch='qwen2' with a {tokenizer_model} tokenizer: transformers loads every qwen2 folder's tokenizer as "
            "Qwen2Tokenizer (byte-level BPE), which garbles a word-level vocabulary; use arch='llama' or 'gpt2' "
            "with kind='word'"
        )


def _built(path: Path, record: dict[str, Any]) -> bool:
    """Whether ``path`` holds a tiny model built with ``record``'s arguments."""
    marker = path / CACHE_FILE
    try:
        return (path / "config.json").exists() and json.loads(marker.read_text()) == record
    except (OSError, json.JSONDecodeError):  # no record, or a corrupt one: build again
        return False


# Word lists for default_corpus (compact on purpose).
# fmt: off
_AGENTS = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory",
    "niaj", "olivia", "peggy", "rupert", "sybil", "trent", "victor", "walter", "zoe"]
_VERBS = ["meets", "helps", "calls", "follows", "teaches", "thanks", "finds", "trusts", "answers", "joins",
    "visits", "guides", "warns", "greets", "invites", "watches", "asks", "paints", "builds", "chases"]
_PLACES = ["park", "library", "station", "market", "office", "harbour", "garden", "museum", "bakery",
    "bridge", "castle", "forest", "school"]
_CITIES = ["paris", "tokyo", "lima", "cairo", "oslo", "delhi", "sydney", "toronto", "nairobi", "berlin",
    "madrid", "seoul", "dublin", "quito", "vienna", "lagos", "hanoi", "prague", "bogota", "zurich"]
_COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver", "brown",
    "golden", "pink", "violet", "crimson", "teal", "grey"]
_ADJECTIVES = ["small", "large", "quiet", "noisy", "bright", "heavy", "light", "quick", "slow", "clever",
    "ancient", "modern", "shiny", "broken", "famous", "secret"]
_THINGS = ["ball", "book", "car", "kite", "lamp", "map", "cup", "box", "key", "coin", "robot", "bicycle",
    "guitar", "window", "letter", "camera", "garden", "ticket", "puzzle", "compass"]
_TOPICS = ["code", "tests", "plans", "games", "numbers", "stories", "maps", "rules", "music", "weather",
    "history", "rewards", "strategies", "messages", "puzzles", "recipes"]
# fmt: on

_FUNCS = [
    ("add", "a + b"),
    ("sub", "a - b"),
    ("mul", "a * b"),
    ("div", "a / b"),
    ("maximum", "max(a, b)"),
    ("minimum", "min(a, b)"),
    ("power", "a ** b"),
    ("mean", "(a + b) / 2"),
    ("modulo", "a % b"),
    ("combine", "[a, b]"),
    ("compare", "a == b"),
    ("either", "a or b"),
]


def _pick(words: list[str], i: int, k: int) -> str:
    """Deterministically pick a word: index ``i * k`` wrapped around the list."""
    return words[(i * k) % len(words)]


def default_corpus() -> list[str]:
    """Return a few hundred lines of deterministic English-ish and Python-like text.

    Generated in code (no files, no network); enough to train a 1024-token byte-level BPE.
    """
    lines: list[str] = []
    for i in range(360):
        agent, other = _pick(_AGENTS, i, 1), _pick(_AGENTS, i + 7, 3)
        verb, place = _pick(_VERBS, i, 7), _pick(_PLACES, i, 5)
        city, colour = _pick(_CITIES, i, 3), _pick(_COLOURS, i, 7)
        adjective, thing = _pick(_ADJECTIVES, i, 5), _pick(_THINGS, i, 9)
        topic, number = _pick(_TOPICS, i, 11), (i * 37) % 1000
        template = i % 8
        if template == 0:
            lines.append(f"{agent.title()} {verb} {other} at the {place} in {city.title()}.")
        elif template == 1:
            lines.append(f"The {adjective} {colour} {thing} belongs to {agent}, who lives in {city}.")
        elif template == 2:
            lines.append(f"{agent} and {other} talk about {topic} for {number} minutes.")
        elif template == 3:
            lines.append(f'"Can you pass the {colour} {thing}?" asks {agent}. "Yes," says {other}.')
        elif template == 4:
            lines.append(f"In {city.title()}, {number} agents share {topic} and reach a {colour} goal!")
        elif template == 5:
            lines.append(f"{agent} {verb} the team: {number} + {i % 10} = {number + i % 10}.")
        elif template == 6:
            lines.append(f"Every {adjective} agent in {city} {verb} a {thing} near the {place}.")
        else:
            lines.append(f"Why does {agent} keep the {adjective} {thing}? Because {other} likes {topic}.")
    for i in range(96):
        name, body = _FUNCS[i % len(_FUNCS)]
        a, b = i % 13, (i * 5) % 11
        lines.append(f"def {name}(a, b):")
        lines.append(f"    return {body}")
        lines.append(f"result_{i} = {name}({a}, {b})")
        if i % 4 == 0:
            thing = _pick(_THINGS, i, 3)
            lines.append(f"for {thing} in range({a + 1}):")
            lines.append(f"    print({thing}, {_pick(_COLOURS, i, 5)!r})")
        if i % 5 == 0:
            agent = _pick(_AGENTS, i, 3)
            lines.append(f"if {agent}_score > {b}:")
            lines.append(f"    winners.append({agent!r})")
        if i % 6 == 0:
            lines.append(f"{_pick(_CITIES, i, 7)} = {{'{_pick(_TOPICS, i, 5)}': {i}, 'done': {i % 2 == 0}}}")
    return lines
