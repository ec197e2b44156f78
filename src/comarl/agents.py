"""Agents: one policy each (model + tokenizer + formatter + its own learning rate and device)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from comarl.algorithms import completion_lengths, to_width, token_logprobs
from comarl.config import ConfigError
from comarl.llama_decoder import shared_prompt_logits, unsupported_reason

Prompt = str | list[dict[str, str]]


def _cache_argument(transformers_version: str) -> str:
    """The forward argument that takes a KV cache: ``cache`` from transformers 5.24 on, ``past_key_values`` before.

    (5.24 renamed it; the old name still works there with a FutureWarning until 5.40.)
    """
    major, minor = (int(part) for part in transformers_version.split(".")[:2])
    return "cache" if (major, minor) >= (5, 24) else "past_key_values"


CACHE_ARGUMENT = _cache_argument(version("transformers"))


def disable_dropout(model: Any) -> None:
    """No dropout in RL: the policy that samples (eval mode) must be the policy that is scored (train mode). Zeroes
    every ``nn.Dropout`` and every float module attribute named like ``*dropout*``, which transformers models pass
    to attention or ``F.dropout`` in training mode (Qwen2's ``attention_dropout``, StarCoder2's
    ``residual_dropout``: 0.1 in its configs)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    for name, value in list(vars(config).items()) if config is not None else []:
        if "dropout" in name and isinstance(value, float):
            setattr(config, name, 0.0)


def set_activation_checkpointing(model: Any, on: bool, transformers_version: str | None = None) -> None:
    """Turn activation checkpointing on or off: ``activation_checkpointing_enable`` / ``_disable`` from
    transformers 5.23 on, ``gradient_checkpointing_*`` before (5.23 renamed them; the old names warn until v6)."""
    major, minor = (int(part) for part in (transformers_version or version("transformers")).split(".")[:2])
    prefix = "activation" if (major, minor) >= (5, 23) else "gradient"
    getattr(model, f"{prefix}_checkpointing_{'enable' if on else 'disable'}")()


# model_kwargs that say where a model is and how to fetch it: the tokenizer loaded from the same name gets them too.
HUB_KEYS = (
    "revision",
    "token",
    "cache_dir",
    "local_files_only",
    "force_download",
    "proxies",
    "trust_remote_code",
)


def model_tokenizer(source: str, model_kwargs: dict[str, Any] | None) -> Any:
    """The tokenizer of the model at ``source``, fetched from where the model comes from (``model_kwargs``' revision,
    token, cache and remote-code settings)."""
    from transformers import AutoTokenizer

    hub = {k: v for k, v in (model_kwargs or {}).items() if k in HUB_KEYS}
    return AutoTokenizer.from_pretrained(str(source), **hub)


def is_adapter_folder(source: str, model_kwargs: dict[str, Any]) -> bool:
    """Whether ``source`` (a hub id or local path) holds a peft adapter (``adapter_config.json``) over a base model."""
    from transformers.utils import find_adapter_config_file

    hub = {k: v for k, v in model_kwargs.items() if k in HUB_KEYS and k != "trust_remote_code"}
    return find_adapter_config_file(source, **hub) is not None


def _load_adapter(source: str, model_kwargs: dict[str, Any]) -> Any:
    """The base model that the adapter at ``source`` names, in fp32, with the adapter on it, trainable."""
    try:
        from peft import AutoPeftModelForCausalLM
    except ImportError as error:
        raise ImportError(
            f"{source} is a LoRA adapter folder; loading it needs peft: pip install 'comarl[peft]'"
        ) from error
    return AutoPeftModelForCausalLM.from_pretrained(
        source, is_trainable=True, dtype=torch.float32, **model_kwargs
    )


