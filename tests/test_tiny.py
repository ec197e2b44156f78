import json
import re
from pathlib import Path

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


def test_a_qwen2_folder_loads_its_bpe_tokenizer_as_qwen2tokenizer(bpe_path, tmp_path):
    """transformers' rule for every qwen2 folder: Qwen2Tokenizer, pad = eos; text still round-trips."""
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path, bpe_path, arch="qwen2"))
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert len(tokenizer) == 1024 and tokenizer.pad_token == tokenizer.eos_token == "<|endoftext|>"
    text = "def add_12(a, b):\n    return a + b  # Zürich 2024"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_qwen2_refuses_a_word_level_tokenizer(tmp_path):
    """Loaded as Qwen2Tokenizer, a word-level vocabulary came back garbled ("alice meets bob" -> "abb") and one
    token larger than the model, which Agent then refused."""
    message = (
        "arch='qwen2' with a WordLevel tokenizer: transformers loads every qwen2 folder's tokenizer as "
        "Qwen2Tokenizer (byte-level BPE), which garbles a word-level vocabulary; use arch='llama' or 'gpt2' "
        "with kind='word'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        tiny_model(tmp_path / "m", kind="word")  # qwen2 is the default arch
    word = train_tokenizer(default_corpus(), tmp_path / "word", kind="word")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build_tiny_model(tmp_path / "q", word, arch="qwen2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["word"]  # nothing built


def test_tiny_model_caches(tmp_path):
    path = tiny_model(tmp_path / "m", kind="word", arch="llama", hidden_size=32)
    weights_file = path / "model.safetensors"
    first = weights_file.stat().st_mtime_ns
    record = json.loads((path / ".comarl-tiny.json").read_text())
    assert record["kind"] == "word"
    assert record["model_kwargs"] == {"hidden_size": 32}

    assert tiny_model(tmp_path / "m", kind="word", arch="llama", hidden_size=32) == path
    assert weights_file.stat().st_mtime_ns == first

    before = AutoModelForCausalLM.from_pretrained(path).get_input_embeddings().weight
    tiny_model(tmp_path / "m", kind="word", arch="llama", hidden_size=32, seed=1)
    after = AutoModelForCausalLM.from_pretrained(path).get_input_embeddings().weight
    assert json.loads((path / ".comarl-tiny.json").read_text())["seed"] == 1
    assert not torch.equal(before, after)


def test_default_corpus_lines_by_hand():
    """360 sentences from eight templates, then 96 small functions with loops, ifs and dicts (752 lines)."""
    corpus = default_corpus()
    assert len(corpus) == 360 + 96 * 3 + 24 * 2 + 20 * 2 + 16
    assert corpus[:2] == [
        "Alice meets bob at the park in Paris.",  # i=0: every word list's first
        "The heavy white coin belongs to bob, who lives in cairo.",  # i=1: index 1 * k of each list
    ]
    assert corpus[360:369] == [
        "def add(a, b):",
        "    return a + b",
        "result_0 = add(0, 0)",
        "for ball in range(1):",
        "    print(ball, 'red')",
        "if alice_score > 0:",
        "    winners.append('alice')",
        "paris = {'code': 0, 'done': True}",
        "def sub(a, b):",
    ]


def test_bpe_vocab_size_and_gpt2_offsets(tmp_path, bpe_path):
    small = AutoTokenizer.from_pretrained(train_tokenizer(default_corpus(), tmp_path, vocab_size=300))
    assert len(small) == 300
    # Like GPT-2's tokenizer: a word's leading space belongs to its token, offsets included (trim_offsets=False)
    encoded = AutoTokenizer.from_pretrained(bpe_path)("alice bob", return_offsets_mapping=True)
    assert encoded.tokens() == ["alice", "Ġbob"]
    assert encoded["offset_mapping"] == [(0, 5), (5, 9)]


@pytest.mark.parametrize(
    ("arch", "mlp"), [("qwen2", "mlp.up_proj"), ("llama", "mlp.up_proj"), ("gpt2", "mlp.c_fc")]
)
def test_build_sizes_and_tied_head(arch, mlp, bpe_path, tmp_path):
    """The defaults: hidden 64, 2 layers, 4 heads (head size 16), 2 key/value heads (2 x 16 = 32 rows of k_proj),
    MLP 128, 256 positions; the LM head is the input embedding (tied)."""
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path, bpe_path, arch=arch))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_input_embeddings().weight.shape == (1024, 64)
    layers = model.transformer.h if arch == "gpt2" else model.model.layers
    assert len(layers) == 2
    assert sorted(layers[0].get_submodule(mlp).weight.shape) == [64, 128]
    if arch == "gpt2":
        assert model.config.n_positions == 256
    else:
        assert layers[0].self_attn.k_proj.weight.shape == (32, 64)
        assert model.config.max_position_embeddings == 256


