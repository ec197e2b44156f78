"""Memory check: static training memory per device from the models' configs, checked before any weights load."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import comarl.memory
import comarl.trainers.magrpo
from comarl import ConfigError, MAGRPOConfig, MAGRPOTrainer, MAPPOConfig, MAPPOTrainer
from comarl.llama_decoder import packed_weights
from comarl.memory import (
    GIB,
    ModelSize,
    canonical_device,
    check_fits,
    device_identity,
    device_need,
    free_memory,
    keep_freed_memory,
    model_memory,
    model_size,
    sharing_devices,
    summary,
)

DATA = [{"prompt": p} for p in ("def add(a, b):", "the agents meet at")]


def reward(a, b):
    return [0.0] * len(a)


def args(**kw):
    return MAGRPOConfig(prompts_per_step=2, num_generations=2, max_new_tokens=4, progress_bar=False, **kw)


def test_model_memory_counts_fp32_weights_gradients_adamw_and_reference_by_hand():
    full = model_memory("agent 0", "cpu", ModelSize(1000, 1000), reference=True)
    assert (full.weights, full.gradients, full.optimizer, full.reference, full.total) == (
        4000,
        4000,
        8000,
        4000,
        20000,
    )
    lora = model_memory("agent 0", "cpu", ModelSize(1100, 100))
    assert (lora.weights, lora.gradients, lora.optimizer, lora.total) == (4400, 400, 800, 5600)
    # A second agent on a shared LoRA base holds only its adapters; frozen: no state.
    assert model_memory("agent 1", "cpu", ModelSize(1100, 100), owns_weights=False).total == 400 + 400 + 800
    # a frozen agent on a shared base: its adapters alone (they are its own, trained or not)
    assert model_memory("agent 1", "cpu", ModelSize(1100, 100), owns_weights=False, trains=False).total == 400
    assert model_memory("agent 1", "cpu", ModelSize(1000, 1000), trains=False).total == 4000
    # shard_optimizer over 3 data shards: each keeps a third of the AdamW state (rounded up)
    sharded = model_memory("agent 0", "cpu", ModelSize(1000, 1000), optimizer_shards=3)
    assert (sharded.optimizer, sharded.total) == (2667, 4000 + 4000 + 2667)
    # shard_weights over 3 data shards: a third of everything (rounded up), plus the whole weights gathered for
    # generation
    split = model_memory("agent 0", "cpu", ModelSize(1000, 1000), reference=True, weight_shards=3)
    assert (split.weights, split.gradients, split.optimizer, split.reference, split.gathered) == (
        1334,
        1334,
        2667,
        1334,
        4000,
    )
    assert split.total == 1334 * 3 + 2667 + 4000
    lora = model_memory("agent 0", "cpu", ModelSize(1100, 100), weight_shards=2)  # adapters: 100 trainable
    assert (lora.weights, lora.gradients, lora.optimizer, lora.gathered) == (2200, 200, 400, 4400)


def test_model_size_counts_without_loading_as_the_loaded_model_has(qwen_bpe):
    loaded = AutoModelForCausalLM.from_pretrained(qwen_bpe)
    # what generating on the CPU packs
    packed = sum(w.numel() for w in packed_weights(loaded.eval()).values())
    assert model_size(qwen_bpe) == ModelSize(*[sum(p.numel() for p in loaded.parameters())] * 2, packed)
    lora = model_size(qwen_bpe, (4, 8.0, "all-linear"))
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda a: [0.0] * len(a),
        args=args(lora_r=4),
    )
    model = trainer.team[0].model
    assert lora.parameters == sum(p.numel() for p in model.parameters())
    assert (
        lora.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad) < lora.parameters / 10
    )


def test_a_saved_lora_agent_counts_its_base_and_its_adapter(qwen_bpe, tmp_path):
    """A saved LoRA agent folder (adapter_config.json, no config.json) was not counted at all; it loads as its base
    with the saved adapter trainable, and is counted so, whatever lora_r says."""
    from comarl.agents import add_lora

    add_lora(AutoModelForCausalLM.from_pretrained(qwen_bpe), 4, 8.0, ["q_proj", "v_proj"]).save_pretrained(
        tmp_path
    )
    expected = model_size(qwen_bpe, (4, 8.0, ["q_proj", "v_proj"]))
    assert model_size(tmp_path) == model_size(tmp_path, (16, 32.0, "all-linear")) == expected
    assert expected.trainable < expected.parameters


def test_a_team_that_fits_is_told_its_numbers_when_training_starts(qwen_bpe, capsys):
    trainer = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=reward,
        args=MAGRPOConfig(prompts_per_step=2, num_generations=2, max_new_tokens=2, max_steps=1),
    )
    need = 2 * 16 * model_size(qwen_bpe).parameters / 2**20
    assert trainer.memory_summary.startswith(
        f"static training memory (before activations): cpu {need:.0f} MiB of "
    )
    assert trainer.memory_summary.endswith(" GiB free")
    trainer.train()
    assert trainer.memory_summary in capsys.readouterr().out


def test_running_out_of_memory_in_a_step_names_the_fields_to_turn_down(qwen_bpe, monkeypatch):
    """The check counts static memory only: a step whose activations do not fit gets torch's error with the fixes."""
    trainer = MAGRPOTrainer(model=qwen_bpe, num_agents=2, train_dataset=DATA, reward_func=reward, args=args())

    def too_big(items, seeds):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(trainer, "training_step", too_big)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        trainer.train()
    assert str(raised.value).startswith(
        "CUDA out of memory. Tried to allocate 20.00 GiB\ncomarl: a training step ran out of device memory "
    )
    for field in ("micro_batch_tokens", "prompts_per_step x num_generations", "gradient_checkpointing=True"):
        assert field in str(raised.value)


