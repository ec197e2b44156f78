import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from comarl.tiny import build_tiny_model, default_corpus, tiny_model, train_tokenizer

TEXT = "alice meets bob at the park ."


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    return train_tokenizer(default_corpus(), tmp_path_factory.mktemp("bpe"))


def test_default_corpus_is_deterministic_and_sizeable():
    corpus = default_corpus()
    assert corpus == default_corpus()
    assert len(corpus) >= 300
    assert "def add(a, b):" in corpus
    assert "    return a + b" in corpus


def test_bpe_tokenizer_round_trips(bpe_path):
    tokenizer = AutoTokenizer.from_pretrained(bpe_path)
    text = "def add(a, b):\n    return a + b  # unseen: Zürich ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer) == 1024  # the default corpus is rich enough to fill the vocabulary
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.eos_token_id is not None
    assert tokenizer.pad_token is None
    assert tokenizer.bos_token is None


def test_word_tokenizer_round_trips(tmp_path):
    path = train_tokenizer(default_corpus() + [TEXT], tmp_path, kind="word")
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.encode(TEXT)
    assert len(ids) == len(TEXT.split())
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode(tokenizer.encode("alice, bob!")) == "alice , bob !"
    assert tokenizer.decode(tokenizer.encode("alice xyzzy")) == "alice <unk>"
    assert tokenizer.eos_token == "</s>"
    assert tokenizer.pad_token is None


def test_word_tokenizer_respects_vocab_cap(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(
        train_tokenizer(default_corpus(), tmp_path, kind="word", vocab_size=50)
    )
    assert len(tokenizer) == 50


def test_unknown_tokenizer_kind(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        train_tokenizer(["hello"], tmp_path, kind="sentencepiece")


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gpt2"])
def test_each_arch_loads_by_path_and_runs(arch, bpe_path, tmp_path):
    path = build_tiny_model(tmp_path / arch, bpe_path, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id is None
    assert (path / "model.safetensors").exists()

    inputs = tokenizer(TEXT, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(tokenizer))


def test_build_is_seeded(bpe_path, tmp_path):
    def weights(path):
        return AutoModelForCausalLM.from_pretrained(path).get_input_embeddings().weight

    a = build_tiny_model(tmp_path / "a", bpe_path, seed=1)
    b = build_tiny_model(tmp_path / "b", bpe_path, seed=1)
    c = build_tiny_model(tmp_path / "c", bpe_path, seed=2)
    assert torch.equal(weights(a), weights(b))
    assert not torch.equal(weights(a), weights(c))


def test_bad_arch(bpe_path, tmp_path):
    with pytest.raises(ValueError, match="arch") as info:
        build_tiny_model(tmp_path, bpe_path, arch="mamba")
    assert "qwen2" in str(info.value)


def test_tiny_model_caches(tmp_path):
    path = tiny_model(tmp_path / "m", kind="word", hidden_size=32)
    weights_file = path / "model.safetensors"
    first = weights_file.stat().st_mtime_ns
    record = json.loads((path / ".comarl-tiny.json").read_text())
    assert record["kind"] == "word"
    assert record["model_kwargs"] == {"hidden_size": 32}

    assert tiny_model(tmp_path / "m", kind="word", hidden_size=32) == path
    assert weights_file.stat().st_mtime_ns == first

    before = AutoModelForCausalLM.from_pretrained(path).get_input_embeddings().weight
    tiny_model(tmp_path / "m", kind="word", hidden_size=32, seed=1)
    after = AutoModelForCausalLM.from_pretrained(path).get_input_embeddings().weight
    assert json.loads((path / ".comarl-tiny.json").read_text())["seed"] == 1
    assert not torch.equal(before, after)
