"""comarl's own decode step for Llama, Mistral, Qwen2 and Qwen3 models: the model's next-token logits, without its
per-step overhead; and, from the same layers, the CPU training forward of rows that share prompts
(:func:`shared_prompt_logits`).

Decoding a few rows at a time, ``model(input_ids=..., cache=...)`` spends a third of each step outside its
matrix products: a causal mask built per step, the KV cache grown by ``cat``, module calls and shape checks
(``docs/benchmarks.md``). :class:`LlamaDecoder` runs the same layers from the model's own weights, operation for
operation as the forward with its default SDPA attention (RMSNorm in fp32, rotary embeddings from the model's
``rotary_emb``, SDPA, the model's activation), with a KV buffer per layer allocated once and written in place;
its prefill runs the prompts through the same layers.
It stands in for the forward only where :func:`unsupported_reason` finds nothing that the step would leave out; any other model
(FSDP shards, hooks, sliding-window layers, peft adapters other than LoRA, another architecture) decodes through
its own forward. A projection that is not a plain ``nn.Linear`` (a LoRA layer, a quantized one) is called as the
module it is, so it computes what it computes in the forward. On the CPU in fp32 the plain projections multiply
by weights packed for oneDNN once per generate call (:func:`packed_weights`) where a trial of both ways on this
machine found that faster (:func:`packing_pays`).
"""

from __future__ import annotations

import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def _architectures() -> dict[type, set[type]]:
    """The supported causal-LM classes, each with the exact module classes its model may hold."""
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    shared = {torch.nn.ModuleList}
    return {
        llama.LlamaForCausalLM: shared
        | {
            llama.LlamaForCausalLM,
            llama.LlamaModel,
            llama.LlamaDecoderLayer,
            llama.LlamaAttention,
            llama.LlamaMLP,
            llama.LlamaRMSNorm,
            llama.LlamaRotaryEmbedding,
        },
        mistral.MistralForCausalLM: shared
        | {
            mistral.MistralForCausalLM,
            mistral.MistralModel,
            mistral.MistralDecoderLayer,
            mistral.MistralAttention,
            mistral.MistralMLP,
            mistral.MistralRMSNorm,
            mistral.MistralRotaryEmbedding,
        },
        qwen2.Qwen2ForCausalLM: shared
        | {
            qwen2.Qwen2ForCausalLM,
            qwen2.Qwen2Model,
            qwen2.Qwen2DecoderLayer,
            qwen2.Qwen2Attention,
            qwen2.Qwen2MLP,
            qwen2.Qwen2RMSNorm,
            qwen2.Qwen2RotaryEmbedding,
        },
        qwen3.Qwen3ForCausalLM: shared
        | {
            qwen3.Qwen3ForCausalLM,
            qwen3.Qwen3Model,
            qwen3.Qwen3DecoderLayer,
            qwen3.Qwen3Attention,
            qwen3.Qwen3MLP,
            qwen3.Qwen3RMSNorm,
            qwen3.Qwen3RotaryEmbedding,
        },
    }


# The layers LlamaDecoder calls through linear() and embed(): any module there computes its own output.
PROJECTIONS = {
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
    "embed_tokens",
}


def causal_lm(model: Any) -> Any:
    """The causal LM whose layers decode: ``model`` itself, or the one inside a peft model whose adapters are all
    LoRA (its forward is then the wrapped model's, with the LoRA layers in place); None for other peft models."""
    peft = sys.modules.get("peft")  # a model cannot be a PeftModel unless peft was imported
    if peft is None or not isinstance(model, peft.PeftModel):
        return model
    if any(config.peft_type != "LORA" for config in model.peft_config.values()):
        return None
    return model.get_base_model()