def test_check_fits_names_the_device_the_numbers_and_the_fixes():
    plan = [
        model_memory("agent 0", "cuda:0", ModelSize(GIB, GIB), reference=True),  # 20 GiB
        model_memory("agent 1", "cuda:0", ModelSize(GIB, GIB)),  # 16 GiB
        model_memory("agent 2", "cuda:1", ModelSize(GIB, GIB)),
    ]
    check_fits(plan, {"cuda:0": 36 * GIB, "cuda:1": None}, ["beta=0"])  # fits exactly; cuda:1 unknown
    with pytest.raises(ConfigError) as e:
        check_fits(plan, {"cuda:0": 30 * GIB, "cuda:1": 100 * GIB}, ["beta=0", "lora_r=16"])
    assert str(e.value) == (
        "the team does not fit on cuda:0: it needs at least 36.0 GiB there before activations (agent 0: weights 4.0, "
        "gradients 4.0, AdamW states 8.0, KL reference 4.0; agent 1: weights 4.0, gradients 4.0, AdamW states 8.0, "
        "KL reference 0.0; in GiB), and cuda:0 has 30.0 GiB free. Fixes: beta=0; lora_r=16; or check_memory=False "
        "to skip this check"
    )


def huge_model_dir(tmp_path):
    """A folder with only the config of a ~15 B-parameter Qwen2 model: no weights, no tokenizer."""
    config = dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=16,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_team_that_cannot_fit_stops_before_loading_with_the_numbers(tmp_path):
    path = huge_model_dir(tmp_path)
    P = model_size(path).parameters
    assert 14e9 < P < 16e9
    with pytest.raises(ConfigError) as e:  # loading would fail: the folder has no weights and no tokenizer
        MAGRPOTrainer(model=path, num_agents=2, train_dataset=DATA, reward_func=reward, args=args(beta=0.05))
    message = str(e.value)
    assert message.startswith(f"the team does not fit on cpu: it needs at least {2 * 20 * P / GIB:.1f} GiB")
    assert (
        f"agent 1: weights {4 * P / GIB:.1f}, gradients {4 * P / GIB:.1f}, AdamW states {8 * P / GIB:.1f}"
        in message
    )
    assert "lora_r=16" in message and "beta=0 (no KL reference copy; now beta=0.05)" in message
    assert "lora_shared_base=True" in message
    # Switched off, the trainer goes on to load the model and fails there.
    with pytest.raises(OSError):
        MAGRPOTrainer(
            model=path, num_agents=2, train_dataset=DATA, reward_func=reward, args=args(check_memory=False)
        )