class Agent:
    """One policy of the team.

    ``model`` is a causal LM (trained with fp32 weights: they are the AdamW master weights),
    ``tokenizer`` its tokenizer (left padding, pad token set when missing), ``formatter`` turns a
    dataset item into this agent's prompt (a string, or chat messages rendered with the
    tokenizer's chat template), ``learning_rate`` overrides the trainer's for this agent.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        role: str | None = None,
        formatter: Callable[[Any], Prompt] | None = None,
        learning_rate: float | None = None,
        device: str | torch.device | None = None,
        source: str | None = None,
    ) -> None:
        if tokenizer is None:
            raise ValueError("Agent: a tokenizer is required when the model is given as an object")
        if learning_rate is not None and not (
            isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate) and learning_rate > 0
        ):
            # the config's learning_rate is checked before anything loads; this one would fail inside AdamW
            raise ValueError(
                f"Agent: learning_rate={learning_rate!r} must be a finite number > 0 (or None: the trainer's)"
            )
        self.model = model
        self.tokenizer = prepare_tokenizer(tokenizer)
        self.role = role
        self.index: int | None = None  # its place in a Team, which sets it
        self.formatter = formatter
        self.learning_rate = learning_rate
        self.source = source
        # This agent's own sampling stream (the trainer seeds it); None samples from torch's global stream.
        self.generator: torch.Generator | None = None
        # Its forwards (generation and scoring) under bf16 autocast; the weights stay fp32 (the trainer sets it).
        self.bf16 = False
        if device is not None:
            self.model.to(device)
        disable_dropout(self.model)
        if any(p.dtype != torch.float32 for p in self.model.parameters()):
            # AdamW keeps its master weights in the parameters themselves; bf16 compute is autocast.
            self.model.float()
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        check_token_ids(self.model, self.tokenizer.pad_token_id, self.eos_token_ids)

    @classmethod
    def from_pretrained(
        cls,
        source: str | Path | Any,
        tokenizer: str | Path | Any | None = None,
        *,
        role: str | None = None,
        formatter: Callable[[Any], Prompt] | None = None,
        learning_rate: float | None = None,
        device: str | torch.device | None = None,
        model_kwargs: dict[str, Any] | None = None,
    ) -> Agent:
        """Load from a hub id or local path (or wrap a model object); the tokenizer defaults to the model's."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(source, (str, Path)):
            kwargs = dict(model_kwargs or {})
            for key in ("torch_dtype", "dtype"):
                if kwargs.get(key) not in (None, torch.float32, "float32", "fp32"):
                    raise ValueError(
                        f"model_kwargs[{key!r}]={kwargs[key]!r}: comarl trains fp32 weights (the AdamW master copy); "
                        "set bf16=True in the config for bf16 compute instead"
                    )
                kwargs.pop(key, None)
            if is_adapter_folder(str(source), kwargs):
                # A saved LoRA agent (save_model's agent_i/): its base with the adapter as a trainable peft model, so
                # training continues the adapter (transformers alone would load it frozen, with nothing to train).
                model = _load_adapter(str(source), kwargs)
            else:
                model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, **kwargs)
            name = str(source)
        else:
            if model_kwargs:
                raise ValueError(
                    f"Agent.from_pretrained: model_kwargs={model_kwargs!r} apply to a model loaded from a hub id or "
                    "path, and this one is a model object, used as it is; pass its hub id or path instead, or load it "
                    "with those settings yourself (in a trainer: model_config['model_kwargs'])"
                )
            model, name = source, getattr(getattr(source, "config", None), "_name_or_path", None)
        if tokenizer is None:
            if name is None or not isinstance(source, (str, Path)):
                raise ValueError("Agent.from_pretrained: pass tokenizer= when the model is an object")
            tokenizer = model_tokenizer(name, model_kwargs)
        elif isinstance(tokenizer, (str, Path)):
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        return cls(
            model,
            tokenizer,
            role=role,
            formatter=formatter,
            learning_rate=learning_rate,
            device=device,
            source=name,
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def label(self) -> str:
        """How messages name this agent: its index in the team and its role, as far as they are known."""
        name = "Agent" if self.index is None else f"agent {self.index}"
        return f"{name} (role {self.role!r})" if self.role else name

    def encode(self, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and attention mask; chat messages go through the chat template."""
        for i, prompt in enumerate(prompts):
            check_prompt(prompt, f"{self.label}: prompts[{i}]")
        is_chat = [not isinstance(p, str) for p in prompts]
        if any(is_chat) and not all(is_chat):
            raise ValueError(
                "Agent.encode: a batch mixes plain-text prompts and chat messages; use one kind per agent"
            )
        texts = [render_prompt(self.tokenizer, p) for p in prompts]
        # Left padding whatever the tokenizer's padding_side says now (the caller may have changed it).
        enc = self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            return_attention_mask=True,
            add_special_tokens=not any(is_chat),
        )
        empty = (enc["attention_mask"].sum(dim=1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"{self.label}: prompts[{empty[0]}] ({texts[empty[0]]!r}) encodes to no tokens (the tokenizer adds "
                "no BOS); make the formatter return a non-empty prompt"
            )
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def completion_logprobs(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        temperature: float = 1.0,
        model: Any = None,
    ) -> torch.Tensor:
        """Per-token log-probs ``[B, T]`` of the completion tokens, from one batched forward.

        The input is prompt+completion; the logits at position ``P-1+t`` predict completion token
        ``t``, so only the last ``T+1`` logits are computed (``logits_to_keep``). Position ids
        follow the attention mask, as in generation with left padding.

        Rows that share a prompt (the G samples of a group) share its computation: the distinct prompts (all but
        their last token) run once, and only the last prompt token + the completion run per row. Gradients flow
        through the shared prompt as through G copies of it. On the CPU, a model that
        :func:`comarl.llama_decoder.unsupported_reason` accepts runs both sets of tokens in one pass of comarl's own
        forward (:func:`comarl.llama_decoder.shared_prompt_logits`: the same layers and operations, each product
        once over both sets, without the forward's per-call overhead; a peer-mode update takes 15-21 % less time).
        Any other model runs the distinct prompts through its forward, their KV cache gathered to every row, then
        the rows. Neither under gradient checkpointing, which drops caches (the whole rows then run), nor for a
        model sharded by FSDP2 (``shard_weights``), which frees each layer's gathered weights after its own
        backward, while the cache carries gradients from the completion's forward back into the prompt's.

        A row's positions after its last completion token (``completion_mask``) hold 0: every path runs the columns
        up to the longest row's end alone, and comarl's CPU forward leaves out each row's own tail as well (a batch
        whose completions end at different lengths costs what its tokens cost).
        """
        model = self.model if model is None else model
        B, T = completion_ids.shape
        # A row's positions after its last completion token reach no log-prob that is read and, attention being
        # causal, no earlier one: the forward runs the columns up to the longest row's end, and they hold 0.
        lengths = completion_lengths(completion_mask)
        with forward_module(model) as module:
            if (
                prompt_ids.device.type == "cpu"
                and prompt_ids.shape[1] >= 2
                and not checkpointing_on(module)
                and unsupported_reason(module) is None
            ):
                asked = torch.arange(T, device=lengths.device) < lengths[:, None]  # [B, T]
                rows = torch.arange(B, device=prompt_ids.device)
                distinct, row_to_prompt = _shared_prompts(prompt_ids, prompt_mask) or (rows, rows)
                logits = shared_prompt_logits(
                    module,
                    prompt_ids[distinct],
                    prompt_mask[distinct],
                    completion_ids,
                    row_to_prompt,
                    lengths,
                )  # [sum(lengths), V]: each row's positions up to its end alone
                picked = token_logprobs(logits[None], completion_ids[asked][None], temperature)[0]
                return picked.new_zeros(B, T).masked_scatter(asked, picked)
        T = max(1, int(lengths.max()))
        logp = Agent._forward_logprobs(
            model, prompt_ids, prompt_mask, completion_ids[:, :T], completion_mask[:, :T], temperature
        )
        return to_width(logp, lengths, completion_ids.shape[1])

    @staticmethod
    def _forward_logprobs(
        model: Any,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        temperature: float,
    ) -> torch.Tensor:
        """:meth:`completion_logprobs` through ``model``'s own forward: the distinct prompts with a KV cache gathered to
        the rows, or whole rows where caches cannot carry gradients (checkpointing, FSDP2)."""
        T = completion_ids.shape[1]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        shared = (
            _shared_prompts(prompt_ids, prompt_mask)
            if not (checkpointing_on(model) or _sharded(model))
            else None
        )
        if shared is None:
            logits = model(
                input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=T + 1,
                use_cache=False,
            ).logits[:, :-1]
            return token_logprobs(logits, completion_ids, temperature)
        from transformers import DynamicCache

        distinct, row_to_prompt = shared
        P = prompt_ids.shape[1]
        cache = DynamicCache(config=model.config)
        model(
            input_ids=prompt_ids[distinct, : P - 1],
            attention_mask=prompt_mask[distinct, : P - 1],
            position_ids=position_ids[distinct, : P - 1],
            use_cache=True,
            logits_to_keep=1,
            **{CACHE_ARGUMENT: cache},
        )
        check_cache_filled(cache, model)
        cache.batch_select_indices(row_to_prompt)
        logits = model(
            input_ids=torch.cat([prompt_ids[:, P - 1 :], completion_ids[:, :-1]], dim=1),
            attention_mask=attention_mask[:, :-1],
            position_ids=position_ids[:, P - 1 : -1],
            use_cache=True,
            **{CACHE_ARGUMENT: cache},
        ).logits
        return token_logprobs(logits, completion_ids, temperature)


def _shared_prompts(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(distinct, row_to_prompt)`` when rows repeat a prompt, else None.

    ``distinct`` indexes one row per distinct (ids, mask) prompt; ``row_to_prompt[r]`` is the
    position in ``distinct`` of row r's prompt. Only worth it when some prompt repeats and the
    prompt has more than one token (the last one always runs per row).
    """
    if prompt_ids.shape[0] < 2 or prompt_ids.shape[1] < 2:
        return None
    _, row_to_prompt = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
    count = int(row_to_prompt.max()) + 1
    if count == prompt_ids.shape[0]:
        return None
    # First row of each distinct prompt: the smallest row index mapped to it.
    rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
    first = torch.full((count,), prompt_ids.shape[0], device=prompt_ids.device).scatter_reduce(
        0, row_to_prompt, rows, reduce="amin"
    )
    return first, row_to_prompt


def checkpointing_on(model: Any) -> bool:
    """Whether activation checkpointing is on (transformers then drops the KV cache in training forwards)."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def _sharded(model: Any) -> bool:
    """Whether FSDP2 splits the model's weights among processes (``shard_weights``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Left padding for batched generation; a pad token when the tokenizer has none.

    The pad token falls back to EOS. That is safe even when prompts contain EOS (chat templates):
    prompts are masked by the tokenizer's attention mask, completions are sliced off by the
    padded prompt length, and only tokens after the first *generated* EOS are treated as padding.
    """
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                "tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token first"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_token_ids(model: Any, pad_token_id: int | None, eos_ids: Sequence[int]) -> None:
    """Refuse a pad or EOS id outside the model's embedding rows (e.g. a pad token added to the tokenizer only):
    generation would feed it to the model and fail deep in torch."""
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        return  # a model that does not expose its embeddings: nothing to check against
    if pad_token_id is None or not 0 <= pad_token_id < rows:
        raise ValueError(
            f"Agent: tokenizer.pad_token_id={pad_token_id} is outside the model's {rows} embedding rows; resize them "
            "(model.resize_token_embeddings(len(tokenizer))) or leave the pad token unset so that EOS pads"
        )
    for eos in eos_ids:
        if not 0 <= eos < rows:
            raise ValueError(
                f"Agent: EOS id {eos} (tokenizer.eos_token_id or model.generation_config.eos_token_id) is outside the "
                f"model's {rows} embedding rows; set an EOS id of the model's vocabulary, or resize the embeddings "
                "(model.resize_token_embeddings(len(tokenizer)))"
            )


def check_cache_filled(cache: Any, model: Any) -> None:
    """Refuse a model whose prefill left ``cache`` empty: its forward ignored the cache argument (e.g. remote code
    that takes only ``past_key_values`` and swallows ``**kwargs``), so every later step would run without the
    prompt. Reads no tensor."""
    layers = getattr(cache, "layers", None)
    if layers is None or any(getattr(layer, "is_initialized", True) for layer in layers):
        return
    renamed = " (transformers 5.24 renamed past_key_values to cache)" if CACHE_ARGUMENT == "cache" else ""
    raise RuntimeError(
        f"{type(model).__name__} ignored the KV cache passed as {CACHE_ARGUMENT}={renamed}: its forward left it "
        f"empty (a trust_remote_code model written for another transformers release?); make its forward accept "
        f"{CACHE_ARGUMENT}= and fill that cache"
    )


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token id that ends a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, gen_eos):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and v not in ids:
                ids.append(int(v))
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation config defines an EOS token")
    return ids


def check_prompt(prompt: Any, where: str) -> None:
    """Refuse anything but a prompt: a string, or a list/tuple of chat message dicts. ``where`` names the prompt."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        return
    hint = {dict: " (wrap a single message in a list)", type(None): " (a formatter that forgot to return?)"}
    raise TypeError(
        f"{where}: got {type(prompt).__name__} {prompt!r:.80}{hint.get(type(prompt), '')}; a prompt is a string or a "
        "list of chat messages like [{'role': 'user', 'content': ...}]: make the formatter return one"
    )


def render_prompt(tokenizer: Any, prompt: Prompt) -> str:
    """A prompt as model input text: strings as they are, chat messages through the chat template."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "a formatter returned chat messages but the tokenizer has no chat_template; return a string"
        )
    return tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)


class Team:
    """The agents that act together; agent ``i`` answers observation ``i``."""

    def __init__(self, agents: Sequence[Agent], share_weights: bool = False) -> None:
        if not agents:
            raise ValueError("Team: give at least one Agent")
        # An agent trained by another process (comarl.distributed.RemoteAgent) has no model here.
        models = [id(getattr(a, "model", a)) for a in agents]
        if share_weights:
            if len(set(models)) != 1:
                raise ValueError("Team(share_weights=True): every agent must hold the same model object")
            # One model trains with one optimizer: one learning rate for every role.
            rates = [getattr(a, "learning_rate", None) for a in agents]
            if len(set(rates)) > 1:
                raise ValueError(
                    f"Team(share_weights=True): the agents' learning_rate values {rates} differ, but they share one "
                    "model and one optimizer; give every agent the same learning_rate (or none: the trainer's)"
                )
        else:
            for i, m in enumerate(models):
                if m in models[:i]:
                    j = models.index(m)
                    raise ValueError(
                        f"Team: agents {j} and {i} are the same model object; give each agent its own copy "
                        "(copy.deepcopy(model)), or train one model in every role with share_weights=True"
                    )
        self.agents = list(agents)
        self.share_weights = share_weights
        for i, agent in enumerate(self.agents):
            if isinstance(agent, Agent):
                agent.index = i

    def __len__(self) -> int:
        return len(self.agents)

    def __getitem__(self, i: int) -> Agent:
        return self.agents[i]

    def __iter__(self):  # noqa: ANN204
        return iter(self.agents)


def _lora_config(r: int, alpha: float, target_modules: list[str] | str) -> Any:
    try:
        from peft import LoraConfig
    except ImportError as error:
        raise ImportError(f"lora_r={r} needs peft: pip install 'comarl[peft]'") from error
    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=target_modules, task_type="CAUSAL_LM"
    )


def add_lora(model: Any, r: int, alpha: float, target_modules: list[str] | str) -> Any:
    """``model`` with fresh LoRA adapters (peft); only the adapters train. Adapter dropout is 0, as every
    dropout in RL (the policy that samples must be the policy that is scored)."""
    from peft import get_peft_model

    with _named_targets(model, target_modules):
        return get_peft_model(model, _lora_config(r, alpha, target_modules))


@contextmanager
def _named_targets(model: Any, target_modules: list[str] | str) -> Iterator[None]:
    """Inside the block, peft finding no module to adapt is a ConfigError naming lora_target_modules and the
    model's linear layers (peft's own error names neither the field nor what would match)."""
    from peft.utils.error import NoMatchingPeftModuleError

    try:
        yield
    except NoMatchingPeftModuleError:
        linear = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
            }
        )
        raise ConfigError(
            f"lora_target_modules={target_modules!r}: no module of {type(model).__name__} matches; name some of its "
            f"linear layers ({', '.join(linear)}) or give 'all-linear'"
        ) from None


def shared_base_lora(
    model: Any,
    names: Sequence[str],
    r: int,
    alpha: float,
    target_modules: list[str] | str,
    seeds: Sequence[int],
) -> list[SharedBaseAdapter]:
    """One peft model over ``model`` with one adapter per name, adapter ``k`` initialised from ``seeds[k]``
    (as ``add_lora`` on a copy of ``model`` under that seed would); one view per adapter."""
    from peft import get_peft_model

    config = _lora_config(r, alpha, target_modules)
    with torch.random.fork_rng(), _named_targets(model, target_modules):
        torch.manual_seed(seeds[0])
        peft_model = get_peft_model(model, config, adapter_name=names[0])
    for name, seed in zip(names[1:], seeds[1:]):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            peft_model.add_adapter(name, config)
    return [SharedBaseAdapter(peft_model, name) for name in names]


class SharedBaseAdapter:
    """One agent's view of a peft model that holds every agent's adapters on one shared base (``lora_shared_base``).

    Calling it (generation, log-probs) first makes its adapter the active one; so do ``parameters()`` and
    ``get_base_model()`` (a value head's forward), whose ``requires_grad`` flags then name what this agent
    trains. ``parameters()``, ``state_dict()`` and ``save_pretrained`` are its adapter's alone; everything else is
    the shared model's. Agents on one device take turns, so switching adapters between them is free.
    """

    def __init__(self, peft_model: Any, adapter: str) -> None:
        self.peft_model = peft_model
        self.adapter = adapter

    def activate(self) -> None:
        if self.peft_model.active_adapter != self.adapter:
            self.peft_model.set_adapter(self.adapter)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.activate()
        return self.peft_model(*args, **kwargs)

    def get_base_model(self) -> Any:
        self.activate()
        return self.peft_model.get_base_model()

    def _own(self, name: str) -> bool:
        # A whole name component: peft names an embedding's adapter '...lora_embedding_A.agent_0', with no dot after.
        return self.adapter in name.split(".")

    def named_parameters(self) -> Any:
        self.activate()
        return ((n, p) for n, p in self.peft_model.named_parameters() if self._own(n))

    def parameters(self) -> Any:
        return (p for _, p in self.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.peft_model.state_dict().items() if self._own(k)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = self.state_dict()
        if sorted(state) != sorted(own):
            raise ValueError(
                f"SharedBaseAdapter({self.adapter!r}).load_state_dict: the state holds {len(state)} tensors, this "
                f"adapter has {len(own)}; load a checkpoint of the same team, LoRA settings and lora_shared_base"
            )
        self.peft_model.load_state_dict(state, strict=False)

    def save_pretrained(self, path: str | Path) -> None:
        """This agent's adapter into ``path`` (loadable like any peft adapter folder: base + adapter)."""
        import shutil
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            self.peft_model.save_pretrained(tmp, selected_adapters=[self.adapter])
            Path(path).mkdir(parents=True, exist_ok=True)
            for file in (Path(tmp) / self.adapter).iterdir():  # peft puts a named adapter in a subfolder
                shutil.move(str(file), Path(path) / file.name)

    def __getattr__(self, name: str) -> Any:
        if name in ("peft_model", "adapter"):  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.peft_model, name)


@contextmanager
def forward_module(model: Any) -> Iterator[Any]:
    """The torch module whose forward is ``model``'s, in the state that forward needs: a model itself; a
    :class:`SharedBaseAdapter`'s shared peft model with the agent's adapter active; a :class:`WithoutAdapters`' model
    with its adapters off."""
    if isinstance(model, WithoutAdapters):
        with forward_module(model.model) as module, module.disable_adapter():
            yield module
    elif isinstance(model, SharedBaseAdapter):
        model.activate()
        yield model.peft_model
    else:
        yield model


def has_adapters(model: Any) -> bool:
    """Whether ``model`` is a peft model (its adapters can be switched off)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


class WithoutAdapters:
    """A LoRA agent's base model, for the KL reference: calls the agent's model with its adapters off.

    The reference of a LoRA agent needs no copy of the weights: the base is frozen and shared.
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