def unsupported_reason(model: Any) -> str | None:
    """Why :class:`LlamaDecoder` (and :func:`shared_prompt_logits`) cannot stand in for ``model``'s forward, or None
    when it can.

    It can for a ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` (also
    inside a peft LoRA model) made of exactly their own module classes but for the projections and embeddings
    (:data:`PROJECTIONS`, called as modules unless plain ``nn.Linear`` / ``nn.Embedding``), without hooks, with
    full attention in every layer (a Mistral with ``sliding_window`` unset: Mistral-7B-v0.3's config, not
    ``MistralConfig``'s default 4096), no attention dropout while training, and every weight on one device. A
    subclass, an FSDP-sharded layer or a replaced norm is refused.
    """
    inner = causal_lm(model)
    if inner is None:
        return f"{type(model).__name__} holds peft adapters other than LoRA"
    allowed = _architectures().get(type(inner))
    if allowed is None:
        return (
            f"{type(inner).__name__} is not LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or "
            "Qwen3ForCausalLM"
        )
    config = inner.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return "sliding-window attention layers"
    # Mistral's config has no layer types: a sliding_window set means every layer attends through it.
    if layer_types is None and getattr(config, "sliding_window", None) is not None:
        return f"sliding-window attention (sliding_window={config.sliding_window})"
    if inner.training and config.attention_dropout > 0:
        return "attention dropout while training"
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{name or 'the model'} has forward hooks"
    for name, module in inner.named_modules():
        path = name.split(".")
        # Projections and activations are called as they are, whatever their class (and whatever they hold).
        if set(path) & PROJECTIONS or path[-1] == "act_fn":
            continue
        if type(module) not in allowed:
            return f"{name or 'the model'} is a {type(module).__module__}.{type(module).__qualname__}"
    if len({p.device for p in model.parameters()}) > 1:
        return "weights on several devices"
    return None


def rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """``w * (x / sqrt(mean(x^2) + eps))``, computed in fp32 and cast back to ``x``'s dtype (Llama's RMSNorm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def linear(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The projection of ``x``: ``x W^T + b`` without the module call for a plain ``nn.Linear``, else the module's
    own forward (a LoRA or quantized layer)."""
    if type(layer) is torch.nn.Linear:
        return F.linear(x, layer.weight, layer.bias)
    return layer(x)


def embed(layer: Any, token_ids: torch.Tensor) -> torch.Tensor:
    """The embeddings of ``token_ids``: a row lookup for a plain ``nn.Embedding``, else the module's forward."""
    if type(layer) is torch.nn.Embedding:
        return layer.weight[token_ids]
    return layer(token_ids)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x cos + rotate_half(x) sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``, computed as
    ``x cos + [x2, x1] [-sin1, sin2]`` (:func:`signed_sin`): one roll instead of a chunk, a negation and a cat, and
    the same numbers, since negating is exact."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``[-sin1, sin2]`` from ``sin = [sin1, sin2]`` (halves of the last dimension), for :func:`rotate`."""
    sin1, sin2 = sin.chunk(2, dim=-1)
    return torch.cat((-sin1, sin2), dim=-1)