def plan_of(trainer_class, path, config, num_agents=2):
    trainer = trainer_class(
        model=path, num_agents=num_agents, train_dataset=DATA, reward_func=reward, args=config
    )
    return {m.name: m for m in trainer._memory_plan([path] * num_agents, ["cpu"] * num_agents)}, trainer


def test_the_plan_follows_lora_shared_bases_frozen_agents_and_critics(qwen_bpe):
    full = model_size(qwen_bpe)
    plan, trainer = plan_of(MAGRPOTrainer, qwen_bpe, args(beta=0.1, frozen_agents=[1]))
    # the frozen agent also holds the weights its CPU decode step packs, which no freed gradients make room for
    assert plan["agent 0"].total == 20 * full.parameters
    assert plan["agent 1"].total == 4 * full.parameters + 4 * full.packed
    assert trainer.references[0] is not None and trainer.references[1] is None  # as planned

    lora = model_size(qwen_bpe, (4, 32.0, "all-linear"))
    # 'all-linear' leaves the LM head plain; its packed copy counts beyond the adapters' gradients
    assert lora.packed == trainer.team[0].model.lm_head.weight.numel()
    packed = max(0, 4 * lora.packed - 4 * lora.trainable)
    plan, trainer = plan_of(MAGRPOTrainer, qwen_bpe, args(lora_r=4, lora_shared_base=True, beta=0.1))
    assert (
        plan["agent 0"].total == 4 * lora.parameters + 12 * lora.trainable + packed
    )  # the reference is the base: no copy
    assert plan["agent 1"].total == 16 * lora.trainable + packed
    held = {p.data_ptr(): p.numel() for a in trainer.team for p in a.model.get_base_model().parameters()}
    assert sum(held.values()) == lora.parameters + lora.trainable  # one base and both adapters, as planned

    # a frozen agent on the shared base holds its own adapters (4 T), which the plan left out
    plan, trainer = plan_of(MAGRPOTrainer, qwen_bpe, args(lora_r=4, lora_shared_base=True, frozen_agents=[1]))
    assert plan["agent 0"].total == 4 * lora.parameters + 12 * lora.trainable + packed
    assert plan["agent 1"].total == 4 * lora.trainable + 4 * lora.packed

    plan, _ = plan_of(MAGRPOTrainer, qwen_bpe, args(share_weights=True))
    assert plan["agent 0"].total == 16 * full.parameters and set(plan) == {"agent 0"}

    ppo = MAPPOConfig(prompts_per_step=2, num_generations=2, max_new_tokens=4, progress_bar=False)
    plan, trainer = plan_of(MAPPOTrainer, qwen_bpe, ppo)
    backbone = sum(p.numel() for p in trainer.critics[0].model.parameters())
    assert plan["centralized critic"].total == 16 * backbone
    assert set(plan) == {"agent 0", "agent 1", "centralized critic"}