def test_build_leaves_the_global_rng_and_saves_fp32(bpe_path, tmp_path):
    """Weights depend only on the seed; torch's global stream is left as it was; fp32 whatever the default dtype."""
    from safetensors.torch import load_file

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        path = build_tiny_model(tmp_path, bpe_path, hidden_size=32)
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(torch.rand(3), expected)
    assert {t.dtype for t in load_file(path / "model.safetensors").values()} == {torch.float32}


def test_tiny_model_default_vocabulary(qwen_bpe):
    assert len(AutoTokenizer.from_pretrained(qwen_bpe)) == 1024
    assert json.loads((Path(qwen_bpe) / ".comarl-tiny.json").read_text())["vocab_size"] == 1024


def test_tiny_model_rebuilds_when_the_texts_vocab_size_or_arch_change(tmp_path):
    texts = ["alice meets bob", "bob meets carol"]
    kwargs = {"kind": "word", "arch": "llama", "hidden_size": 32}
    path = tiny_model(tmp_path / "m", texts=(t for t in texts), **kwargs)  # a generator is read once
    vocabulary = set(AutoTokenizer.from_pretrained(path).get_vocab())
    assert vocabulary == {"<unk>", "</s>", "alice", "bob", "carol", "meets"}
    tiny_model(tmp_path / "m", texts=[*texts, "dave meets erin"], **kwargs)
    assert "dave" in AutoTokenizer.from_pretrained(path).get_vocab()
    tiny_model(tmp_path / "m", texts=[*texts, "dave meets erin"], vocab_size=4, **kwargs)
    assert len(AutoTokenizer.from_pretrained(path)) == 4
    tiny_model(tmp_path / "m", texts=[*texts, "dave meets erin"], vocab_size=4, **{**kwargs, "arch": "gpt2"})
    assert json.loads((path / "config.json").read_text())["model_type"] == "gpt2"


def test_tiny_model_rebuilds_a_folder_with_a_missing_model_or_a_corrupt_record(tmp_path):
    path = tiny_model(tmp_path / "m", kind="word", arch="llama", hidden_size=32)
    (path / "config.json").unlink()  # the model was deleted, its record kept
    assert tiny_model(tmp_path / "m", kind="word", arch="llama", hidden_size=32) == path
    assert AutoModelForCausalLM.from_pretrained(path).config.hidden_size == 32
    (path / ".comarl-tiny.json").write_text('{"kind": "wo')  # cut short
    tiny_model(tmp_path / "m", kind="word", arch="llama", hidden_size=32)
    assert json.loads((path / ".comarl-tiny.json").read_text())["kind"] == "word"


def test_tiny_model_builds_beside_the_target_and_leaves_nothing_behind(tmp_path, monkeypatch):
    import os

    from comarl import tiny

    # a build of this process that died earlier left its folder: it is not carried into the new model
    stale = tmp_path / f".m.{os.getpid()}.building"
    stale.mkdir()
    (stale / "stale.bin").write_text("old")
    path = tiny_model(tmp_path / "m", kind="word", arch="llama", hidden_size=32)
    assert not (path / "stale.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    # Another process finished the same build while this one built: its folder stays, this build is dropped.
    inode, built, looks = path.stat().st_ino, tiny._built, []

    def built_after_the_first_look(folder, record):
        looks.append(folder)
        return len(looks) > 1 and built(folder, record)

    monkeypatch.setattr(tiny, "_built", built_after_the_first_look)
    assert tiny_model(tmp_path / "m", kind="word", arch="llama", hidden_size=32) == path
    assert path.stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_tiny_model_with_the_same_arguments_builds_nothing(tmp_path, monkeypatch):
    from comarl import tiny

    path = tiny_model(tmp_path / "m", kind="word", arch="llama", hidden_size=32)
    monkeypatch.setattr(tiny, "train_tokenizer", lambda *args, **kwargs: pytest.fail("built again"))
    assert tiny_model(tmp_path / "m", kind="word", arch="llama", hidden_size=32) == path
