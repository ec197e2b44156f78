"""Critics for the actor-critic family: a value head on an agent's own model, or a separate critic model.

Values are turn-level: one value per observation (the state an agent answers from), read from a
single hidden state — the last prompt token — of the model's backbone, taken on the way through the
model's own forward (so the model's hooks run: LoRA, FSDP2's gathering of sharded weights), without a list
of every layer's hidden states; a value alone computes the LM logits of one position only.

- ``ValueHead``: ``Linear(hidden, outputs)`` on an agent's backbone; the agent's policy forward then
  yields log-probs and the value in one pass (``policy_forward``).
- ``CriticModel``: its own backbone, tokenizer and head. It reads text, so a centralized critic can
  see every agent's observation (and, for Q, the joint answer) rendered by ``joint_observation``,
  whatever the agents' tokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comarl.algorithms import completion_lengths, to_width, token_entropy, token_logprobs
from comarl.config import VALUE_HEAD_FILE


class ValueHead(nn.Module):
    """``V(h) = W h + b`` with ``outputs`` values per state; starts at 0 so early advantages are the returns."""

    def __init__(self, hidden_size: int, outputs: int = 1) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, outputs)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # fp32 also under bf16 autocast, which would run the Linear in bf16 (a step of 1/32 for values in [4, 8))
        with torch.autocast(hidden.device.type, enabled=False):
            return self.linear(hidden.float())

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(
            {"state_dict": self.state_dict(), "outputs": self.linear.out_features},
            Path(directory) / VALUE_HEAD_FILE,
        )

    @classmethod
    def load_or_new(cls, directory: str | Path | None, hidden_size: int, outputs: int) -> ValueHead:
        """The head saved in ``directory`` when there is one (with matching shape), else a new zero head."""
        head = cls(hidden_size, outputs)
        path = None if directory is None else Path(directory) / VALUE_HEAD_FILE
        if path is not None and path.is_file():
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if saved["outputs"] != outputs:
                raise ValueError(
                    f"{path}: the saved value head has {saved['outputs']} outputs but this critic needs {outputs}"
                )
            head.load_state_dict(saved["state_dict"])
        return head


def hidden_size(model: Any) -> int:
    config = model.config
    size = getattr(config, "hidden_size", None)
    if size is None:  # multimodal configs keep it on the text config
        size = config.get_text_config().hidden_size
    return int(size)


def backbone(model: Any) -> Any:
    """The transformer without its LM head (``model.base_model`` of a ``*ForCausalLM``; a bare ``AutoModel`` itself).

    A peft model is unwrapped first; its adapters live inside the transformer's layers, so they still apply.
    """
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return getattr(model, "base_model", model)


def _forward_with_hidden(model: Any, logits_to_keep: int, **inputs: Any) -> tuple[Any, torch.Tensor]:
    """``(logits of the last logits_to_keep positions, the backbone's last hidden state [B, L, H])`` from one call
    of ``model`` itself; a bare backbone (a critic's ``AutoModel``) gives ``(None, its hidden state)``."""
    core = backbone(model)
    if core is model:
        return None, model(**inputs, use_cache=False).last_hidden_state
    captured: list[torch.Tensor] = []
    handle = core.register_forward_hook(lambda module, args, out: captured.append(out.last_hidden_state))
    try:
        logits = model(**inputs, use_cache=False, logits_to_keep=logits_to_keep).logits
    finally:
        handle.remove()
    return logits, captured[0]


def last_token_hidden(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Hidden state of each sequence's last token ``[B, H]`` (inputs are left-padded: the last column)."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    _, hidden = _forward_with_hidden(
        model, 1, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    )
    return hidden[:, -1]


def policy_forward(
    model: Any,
    head: ValueHead | None,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One batched forward over prompt+completion: token log-probs ``[B, T]``, entropies ``[B, T]`` and values.

    The model runs once; its LM head computes the logits of the last ``T + 1`` positions only (the first
    ``T`` predict the completion tokens), and the value head reads the backbone's hidden state of the last
    prompt token (position ``P - 1``: the state the agent answered from). Returns
    ``(logprobs, entropy or None, values [B, outputs] or None)``. With ``entropy_grad=False`` the entropy is a
    metric only: no graph is kept for its ``[B, T, V]`` softmax. As in :meth:`comarl.agents.Agent.completion_logprobs`,
    the forward runs the columns up to the longest row's end (``completion_mask``) alone, and a row's positions after
    its end hold 0.
    """
    width = completion_ids.shape[1]
    lengths = completion_lengths(completion_mask)
    P, T = prompt_ids.shape[1], max(1, int(lengths.max()))
    completion_ids, completion_mask = completion_ids[:, :T], completion_mask[:, :T]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits, hidden = _forward_with_hidden(
        model, T + 1, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    )
    logits = logits[:, :-1]
    logprobs = to_width(token_logprobs(logits, completion_ids, temperature), lengths, width)
    entropy = None
    if with_entropy:
        entropy = token_entropy(logits if entropy_grad else logits.detach(), temperature)
        entropy = to_width(entropy, lengths, width)
    values = head(hidden[:, P - 1]) if head is not None else None
    return logprobs, entropy, values


def joint_observation(observations: Sequence[str], answers: Sequence[str] | None = None) -> str:
    """The text a centralized critic reads: every agent's observation, and for Q the joint answer."""
    lines = [f"agent {i} sees: {obs}" for i, obs in enumerate(observations)]
    if answers is not None:
        lines += [f"agent {i} answers: {ans}" for i, ans in enumerate(answers)]
    return "\n".join(lines)


class CriticModel(nn.Module):
    """A separate critic: a backbone (``AutoModel``) with its own tokenizer and a value head.

    ``outputs`` values per text: 1 for an agent's own critic, ``N`` (one per agent) for a
    centralized one. Saved as a model folder plus ``value_head.pt``; loading that folder again
    restores the head.
    """

    def __init__(self, model: Any, tokenizer: Any, head: ValueHead, source: str | None = None) -> None:
        super().__init__()
        from comarl.agents import disable_dropout, prepare_tokenizer

        self.model = model
        self.tokenizer = prepare_tokenizer(tokenizer)
        self.head = head
        self.source = source
        disable_dropout(self.model)  # the values the critic learns from must be the ones it is scored on

    @classmethod
    def from_pretrained(
        cls, source: str | Path, outputs: int = 1, device: str | torch.device = "cpu"
    ) -> CriticModel:
        from transformers import AutoModel, AutoTokenizer

        model = AutoModel.from_pretrained(str(source), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(source))
        head = ValueHead.load_or_new(source, hidden_size(model), outputs)
        return cls(model, tokenizer, head, str(source)).to(device)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def encode(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer(list(texts), return_tensors="pt", padding=True)
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values ``[B, outputs]`` of left-padded token ids."""
        return self.head(last_token_hidden(self.model, input_ids, attention_mask))

    def save(self, directory: str | Path) -> None:
        from comarl.distributed import save_own_model

        save_own_model(self.model, directory)  # from whichever process holds this critic
        self.tokenizer.save_pretrained(directory)
        self.head.save(directory)