def test_a_config_that_cannot_be_read_here_is_not_counted(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    assert model_size(tmp_path) is None and model_size(tmp_path / "missing") is None
    with pytest.raises(ValueError, match="no-such-architecture"):  # loading, not the check, reports it
        MAGRPOTrainer(model=str(tmp_path), num_agents=2, train_dataset=DATA, reward_func=reward, args=args())


def test_model_objects_are_not_planned(qwen_bpe):
    model = AutoModelForCausalLM.from_pretrained(qwen_bpe)
    trainer = MAGRPOTrainer(
        model=model,
        num_agents=1,
        tokenizer=qwen_bpe,
        train_dataset=DATA,
        reward_func=lambda a: [0.0] * len(a),
        args=args(),
    )
    assert trainer._memory_plan([model], ["cpu"]) == []
    assert torch.equal(next(trainer.team[0].model.parameters()), next(model.parameters()))


def test_data_shards_are_told_to_shard_the_optimizer_and_the_plan_counts_the_shares(qwen_bpe):
    """Under data parallelism over D processes (stood in for here: the plan and the fixes read only the shard
    count), a team that does not fit is told about shard_weights and shard_optimizer; with shard_weights each
    process plans 1/D of every agent plus its whole weights for generation, with shard_optimizer 1/D of AdamW."""
    plan, trainer = plan_of(MAGRPOTrainer, qwen_bpe, args())
    trainer.data = SimpleNamespace(world_size=4)
    fixes = trainer._memory_fixes([qwen_bpe] * 2, ["cpu"] * 2)
    assert "shard_optimizer=True (each of the 4 data shards keeps 1/4 of every AdamW state)" in fixes
    assert (
        "shard_weights=True (each of the 4 data shards keeps 1/4 of every agent's weights, gradients and AdamW "
        "states)" in fixes
    )
    trainer.args.shard_weights = True  # the plan splits every agent four ways
    assert not any("shard_" in f for f in trainer._memory_fixes([qwen_bpe] * 2, ["cpu"] * 2))
    split = {m.name: m for m in trainer._memory_plan([qwen_bpe] * 2, ["cpu"] * 2)}
    size = model_size(qwen_bpe)
    assert (split["agent 0"].weights, split["agent 0"].optimizer, split["agent 0"].gathered) == (
        -(-4 * size.parameters // 4),
        -(-8 * size.trainable // 4),
        4 * size.parameters,
    )
    trainer.args.shard_weights = False
    trainer.args.shard_optimizer = True
    assert not any("shard_optimizer" in f for f in trainer._memory_fixes([qwen_bpe] * 2, ["cpu"] * 2))
    sharded = {m.name: m for m in trainer._memory_plan([qwen_bpe] * 2, ["cpu"] * 2)}
    trainable = model_size(qwen_bpe).trainable
    assert plan["agent 0"].optimizer == 8 * trainable
    assert sharded["agent 0"].optimizer == -(-8 * trainable // 4)


def test_bf16_counts_the_weight_copies_autocast_keeps():
    """Autocast caches a bf16 copy (2 bytes) of every weight that requires gradients: all of a fully fine-tuned
    or frozen model's, a LoRA model's adapters only (on a shared base too, trained or not)."""
    assert model_memory("agent 0", "cpu", ModelSize(1000, 1000), bf16=True).autocast == 2000
    assert model_memory("agent 0", "cpu", ModelSize(1000, 1000), bf16=True).total == 16000 + 2000
    assert model_memory("agent 0", "cpu", ModelSize(1000, 1000), trains=False, bf16=True).total == 4000 + 2000
    assert model_memory("agent 0", "cpu", ModelSize(1100, 100), bf16=True).autocast == 200
    assert model_memory("agent 1", "cpu", ModelSize(1100, 100), owns_weights=False, bf16=True).autocast == 200
    frozen = model_memory("agent 1", "cpu", ModelSize(1100, 100), owns_weights=False, trains=False, bf16=True)
    assert (frozen.weights, frozen.autocast, frozen.total) == (400, 200, 600)
    assert model_memory("agent 0", "cpu", ModelSize(1000, 1000)).autocast == 0  # fp32
    # shard_weights: FSDP2 gathers whole weights that require gradients, and autocast caches whole casts
    assert model_memory("agent 0", "cpu", ModelSize(1000, 1000), weight_shards=2, bf16=True).autocast == 2000


def test_weights_packed_for_cpu_generation_count_what_exceeds_the_freed_gradients():
    """On the CPU in fp32 the decode step holds a packed copy of the projection weights (900 parameters here) while
    it generates, after the optimizer step freed the gradients: a full fine-tune needs nothing more, a LoRA agent
    the copy less its adapters' gradients, a frozen agent all of it; none under bf16, split, or off the CPU."""
    full = model_memory("agent 0", "cpu", ModelSize(1000, 1000, 900), generates_on_cpu=True)
    assert (full.packed, full.total) == (0, 16000)
    lora = model_memory("agent 0", "cpu", ModelSize(1100, 100, 900), generates_on_cpu=True)
    assert (lora.packed, lora.total) == (3600 - 400, 4400 + 400 + 800 + 3200)
    frozen = model_memory("agent 1", "cpu", ModelSize(1000, 1000, 900), trains=False, generates_on_cpu=True)
    assert (frozen.packed, frozen.total) == (3600, 4000 + 3600)
    for settings in ({"bf16": True}, {"weight_shards": 2}, {"generates_on_cpu": False}):
        kept = {"generates_on_cpu": True, **settings}
        assert model_memory("agent 1", "cpu", ModelSize(1000, 1000, 900), trains=False, **kept).packed == 0
    # two agents of one process generate in turn: the larger copy counts once
    assert device_need([lora, frozen]) == 5600 + 4000 + 3600
    with pytest.raises(ConfigError, match="agent 1: .*, packed weights while generating 0.0"):
        check_fits([lora, frozen], {"cpu": 1000}, [])


def test_the_trainer_plans_packed_weights_for_agents_that_generate_on_the_cpu(qwen_bpe):
    packed = model_size(qwen_bpe).packed
    plan, _ = plan_of(MAGRPOTrainer, qwen_bpe, args(frozen_agents=[1]))
    # the learner's freed gradients make room for its copy; the frozen agent holds all of its own
    assert (plan["agent 0"].packed, plan["agent 1"].packed) == (0, 4 * packed)
    plan, _ = plan_of(MAGRPOTrainer, qwen_bpe, args(frozen_agents=[1], bf16=True))
    assert plan["agent 1"].packed == 0


def test_copies_held_while_a_model_runs_count_once_per_process_on_a_device():
    """Two bf16 agents of one process on one GPU take turns: one agent's autocast casts (2 GiB here) at a time, not
    both; an agent of another process on the same GPU runs at the same time, so its casts add up."""
    agent = ModelSize(GIB, GIB)  # 16 GiB static, 2 GiB of casts
    one_process = [model_memory(f"agent {i}", "cuda:0", agent, bf16=True) for i in range(2)]
    assert device_need(one_process) == 32 * GIB + 2 * GIB
    check_fits(one_process, {"cuda:0": 34 * GIB}, [])  # fits exactly (the sum of totals, 36 GiB, did not)
    parts = [[("gpu A", m)] for m in one_process]  # the same agents, one process each
    assert device_need(sharing_devices(parts, rank=0)) == 32 * GIB + 2 * 2 * GIB


def test_the_trainer_plans_autocast_copies_under_bf16(qwen_bpe):
    plan, _ = plan_of(MAGRPOTrainer, qwen_bpe, args(bf16=True))
    assert plan["agent 0"].autocast == 2 * model_size(qwen_bpe).parameters
    plan, _ = plan_of(MAGRPOTrainer, qwen_bpe, args(agent_settings=[{}, {"bf16": True}]))
    assert (plan["agent 0"].autocast, plan["agent 1"].autocast) == (0, 2 * model_size(qwen_bpe).parameters)
    # one model in both roles: its holder counts the casts that agent 1's bf16 forwards make of the shared weights
    plan, _ = plan_of(MAGRPOTrainer, qwen_bpe, args(share_weights=True, agent_settings=[{}, {"bf16": True}]))
    assert plan["agent 0"].autocast == 2 * model_size(qwen_bpe).parameters and set(plan) == {"agent 0"}


def test_processes_sharing_a_device_check_all_its_models():
    """Two processes put an agent each on one GPU, which the second numbers cuda:1 (its own CUDA_VISIBLE_DEVICES);
    a third uses another GPU. Each of the first two checks both agents (each alone fits in 20 GiB, together they
    do not), the other's named by its process and on this process's name of the GPU."""
    agent = ModelSize(GIB, GIB)  # 16 GiB to train
    parts = [
        [("gpu A", model_memory("agent 0", "cuda:0", agent))],
        [("gpu A", model_memory("agent 1", "cuda:1", agent))],
        [("gpu B", model_memory("agent 0", "cuda:0", agent))],
    ]
    seen = sharing_devices(parts, rank=1)
    assert [(m.name, m.device) for m in seen] == [("agent 0 (process 0)", "cuda:1"), ("agent 1", "cuda:1")]
    assert sharing_devices(parts, rank=2) == [dataclasses.replace(parts[2][0][1], process=2)]
    assert [m.process for m in seen] == [0, 1]
    check_fits([parts[1][0][1]], {"cuda:1": 20 * GIB}, [])  # alone it fits
    with pytest.raises(
        ConfigError,
        match=r"the team does not fit on cuda:1: it needs at least 32.0 GiB .*agent 0 \(process 0\): weights 4.0",
    ):
        check_fits(seen, {"cuda:1": 20 * GIB}, [])
    assert device_identity("cpu") == f"{socket.gethostname()} cpu"


class _Processes:
    """Two processes on this machine (stood in for): the other one plans ``theirs`` and reports ``their_error``."""

    rank = 0

    def __init__(self, theirs, their_error=None):
        self.theirs, self.their_error = theirs, their_error

    def gather(self, mine):
        if isinstance(mine, list):  # the plans
            return [mine, [(device_identity(m.device), m) for m in self.theirs]]
        return [mine, self.their_error]  # the outcomes


def test_the_trainer_checks_what_every_process_puts_on_its_devices(qwen_bpe):
    """The trainer gathers every process's plan: a second process planning a model larger than this machine's
    memory stops this one too, named; a process that fits stops when another process's check failed."""
    _, trainer = plan_of(MAGRPOTrainer, qwen_bpe, args())
    huge = model_memory("agent 1", "cpu", ModelSize(2**40, 2**40))
    trainer.processes = _Processes([huge])
    with pytest.raises(
        ConfigError, match=r"the team does not fit on cpu: .*agent 1 \(process 1\): weights 4096.0"
    ):
        trainer._check_memory([qwen_bpe] * 2, ["cpu"] * 2)
    trainer.processes = _Processes([], their_error="the team does not fit on cuda:0: ...")
    with pytest.raises(ConfigError, match=r"^process 1: the team does not fit on cuda:0: \.\.\.$"):
        trainer._check_memory([qwen_bpe] * 2, ["cpu"] * 2)
    trainer.processes = _Processes([])
    assert trainer._check_memory([qwen_bpe] * 2, ["cpu"] * 2).startswith(
        "static training memory (before activations): cpu "
    )


def test_two_names_of_one_memory_are_checked_together_and_fixes_fit_the_settings(tmp_path):
    """'cpu' and 'cpu:0' are one memory: both agents count against it (each was checked alone, so a team that
    could not fit went on to load). The fixes offered are ones the config accepts: MADPO drops its reference
    through its own settings (beta is 0 there already), and one shared base is not offered again."""
    from comarl import MADPOConfig, MADPOTrainer

    path = huge_model_dir(tmp_path)
    P = model_size(path).parameters
    with pytest.raises(ConfigError, match=r"^the team does not fit on cpu: it needs at least") as e:
        MAGRPOTrainer(
            model=path, num_agents=2, train_dataset=DATA, reward_func=reward,
            args=args(agent_devices=["cpu", "cpu:0"]),
        )  # fmt: skip
    assert f"{2 * 16 * P / GIB:.1f} GiB" in str(e.value)
    with pytest.raises(ConfigError) as e:
        MADPOTrainer(
            model=path, num_agents=2, train_dataset=DATA, reward_func=reward,
            args=MADPOConfig(
                prompts_per_step=2, num_generations=2, max_new_tokens=4, progress_bar=False,
                candidates_from="current",
            ),
        )  # fmt: skip
    assert "candidates_from='initial'" in str(e.value) and "beta=0" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        MAGRPOTrainer(
            model=path, num_agents=2, train_dataset=DATA, reward_func=reward,
            args=args(lora_r=4, lora_shared_base=True),
        )  # fmt: skip
    assert "lora_shared_base=True with" not in str(e.value)


def tiny_config_dir(path, tied):
    """A folder with only the config of a one-layer Qwen2 model small enough to count by hand."""
    config = dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        vocab_size=100,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_model_size_counts_a_tiny_config_by_hand_with_and_without_its_lm_head(tmp_path, monkeypatch):
    """A critic or reward model loads the bare backbone (lm_head=False): an untied LM head is not part of it, a tied
    one is the embeddings; LoRA adds its adapters, which alone train. The decode step packs the weights of the plain
    projections and the LM head (tied or not: the packed copy is its own), not a LoRA layer's; a backbone decodes
    nothing."""
    # embeddings 100 x 8 = 800; q 8 x 8 + 8 = 72; k, v 8 x 4 + 4 = 36 each; o 8 x 8 = 64;
    # MLP 3 x 8 x 16 = 384; two layer norms 8 + 8, final norm 8: backbone 1416; an untied LM head adds 100 x 8 = 800
    # packed: the weights q 64, k 32, v 32, o 64, MLP 384 and the LM head's 800 = 1376
    untied = tiny_config_dir(tmp_path / "untied", tied=False)
    assert model_size(untied) == ModelSize(2216, 2216, 1376)
    assert model_size(untied, lm_head=False) == ModelSize(1416, 1416, 0)
    assert model_size(untied, (2, 8.0, ["q_proj"])) == ModelSize(2216 + 32, 32, 1376 - 64)  # A 2 x 8, B 8 x 2
    tied = tiny_config_dir(tmp_path / "tied", tied=True)
    assert model_size(tied) == ModelSize(1416, 1416, 1376)
    assert model_size(tied, lm_head=False) == ModelSize(1416, 1416, 0)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # no packing on this machine: nothing packed
    assert model_size(untied) == ModelSize(2216, 2216, 0)


def test_lora_target_modules_that_match_nothing_stop_the_count(tmp_path):
    """The count re-raises the ConfigError of lora_target_modules that adapt nothing, so the run stops before any
    weights load, instead of skipping the model as one it cannot count."""
    with pytest.raises(ConfigError, match=r"^lora_target_modules=\['no_such_module'\]: no module of"):
        model_size(tiny_config_dir(tmp_path / "m", tied=False), (4, 8.0, ["no_such_module"]))


def test_the_kl_reference_copies_every_parameter():
    """The KL reference is a frozen copy of the whole model: 4 bytes per parameter, not per trainable one."""
    assert model_memory("agent 0", "cpu", ModelSize(1100, 100), reference=True).reference == 4400


def test_whole_weights_gathered_for_generation_count_once_per_process():
    """Under shard_weights over 4 shards an agent of 2**30 parameters keeps a quarter of its 16 bytes per parameter
    (4 GiB) and gathers its whole fp32 weights (4 GiB) to generate; the agents of one process gather in turn."""
    split = [model_memory(f"agent {i}", "cuda:0", ModelSize(GIB, GIB), weight_shards=4) for i in range(2)]
    assert device_need(split[:1]) == 4 * GIB + 4 * GIB
    assert device_need(split) == 2 * 4 * GIB + 4 * GIB
    # under bf16 the casts of the gathered weights (2 GiB) come with them
    bf16 = [
        model_memory(f"agent {i}", "cuda:0", ModelSize(GIB, GIB), weight_shards=4, bf16=True)
        for i in range(2)
    ]
    assert device_need(bf16) == 2 * 4 * GIB + 4 * GIB + 2 * GIB


def test_summary_gives_each_devices_need_and_free_memory():
    """The line printed when training starts: each device's static need (GiB, MiB below a tenth of a GiB) and free
    memory, the casts of one process's agents counted once."""
    plan = [
        model_memory("agent 0", "cuda:0", ModelSize(GIB, GIB), bf16=True),  # 16 GiB + 2 GiB of casts
        model_memory("agent 1", "cuda:0", ModelSize(GIB, GIB), bf16=True),
        model_memory("agent 2", "cuda:1", ModelSize(2**25, 2**25)),  # 16 x 2**25 bytes = 0.5 GiB
        model_memory("agent 3", "cpu", ModelSize(2**20, 2**20)),  # 16 MiB
    ]
    free = {"cuda:0": 40 * GIB, "cuda:1": 79 * GIB // 2, "cpu": None}
    assert summary(plan, free) == (
        "static training memory (before activations): cuda:0 34.0 GiB of 40.0 GiB free, "
        "cuda:1 0.5 GiB of 39.5 GiB free, cpu 16 MiB"
    )


def test_canonical_device_names_the_current_gpu_and_one_cpu(monkeypatch):
    """'cuda' is the current GPU, which need not be GPU 0 (torch.cuda.set_device), and every CPU name is 'cpu'."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert canonical_device("cuda") == "cuda:3"
    assert canonical_device("cuda:1") == "cuda:1"
    assert canonical_device("cpu:0") == canonical_device("cpu") == "cpu"


def test_free_memory_reads_cudas_free_bytes_and_the_hosts_available_memory(monkeypatch, tmp_path):
    """A GPU's free memory is the first of mem_get_info's (free, total); the CPU's is /proc/meminfo's MemAvailable
    (in KiB), not MemFree, which leaves out the page cache the kernel gives back."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * GIB, 80 * GIB))
    assert free_memory("cuda:0") == 5 * GIB
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       16000000 kB\nMemFree:          100000 kB\nMemAvailable:    8000000 kB\n"
    )
    monkeypatch.setattr(
        comarl.memory, "Path", lambda path: meminfo if path == "/proc/meminfo" else Path(path)
    )
    assert free_memory("cpu") == 8000000 * 1024


def test_a_gpu_is_identified_across_processes_by_its_uuid(monkeypatch):
    """Processes may number one GPU differently (CUDA_VISIBLE_DEVICES): its UUID names it for all of them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-1234"))
    assert device_identity("cuda:1") == "gpu GPU-1234"


# A fresh process allocates and frees a 24 MiB block through glibc's malloc and reports, from mallinfo2, the bytes
# that came from mmap while it lived and the bytes the heap still holds once it is freed.
MALLOC_PROBE = """
import ctypes, sys
from comarl.memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "kept":
    assert keep_freed_memory()
before = libc.mallinfo2()
block = libc.malloc(24 * 2**20)
during = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(during.hblkhd - before.hblkhd, after.arena - before.arena)
"""


def _glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):
        return False


@pytest.mark.skipif(not _glibc(), reason="keep_freed_memory sets glibc's malloc; elsewhere it does nothing")
def test_keep_freed_memory_serves_blocks_from_the_heap_and_keeps_them_when_freed():
    def probe(mode: str) -> tuple[int, int]:
        run = subprocess.run(
            [sys.executable, "-c", MALLOC_PROBE, mode], capture_output=True, text=True, check=True
        )
        mmapped, held = map(int, run.stdout.split())
        return mmapped, held

    # glibc's default: a block above 128 KiB gets pages of its own (mmap), unmapped when freed.
    mmapped, held = probe("default")
    assert mmapped >= 24 * 2**20 and held < 2**20
    # Kept: the block comes from the heap (below the 32 MiB mmap threshold), and the heap keeps its pages once it
    # is freed (below the 1 GiB trim threshold), for the next block to reuse without page faults.
    mmapped, held = probe("kept")
    # (Most of it: the heap may have had some free space at its top before.)
    assert mmapped == 0 and held > 16 * 2**20


def test_keep_freed_memory_does_nothing_without_glibc(monkeypatch):
    def no_such_name(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    def no_libc(*args, **kwargs):
        raise AssertionError("mallopt called without glibc")

    monkeypatch.setattr(comarl.memory.os, "confstr", no_such_name)
    monkeypatch.setattr(comarl.memory.ctypes, "CDLL", no_libc)
    assert keep_freed_memory() is False
    monkeypatch.setattr(comarl.memory.os, "confstr", lambda name: "musl libc")
    assert keep_freed_memory() is False


@pytest.mark.parametrize("keep", [True, False])
def test_the_trainer_keeps_freed_memory_when_an_agent_trains_on_the_cpu(qwen_bpe, monkeypatch, keep):
    calls = []
    monkeypatch.setattr(comarl.trainers.magrpo, "keep_freed_memory", lambda: calls.append(1) or True)
    MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=2,
        train_dataset=DATA,
        reward_func=reward,
        args=args(keep_freed_memory=keep),
    )
    assert calls == ([1] if keep else [])
