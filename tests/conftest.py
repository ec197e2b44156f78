"""Shared fixtures: tiny local models, built once per session and loaded by path like hub ids."""

from __future__ import annotations

import os

# No test may reach the network (DESIGN): hub and dataset loads that are not local fail at once, not after a timeout.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from comarl.tiny import tiny_model

# Tiny models are faster single-threaded, and the tests then behave the same on any machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def qwen_bpe(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Qwen2 model with a byte-level BPE tokenizer (vocab 1024); it loads as Qwen2Tokenizer, pad = eos."""
    return str(tiny_model(tmp_path_factory.mktemp("models") / "qwen2-bpe", kind="bpe", arch="qwen2", seed=0))


@pytest.fixture(scope="session")
def llama_word(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Llama model with a word-level tokenizer: a different family and a different tokenizer."""
    return str(
        tiny_model(tmp_path_factory.mktemp("models") / "llama-word", kind="word", arch="llama", seed=1)
    )