def attention_inputs(
    attention: Any, h: torch.Tensor, product: Callable[[Any, torch.Tensor], torch.Tensor] = linear
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values ``[..., heads, head_dim]`` of the normed hidden states ``h [..., hidden]``, each from
    ``product`` (:func:`linear`, or a decoder's packed products); Qwen3's per-head RMSNorm on queries and keys."""
    q, k, v = (
        product(projection, h).view(*h.shape[:-1], -1, attention.head_dim)
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj)
    )
    if hasattr(attention, "q_norm"):  # Qwen3: an RMSNorm over each head's query and key
        q, k = rms_norm(q, attention.q_norm), rms_norm(k, attention.k_norm)
    return q, k, v


def mlp_output(
    mlp: Any, h: torch.Tensor, product: Callable[[Any, torch.Tensor], torch.Tensor] = linear
) -> torch.Tensor:
    """The MLP block's output ``down(act(gate(h)) * up(h))``, each projection from ``product``."""
    return product(mlp.down_proj, mlp.act_fn(product(mlp.gate_proj, h)) * product(mlp.up_proj, h))


def causal_prompt_mask(prompt_mask: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean mask ``[B, 1, P, P]`` over left-padded prompts ``prompt_mask[B, P]``: True where a token may
    attend, to its prompt's tokens up to itself, the padding masked out. A padding query attends to nothing: SDPA
    gives it zeros (torch >= 2.6, as transformers' own masks rely on), and no real token attends to it."""
    P = prompt_mask.shape[1]
    causal = torch.ones(P, P, dtype=torch.bool, device=prompt_mask.device).tril()
    return (causal & prompt_mask.bool()[:, None, :])[:, None]


def rope_fixed_by_position(rotary_emb: Any) -> bool:
    """Whether ``rotary_emb`` gives each position the same cos and sin whatever else it is asked for: every RoPE
    type but 'dynamic' ones and 'longrope', which rescale by the largest position of the call."""
    rope_type = getattr(rotary_emb, "rope_type", None)
    return isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"


def packable_layers(model: Any) -> list[torch.nn.Linear]:
    """The layers whose weights :func:`packed_weights` packs: every plain ``nn.Linear`` among ``model``'s decoder
    projections and head (a LoRA or quantized layer is called as its module instead)."""
    return [
        module
        for name, module in model.named_modules()
        if name.split(".")[-1] in PROJECTIONS and type(module) is torch.nn.Linear
    ]


def cpu_packing_available() -> bool:
    """Whether this machine's oneDNN packs weights for a fast fp32 product: available and turned on
    (``torch.backends.mkldnn.flags(enabled=False)`` turns it off), on an x86-64 CPU or an Arm one with the Compute
    Library (ACL) built in, as ``torch.compile`` decides; elsewhere oneDNN falls back to reference kernels."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    return platform.machine().lower() in {"x86_64", "amd64"} or torch.ops.mkldnn._is_mkldnn_acl_supported()


def packing_possible(model: Any) -> bool:
    """Whether :func:`packed_weights` would pack ``model``'s weights: products that would be the forward's, on the
    CPU, from fp32 weights, outside autocast (where ``F.linear`` computes in the autocast dtype), with
    :func:`cpu_packing_available`."""
    if torch.is_autocast_enabled("cpu") or not cpu_packing_available():
        return False
    layers = packable_layers(model)
    return bool(layers) and all(
        layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32 for layer in layers
    )


def packed_weights(model: Any) -> dict[torch.nn.Linear, torch.Tensor]:
    """oneDNN's packed copy of the weight of every plain ``nn.Linear`` among ``model``'s decoder projections and
    head, for :func:`packed_linear`; empty where not :func:`packing_possible`. The copy is made per generate call
    because the weights change at every optimizer step; whether to make it is :func:`packing_pays`'s call.
    ``torch.compile`` packs frozen CPU linears with the same operators (inductor's ``mkldnn_fusion``)."""
    if not packing_possible(model):
        return {}
    with torch.no_grad():
        return {
            layer: torch.ops.mkldnn._reorder_linear_weight(layer.weight) for layer in packable_layers(model)
        }


@dataclass
class PackingTrial:
    """What a packing trial timed (:meth:`LlamaDecoder.trial_step`): seconds per decode step with plain and with
    packed products and seconds per packing; and how many calls :func:`packing_pays` has decided from it since."""

    plain: float
    packed: float
    packing: float
    uses: int = 0

    def saves(self, steps: int) -> bool:
        """``packing + steps * packed < steps * plain``: whether packing makes ``steps`` decode steps faster."""
        return self.packing + steps * self.packed < steps * self.plain


# Per (weight shapes, rows), this process's latest packing trial.
PACKING_TRIALS: dict[tuple[Any, ...], PackingTrial] = {}

# The decode steps a trial times, after a first untimed one: half with plain products, half packed, alternating.
TRIAL_STEPS = 8

# Calls a trial decides before a call long enough for a trial tries again (the machine's state moves over hours).
RECORD_CALLS = 500


def packing_key(model: Any, rows: int) -> tuple[Any, ...]:
    """What a packing trial's times hold for: the shapes (and biases) of ``model``'s packable weights, and ``rows``."""
    layers = packable_layers(model)
    return tuple((tuple(layer.weight.shape), layer.bias is not None) for layer in layers), rows


def packing_pays(model: Any, rows: int, steps: int) -> bool | None:
    """Whether a decoder of ``rows`` rows that decodes ``steps`` steps packs ``model``'s weights
    (:func:`packed_weights`): ``packing + steps * packed < steps * plain``, from :data:`PACKING_TRIALS`, the times of
    this process's trial for these weights' shapes and rows. None where no trial was made, or it has decided
    :data:`RECORD_CALLS` calls already, and this call can make one (more than :data:`TRIAL_STEPS` steps:
    :class:`LlamaDecoder` then times both ways in it). False where not :func:`packing_possible`, for a call too
    short for a trial and without a record, and under ``torch.use_deterministic_algorithms``, where the products
    stay the forward's own rather than follow a timing (the two differ in the last bits, ~1e-6).

    Why a timing: for a few rows, oneDNN's product from a packed weight took ~42 us (4 x 256 -> 1024, one core)
    against MKL's ~80 us from the row-major weight on most days of this project's VM (generation 1.2x faster at
    4 rows, 1.15x at 32), but MKL's took 24-30 us on others, where the packing costs (generation x0.81-0.86):
    docs/benchmarks.md has both. Whole decode steps are timed, not the products alone: a pass over the products
    by themselves showed a third to a half of the difference that decode steps showed (the step's other work
    shares the caches)."""
    if torch.are_deterministic_algorithms_enabled() or not packing_possible(model):
        return False
    trial = PACKING_TRIALS.get(packing_key(model, rows))
    if trial is None or (steps > TRIAL_STEPS and trial.uses >= RECORD_CALLS):  # none yet, or an old one
        return None if steps > TRIAL_STEPS else False
    trial.uses += 1
    return trial.saves(steps)


def packed_linear(layer: torch.nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x W^T + b`` of a plain ``nn.Linear`` from its packed weight (:func:`packed_weights`)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")


def laid_out(t: torch.Tensor, runs: torch.Tensor | None, count: int, width: int) -> torch.Tensor:
    """``[tokens run, heads, head_dim]`` as ``[count, heads, width, head_dim]`` for attention: token ``i`` at flat
    position ``runs[i]`` of ``[count, width]`` (all positions, in order, where ``runs`` is None), the others zeros."""
    if runs is not None:
        t = t.new_zeros(count * width, *t.shape[1:]).index_copy(0, runs, t)
    return t.view(count, width, *t.shape[1:]).transpose(1, 2)


def run_only(out: torch.Tensor, runs: torch.Tensor | None) -> torch.Tensor:
    """SDPA's output ``[count, heads, width, head_dim]`` at the positions run (:func:`laid_out`), ``[tokens run,
    heads * head_dim]``."""
    out = out.transpose(1, 2).reshape(out.shape[0] * out.shape[2], -1)
    return out if runs is None else out[runs]


class LlamaDecoder:
    """Next-token logits of ``B * G`` rows, one new token per call, after a prefill of ``B`` left-padded prompts.

    Row ``b * G + j`` continues prompt b. :meth:`prefill` runs the prompts through the same layers and writes their
    keys and values once into per-layer buffers ``[B * G, kv_heads, P + max_new_tokens, head_dim]`` (each prompt's
    for its G rows); each step writes its keys and values at position ``P + t`` and attends to the first
    ``P + t + 1`` positions, the prompt's padding masked out.
    Rotary positions follow the attention mask, as in :func:`comarl.engines.sample_completions`. On the CPU in
    fp32 its products are plain or from packed weights, as :func:`packing_pays` says; where it has no answer yet,
    this decoder finds one by timing both ways in its first steps (:meth:`trial_step`).
    """

    def __init__(
        self, model: Any, prompt_mask: torch.Tensor, num_generations: int, max_new_tokens: int
    ) -> None:
        self.model = model = causal_lm(model)
        self.layers = model.model.layers[: model.config.num_hidden_layers]
        G, T = num_generations, max_new_tokens
        B, P = prompt_mask.shape
        # Packed weights where this process's trial found them faster for these rows and T - 1 steps; else, where
        # no trial was made yet, this call makes one (trial_step).
        pays = packing_pays(model, B * G, T - 1)
        self.packed = packed_weights(model) if pays else {}
        self.trial_key = packing_key(model, B * G) if pays is None else None
        self.trial_packs: dict[torch.nn.Linear, torch.Tensor] = {}
        # The trial's step times with plain and with packed products, and its packing time.
        self.trial_seconds: tuple[list[float], list[float], list[float]] = ([], [], [])
        self.rows, self.prompt_length, self.step = B * G, P, 0
        self.num_generations = G
        self.prompt_mask = prompt_mask
        self.keys: list[torch.Tensor] = []  # per layer, [B * G, kv_heads, P + T, head_dim], made by prefill
        self.values: list[torch.Tensor] = []
        self.attend_bias: torch.Tensor | None = None  # the decode steps' SDPA mask, made by prefill
        last = (prompt_mask.sum(dim=1, keepdim=True) - 1).clamp(min=0)
        self.first_position = last.repeat_interleave(G, dim=0) + 1  # [rows, 1]
        self.max_new_tokens = T
        # cos and sin [rows, 1, T, head_dim] of every step, made at the first (from its hidden state's dtype), where
        # they depend on the position alone; a 'dynamic' RoPE gets them per step, as in the forward.
        self.rotary: tuple[torch.Tensor, torch.Tensor] | None = None

    def linear(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """``layer``'s projection of ``x``, from its packed weight where :func:`packed_weights` made one."""
        packed = self.packed.get(layer)
        return linear(layer, x) if packed is None else packed_linear(layer, packed, x)

    def rotary_embedding(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's cos and signed sin (:func:`rotate`) ``[rows, 1, 1, head_dim]``, from the model's ``rotary_emb``
        at the rows' positions and ``x``'s dtype: taken from those of every step, made once at the first, where
        :func:`rope_fixed_by_position`; else made at every step, as the forward does (a 'dynamic' RoPE rescales by
        the largest position)."""
        rotary_emb, t = self.model.model.rotary_emb, self.step
        if not rope_fixed_by_position(rotary_emb):
            cos, sin = rotary_emb(x, self.first_position + t)
            return cos[:, None], signed_sin(sin[:, None])
        if self.rotary is None:
            positions = self.first_position + torch.arange(self.max_new_tokens, device=x.device)  # [rows, T]
            cos, sin = rotary_emb(x, positions)
            self.rotary = cos[:, None], signed_sin(sin[:, None])
        cos, sin = self.rotary
        return cos[:, :, t : t + 1], sin[:, :, t : t + 1]

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, V]`` after each prompt ``prompt_ids[B, P]``, its keys and values written to its G
        rows' buffers. The forward's operations over the prompts' tokens (a token attends to its prompt's earlier
        tokens; rotary embeddings from one ``rotary_emb`` call at their positions), their left padding left out of
        every product (laid out as zeros for attention, masked), and the last layer, whose output reaches the logits
        only at the last position, run past its keys and values for that position alone. Products are plain
        (:func:`linear`): many rows, where packing does not pay."""
        base, G = self.model.model, self.num_generations
        B, P = prompt_ids.shape
        T = self.max_new_tokens
        real = self.prompt_mask.flatten().bool()  # the prompts' tokens, without the padding
        runs = None if bool(real.all()) else real.nonzero().squeeze(1)
        tokens, positions = prompt_ids.flatten(), (self.prompt_mask.cumsum(dim=1) - 1).clamp(min=0).flatten()
        if runs is not None:
            tokens, positions = tokens[runs], positions[runs]
        last = self.prompt_mask.sum(dim=1).cumsum(dim=0) - 1  # each prompt's last token among those run
        x = embed(base.embed_tokens, tokens)  # [n, hidden]
        cos, sin = base.rotary_emb(x, positions[None])
        cos, sin = cos[0, :, None], signed_sin(sin[0, :, None])  # [n, 1, head_dim]
        attends = causal_prompt_mask(self.prompt_mask)
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            q, k, v = attention_inputs(attention, rms_norm(x, layer.input_layernorm))  # [n, heads, head_dim]
            k, v = laid_out(rotate(k, cos, sin), runs, B, P), laid_out(v, runs, B, P)
            for prompt_kv, buffers in ((k, self.keys), (v, self.values)):
                _, heads, _, head_dim = prompt_kv.shape
                buffer = prompt_kv.new_empty(B, G, heads, P + T, head_dim)
                buffer[:, :, :, :P] = prompt_kv[:, None]
                buffers.append(buffer.view(B * G, heads, P + T, head_dim))
            # the queries and residuals that go on: the last layer's at each prompt's last token alone
            if index == len(self.layers) - 1:
                x, q = x[last], rotate(q[last], cos[last], sin[last])[:, :, None]  # [B, heads, 1, head_dim]
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attends[:, :, P - 1 :], scale=attention.scaling, enable_gqa=True
                ).reshape(B, -1)
            else:
                q = laid_out(rotate(q, cos, sin), runs, B, P)
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attends, scale=attention.scaling, enable_gqa=True
                )
                out = run_only(out, runs)
            x = x + linear(attention.o_proj, out)
            x = x + mlp_output(layer.mlp, rms_norm(x, layer.post_attention_layernorm))
        # The decode steps' mask [rows, 1, 1, P + T]: 0 where a row may attend, -inf at its prompt's padding;
        # additive (SDPA turns a boolean mask into this at every call) and in the keys' dtype, as its kernels want.
        keep = torch.cat([self.prompt_mask.bool(), self.prompt_mask.new_ones(B, T, dtype=torch.bool)], dim=1)
        bias = torch.zeros(keep.shape, dtype=k.dtype, device=k.device).masked_fill_(~keep, -math.inf)
        self.attend_bias = bias.repeat_interleave(G, dim=0)[:, None, None, :]
        return linear(self.model.lm_head, rms_norm(x, base.norm))

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Decode only ``rows`` (ids among this decoder's current rows, in the order given) from the next step on:
        their keys, values, mask and positions are kept, the other rows' dropped. For rows that have ended: each
        step then runs fewer rows, for one copy of the kept rows' keys and values."""
        self.keys = [keys[rows] for keys in self.keys]
        self.values = [values[rows] for values in self.values]
        self.attend_bias, self.first_position = self.attend_bias[rows], self.first_position[rows]
        if self.rotary is not None:
            self.rotary = (self.rotary[0][rows], self.rotary[1][rows])
        self.rows = len(rows)

    @torch.no_grad()
    def next_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, V]`` for the token after ``token_ids[rows]``, the tokens chosen at this step."""
        if self.trial_key is not None:
            return self.trial_step(token_ids)
        return self.decode_step(token_ids)

    def trial_step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """A step of the packing trial (:func:`packing_pays`): the first plain and untimed (it warms the caches),
        the packing timed twice before the second, then :data:`TRIAL_STEPS` steps each timed, plain and packed in
        turn. After the last the times go to :data:`PACKING_TRIALS` (the fastest step each way, the faster packing),
        and the call keeps whichever products were faster."""
        plain, packed, packing = self.trial_seconds
        if self.step == 0:
            return self.decode_step(token_ids)
        if self.step == 1:  # packed twice: a process's first packing also pays for its first pages of memory
            for _ in range(2):
                self.trial_packs = {}  # freed first, so that the second packing reuses the memory, as later calls do
                started = time.perf_counter()
                self.trial_packs = packed_weights(self.model)
                packing.append(time.perf_counter() - started)
        self.packed = self.trial_packs if self.step % 2 == 0 else {}
        started = time.perf_counter()
        logits = self.decode_step(token_ids)
        (packed if self.packed else plain).append(time.perf_counter() - started)
        if self.step > TRIAL_STEPS:
            PACKING_TRIALS[self.trial_key] = PackingTrial(min(plain), min(packed), min(packing))
            self.packed = self.trial_packs if min(packed) < min(plain) else {}
            self.trial_key, self.trial_packs = None, {}
        return logits

    def decode_step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`next_logits` through this step's products (:meth:`linear`).

        One token per row, so the hidden states stay ``[rows, hidden]`` (no sequence dimension to view away around
        every product), and the queries of the heads that share a key-value head are that head's queries at one
        position: ``[rows, kv_heads, heads / kv_heads, head_dim]``, one SDPA without repeating keys for GQA."""
        base, rows, n = self.model.model, self.rows, self.prompt_length + self.step + 1
        x = embed(base.embed_tokens, token_ids)  # [rows, hidden]
        cos, sin = self.rotary_embedding(x)  # [rows, 1, 1, head_dim]
        for i, layer in enumerate(self.layers):
            attention, mlp = layer.self_attn, layer.mlp
            keys, values = self.keys[i], self.values[i]
            kv_heads = keys.shape[1]
            # [rows, heads, head_dim] each
            q, k, v = attention_inputs(attention, rms_norm(x, layer.input_layernorm), self.linear)
            keys[:, :, n - 1 : n] = rotate(k[:, :, None], cos, sin)
            values[:, :, n - 1 : n] = v[:, :, None]
            out = F.scaled_dot_product_attention(
                rotate(q.view(rows, kv_heads, -1, attention.head_dim), cos, sin),
                keys[:, :, :n],
                values[:, :, :n],
                attn_mask=self.attend_bias[..., :n],
                scale=attention.scaling,
            )
            x = x + self.linear(attention.o_proj, out.reshape(rows, -1))
            x = x + mlp_output(mlp, rms_norm(x, layer.post_attention_layernorm), self.linear)
        self.step += 1
        return self.linear(self.model.lm_head, rms_norm(x, base.norm))


def shared_prompt_logits(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    row_to_prompt: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits ``[N, V]`` of the rows' completion tokens, from one pass over the model's layers: position ``t`` of a row
    predicts its completion token ``t``; the positions run are each row's first ``lengths[r]`` (all ``T`` without
    ``lengths``), row after row (``N = sum(lengths)``; without ``lengths`` the logits view as ``[B, T, V]``). Row
    ``r`` continues prompt ``row_to_prompt[r]`` of the ``D`` distinct left-padded prompts ``[D, P]`` (``P >= 2``);
    ``completion_ids`` is ``[B, T]``.

    The training forward of :meth:`comarl.agents.Agent.completion_logprobs`, the same layers and operations as the
    model's forward (as :class:`LlamaDecoder`'s, for a model :func:`unsupported_reason` accepts) over two sets of
    tokens at once: each distinct prompt but its last token, once, its left padding left out, and each row's last
    prompt token and completion but its last token, up to its length. Every product runs once over both sets'
    tokens (the prompts' and ``N``); attention runs per set, laid out as ``[D, P - 1]`` and ``[B, max(lengths)]``
    with zeros where a token does not run: a prompt token attends to the prompt's earlier tokens, a row's token to
    its prompt's tokens (their keys and values gathered to the row) and the row's own earlier ones, the prompt's
    padding masked out. A position past a row's length reaches no logit that is asked for and, attention being causal, no earlier
    position: it is left out of every product. Gradients reach the shared prompt tokens from every row that attends to them, as through
    ``B`` copies. In the last layer the prompt tokens stop after their keys and values (their outputs reach no
    logit). Rotary embeddings come from one call of the model's ``rotary_emb`` at every position run (a 'dynamic'
    RoPE then rescales by the largest, as the model's forward over the rows up to the longest one does).
    """
    inner = causal_lm(model)
    base = inner.model
    D, P = prompt_ids.shape
    B, T = completion_ids.shape
    L = P - 1  # the prompt tokens that run once; the last one runs in each row, ahead of its completion
    positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
    keep = prompt_mask[:, :L].bool()
    # The positions of [D, L] and [B, T] that run, where some do not: the prompts' padding never does; a row's
    # positions up to its length where lengths are given, the columns up to the longest row's.
    prompt_runs = None if bool(keep.all()) else keep.flatten().nonzero().squeeze(1)
    runs = None
    if lengths is not None:
        T = max(1, int(lengths.max()))
        kept = (torch.arange(T, device=lengths.device) < lengths[:, None]).flatten()
        runs = None if bool(kept.all()) else kept.nonzero().squeeze(1)
    prompt_positions, prompt_tokens = positions[:, :L].reshape(-1), prompt_ids[:, :L].reshape(-1)
    row_positions = (positions[row_to_prompt, -1:] + torch.arange(T, device=positions.device)).reshape(-1)
    row_tokens = torch.cat([prompt_ids[row_to_prompt, -1:], completion_ids[:, : T - 1]], dim=1).reshape(-1)
    if prompt_runs is not None:
        prompt_positions, prompt_tokens = prompt_positions[prompt_runs], prompt_tokens[prompt_runs]
    if runs is not None:
        row_positions, row_tokens = row_positions[runs], row_tokens[runs]
    n, N = prompt_tokens.shape[0], row_tokens.shape[0]
    x = embed(base.embed_tokens, torch.cat([prompt_tokens, row_tokens]))
    cos, sin = base.rotary_emb(x, torch.cat([prompt_positions, row_positions])[None])
    cos, sin = cos[0, :, None], signed_sin(sin[0, :, None])  # [n + N, 1, head_dim]
    prompt_rotary, row_rotary = (cos[:n], sin[:n]), (cos[n:], sin[n:])
    # SDPA's boolean masks, True where a query may attend (padding queries attend to nothing: causal_prompt_mask).
    prompt_attends = causal_prompt_mask(prompt_mask[:, :L])
    own = torch.ones(T, T, dtype=torch.bool, device=keep.device).tril()
    row_attends = torch.cat(
        [keep[row_to_prompt, None, :].expand(B, T, L), own.expand(B, T, T)], dim=2
    ).unsqueeze(1)
    layers = base.layers[: inner.config.num_hidden_layers]
    for index, layer in enumerate(layers):
        attention = layer.self_attn
        # [n + N, heads, head_dim], split (not sliced twice: the backward of two slices adds two zero-filled
        # full-size gradients) into the prompts' and the rows' tokens, then laid out as [count, heads, width, head_dim]
        q, k, v = attention_inputs(attention, rms_norm(x, layer.input_layernorm))
        (prompt_q, row_q), (prompt_k, row_k), (prompt_v, row_v) = (t.split([n, N]) for t in (q, k, v))
        prompt_k = laid_out(rotate(prompt_k, *prompt_rotary), prompt_runs, D, L)
        prompt_v = laid_out(prompt_v, prompt_runs, D, L)
        row_out = F.scaled_dot_product_attention(
            laid_out(rotate(row_q, *row_rotary), runs, B, T),
            torch.cat([prompt_k[row_to_prompt], laid_out(rotate(row_k, *row_rotary), runs, B, T)], dim=2),
            torch.cat([prompt_v[row_to_prompt], laid_out(row_v, runs, B, T)], dim=2),
            attn_mask=row_attends,
            scale=attention.scaling,
            enable_gqa=True,
        )
        row_out = run_only(row_out, runs)
        if index == len(layers) - 1:
            # In the last layer the prompt tokens reach the logits only through their keys and values: their
            # attention, o_proj and MLP would be computed (and differentiated) for nothing.
            x = x[n:] + linear(attention.o_proj, row_out)
        else:
            prompt_out = F.scaled_dot_product_attention(
                laid_out(rotate(prompt_q, *prompt_rotary), prompt_runs, D, L),
                prompt_k,
                prompt_v,
                attn_mask=prompt_attends,
                scale=attention.scaling,
                enable_gqa=True,
            )
            x = x + linear(attention.o_proj, torch.cat([run_only(prompt_out, prompt_runs), row_out]))
        x = x + mlp_output(layer.mlp, rms_norm(x, layer.post_attention_layernorm))
    return linear(inner.lm_head, rms_norm(x, base.norm))
