"""Checkpoints: a run stopped after its last checkpoint and resumed ends exactly where an unbroken run ends."""

from __future__ import annotations

import json

import pytest
import torch

import comarl
from comarl import ConfigError, MAGRPOConfig, MAGRPOTrainer

DATA = [{"prompt": p} for p in ("def add(a, b):", "the agents meet at", "alice and bob", "return a + b")]


class LengthReward:
    """Shared reward that varies between samples; raises on call ``crash_at`` to stop a run midway."""

    __name__ = "length_reward"

    def __init__(self, crash_at: int | None = None) -> None:
        self.calls, self.crash_at = 0, crash_at

    def __call__(self, a, b):
        self.calls += 1
        if self.calls == self.crash_at:
            raise RuntimeError("the machine went away")
        return [len(x) / 10 - len(y) / 20 for x, y in zip(a, b)]


def _next_turn(item, completions, history):
    """A transition for multi-turn runs: each agent's next prompt quotes its last answer."""
    return [f"turn {len(history.responses[0]) + 1}: {c[:8]}" for c in completions]


def _trainer(name, model, out, reward, **overrides):
    settings = dict(
        prompts_per_step=2,
        num_generations=3,
        max_new_tokens=5,
        learning_rate=1e-3,
        max_steps=5,
        save_steps=2,
        progress_bar=False,
        reward_call="batched",
        output_dir=str(out),
        seed=11,
    )
    settings.update(overrides)
    return getattr(comarl, f"{name}Trainer")(
        model=model,
        num_agents=2,
        train_dataset=DATA,
        eval_dataset=DATA[:2] if settings.get("eval_interval") else None,
        reward_func=reward,
        transition=_next_turn if settings.get("num_turns", 1) > 1 else None,
        args=getattr(comarl, f"{name}Config")(**settings),
    )


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _weights(trainer):
    return [p.detach().clone() for a in trainer.team for p in a.model.parameters()]


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("MAGRPO", {"beta": 0.05, "lr_scheduler_type": "cosine", "warmup_steps": 1}),
        ("IPPO", {"num_iterations": 2, "num_mini_batches": 2}),
        ("MAGRPO", {"lora_r": 4, "beta": 0.05}),  # LoRA adapters, the reference = adapters off
        ("MAGRPO", {"lora_r": 4, "lora_shared_base": True}),  # one base, an adapter per agent
        ("MADPO", {"candidates_from": "current", "pair_selection": "random"}),  # + the pair stream
        # one model, one optimizer and one reference for both agents; PPO's old log-probs
        ("MAGRPO", {"share_weights": True, "beta": 0.05, "num_iterations": 2}),
        # a critic model, its optimizer and shuffle stream; two turns
        ("MAAC", {"num_turns": 2, "num_generations": 2}),
        # sampled evaluations between the steps; turns of 2 steps, the learner's schedule decaying over its own
        ("MAGRPO", {"alternate_agents_every": 2, "lr_scheduler_type": "linear", "eval_interval": 1}),
        # a frozen agent's weights are not kept: they come from its source again
        ("MAGRPO", {"frozen_agents": [1], "beta": 0.05}),
    ],
)
def test_resumed_run_equals_the_unbroken_run(qwen_bpe, tmp_path, name, overrides):
    overrides = {**overrides, "eval_do_sample": True} if overrides.get("eval_interval") else overrides
    unbroken = _trainer(name, qwen_bpe, tmp_path / "a", LengthReward(), **overrides)
    expected = unbroken.train()

    # one reward call per turn and one per evaluation: the run dies in step 4
    crash_at = 3 * (overrides.get("num_turns", 1) + bool(overrides.get("eval_interval"))) + 1
    stopped = _trainer(name, qwen_bpe, tmp_path / "b", LengthReward(crash_at=crash_at), **overrides)
    with pytest.raises(Exception, match="the machine went away"):
        stopped.train()  # steps 1-3 done, checkpoint at step 2, the run dies in step 4
    assert [p.name for p in (tmp_path / "b" / "checkpoints").iterdir()] == ["step_2"]

    resumed = _trainer(name, qwen_bpe, tmp_path / "b", LengthReward(), **overrides)
    metrics = resumed.train(resume_from_checkpoint=True)
    assert all(torch.equal(x, y) for x, y in zip(_weights(unbroken), _weights(resumed)))
    for key in ("reward", "agent_0/loss", "agent_1/grad_norm", "agent_1/lr"):
        if key in expected:  # (alternating agents: agent 0 learns at step 5)
            assert metrics[key] == expected[key], key
    if name == "IPPO":
        for head_a, head_b in zip(unbroken.value_heads, resumed.value_heads):
            assert torch.equal(head_a.linear.weight, head_b.linear.weight)
    if name == "MAAC":
        critics = unbroken.critics[0].parameters(), resumed.critics[0].parameters()
        assert all(torch.equal(x, y) for x, y in zip(*critics))
    # The log holds each step once: the row of step 3 written before the crash was redone, not repeated; every row
    # and every logged completion equals the unbroken run's.
    logs = [
        [{k: v for k, v in row.items() if not k.startswith(("time/", "completions_per_s"))} for row in rows]
        for rows in (_rows(tmp_path / run / "metrics.jsonl") for run in ("a", "b"))
    ]
    assert [row["step"] for row in logs[1] if "reward" in row] == [1, 2, 3, 4, 5]
    assert logs[0] == logs[1]
    assert _rows(tmp_path / "a" / "samples.jsonl") == _rows(tmp_path / "b" / "samples.jsonl")
    if "lora_r" in overrides:  # a LoRA agent's checkpoint keeps its adapters, not the frozen base
        saved = torch.load(tmp_path / "b" / "checkpoints" / "step_2" / "process_0.pt", weights_only=False)
        names = [name for part in saved["trainer"]["agents"].values() for name in part["model"]]
        assert names and all(".lora_" in name for name in names)
    if "frozen_agents" in overrides:  # never changed, so not kept (a 3 B frozen agent: 12 GB per checkpoint)
        saved = torch.load(tmp_path / "b" / "checkpoints" / "step_2" / "process_0.pt", weights_only=False)
        assert saved["trainer"]["agents"][1]["model"] is None and saved["trainer"]["agents"][0]["model"]
    # save_total_limit=2 keeps the newest two
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step_2", "step_4"]


def test_resume_errors_name_the_problem(qwen_bpe, tmp_path):
    fresh = _trainer("MAGRPO", qwen_bpe, tmp_path / "none", LengthReward())
    with pytest.raises(
        ConfigError, match=r"resume_from_checkpoint=True: no finished checkpoint in .*none/checkpoints"
    ):
        fresh.train(resume_from_checkpoint=True)
    done = _trainer("MAGRPO", qwen_bpe, tmp_path / "run", LengthReward(), max_steps=2)
    done.train()
    other = MAGRPOTrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda a: [len(x) for x in a],
        args=MAGRPOConfig(max_steps=2, prompts_per_step=2, num_generations=2, progress_bar=False),
    )
    with pytest.raises(ConfigError, match=r"the checkpoint has num_agents=2, this run num_agents=1"):
        other.train(resume_from_checkpoint=tmp_path / "run" / "checkpoints" / "step_2")
    with pytest.raises(ConfigError, match=r"save_steps=2: checkpoints go into output_dir; set output_dir="):
        MAGRPOConfig(save_steps=2)


def test_a_model_folder_that_moved_still_resumes(qwen_bpe, tmp_path):
    """A cluster job's model folder lies elsewhere in the next job: the same config and weight files are the same
    model (the sources are compared by path first, then by the folders' contents)."""
    import shutil

    first, moved = tmp_path / "scratch-1" / "model", tmp_path / "scratch-2" / "model"
    shutil.copytree(qwen_bpe, first)
    _trainer("MAGRPO", str(first), tmp_path / "run", LengthReward(), max_steps=2, lora_r=4).train()
    shutil.move(first, moved)
    resumed = _trainer("MAGRPO", str(moved), tmp_path / "run", LengthReward(), max_steps=3, lora_r=4)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.step == 3


def test_resume_with_settings_that_shape_the_state_stops_naming_them(qwen_bpe, llama_word, tmp_path):
    """A resumed run that would load the state into another model, another kind of model or another data order
    stops with the setting to restore (before: torch's key errors, or silently wrong weights and data)."""
    _trainer("MAGRPO", qwen_bpe, tmp_path, LengthReward(), max_steps=2, lora_r=4).train()
    changes = [
        (
            {"lora_r": 8},
            r"the checkpoint was written with lora_r=4, this run has lora_r=8; resume with the same lora_r",
        ),
        ({"lora_r": 4, "share_weights": True}, r"share_weights=False, this run has share_weights=True"),
        ({"lora_r": 4, "prompts_per_step": 1}, r"prompts_per_step=2, this run has prompts_per_step=1"),
        # The saved optimizer and schedule would put the old rate back: a changed one was silently ignored.
        (
            {"lora_r": 4, "learning_rate": 1e-4},
            r"^resume_from_checkpoint: agent 0's optimizer was saved with lr=0.001, this run has 0.0001; resume "
            r"with the same learning_rate \(critic_learning_rate, reward_learning_rate, agent_settings\)",
        ),
        (
            {"lora_r": 4, "weight_decay": 0.1},
            r"agent 0's optimizer was saved with weight_decay=0.0, this run has 0.1",
        ),
    ]
    for change, message in changes:
        with pytest.raises(ConfigError, match=message):
            _trainer("MAGRPO", qwen_bpe, tmp_path, LengthReward(), max_steps=3, **change).train(True)
    other_model = MAGRPOTrainer(
        agents=[qwen_bpe, llama_word],
        train_dataset=DATA,
        reward_func=LengthReward(),
        args=MAGRPOConfig(
            output_dir=str(tmp_path), lora_r=4, prompts_per_step=2, seed=11, progress_bar=False
        ),
    )
    with pytest.raises(
        ConfigError, match=r"the checkpoint's agent 1 is '.*qwen2-bpe', this run's '.*llama-word'"
    ):
        other_model.train(resume_from_checkpoint=True)
    # A checkpoint that did not record its settings: the weights that do not fit are named, not torch's error.
    state_file = tmp_path / "checkpoints" / "step_2" / "trainer_state.json"
    state_file.write_text(
        json.dumps({k: v for k, v in json.loads(state_file.read_text()).items() if k != "settings"})
    )
    with pytest.raises(
        ConfigError,
        match=r"agent 0's weights in the checkpoint do not fit its model here \(\d+ differ, e.g. '.*lora_.*'\); "
        r"resume with the same model \(model= / agents=\) and LoRA settings",
    ):
        _trainer("MAGRPO", qwen_bpe, tmp_path, LengthReward(), max_steps=3, lora_r=8).train(True)
    # Value heads in the checkpoint, critic models in this run
    _trainer("IAC", qwen_bpe, tmp_path / "iac", LengthReward(), max_steps=2).train()
    critics = _trainer("IAC", qwen_bpe, tmp_path / "iac", LengthReward(), max_steps=3, critic_model=qwen_bpe)
    with pytest.raises(
        ConfigError,
        match=r"the checkpoint holds value_heads \[0, 1\], this process \[\]; resume with the same critic settings",
    ):
        critics.train(resume_from_checkpoint=True)
    faster_heads = _trainer(
        "IAC", qwen_bpe, tmp_path / "iac", LengthReward(), max_steps=3, critic_learning_rate=0.5
    )
    with pytest.raises(ConfigError, match=r"agent 0's optimizer was saved with lr=0.0001, this run has 0.5"):
        faster_heads.train(resume_from_checkpoint=True)


class _Stub:
    """The little of a trainer that save_checkpoint and load_checkpoint use: one process (no data shards), a step and a
    state."""

    processes, data, num_agents, team, args = None, None, 1, (), MAGRPOConfig()

    def __init__(self, step):
        self.step = step

    def checkpoint_state(self):
        return {"step": self.step}

    def load_checkpoint_state(self, state):
        self.loaded = state


def test_a_new_checkpoint_replaces_those_an_earlier_run_left_past_it(tmp_path, monkeypatch):
    from comarl import checkpoint

    for step in (2, 4, 6):  # an earlier run in the same folder that went further
        checkpoint.save_checkpoint(_Stub(step), tmp_path, keep=3)
    written, real_save = [], torch.save

    def save(obj, path):  # the new step_2 is written beside the old one, which stays whole until replaced
        written.append([p.name for p in checkpoint.completed_checkpoints(tmp_path)] + [path.parent.name])
        real_save(obj, path)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    directory = checkpoint.save_checkpoint(_Stub(2), tmp_path, keep=3)
    assert written == [["step_2", "step_4", "step_6", "step_2.partial"]]
    # step_4 and step_6 belong to the replaced run: --resume must not jump back to them
    assert checkpoint.completed_checkpoints(tmp_path) == [directory]
    assert torch.load(directory / "process_0.pt", weights_only=False)["trainer"] == {"step": 2}


def test_a_resumed_run_cut_short_never_resumes_the_run_it_replaced(tmp_path, monkeypatch):
    """Run A left steps 2, 4 and 6; run B resumed from step 2. A crash at any point of B's start or its first
    save must not leave A's step 4 or 6 as the newest finished checkpoint (resume would continue A under B's logs)."""
    from comarl import checkpoint

    for step in (2, 4, 6):
        checkpoint.save_checkpoint(_Stub(step), tmp_path, keep=3)
    checkpoint.remove_checkpoints(tmp_path, past=2)  # what train() does on resuming from step 2
    assert [p.name for p in checkpoint.completed_checkpoints(tmp_path)] == ["step_2"]
    # Without that (a save straight after A's), the save itself removes A's steps >= 4 before its rename.
    for step in (4, 6):
        checkpoint.save_checkpoint(_Stub(step), tmp_path, keep=3)

    def rename_cut_short(source, target):
        raise OSError("the machine went away")

    monkeypatch.setattr(checkpoint.os, "replace", rename_cut_short)
    with pytest.raises(OSError):
        checkpoint.save_checkpoint(_Stub(4), tmp_path, keep=3)
    assert [p.name for p in checkpoint.completed_checkpoints(tmp_path)] == ["step_2"]


def test_folders_not_named_like_checkpoints_are_left_alone(tmp_path):
    from comarl import checkpoint

    backup = tmp_path / "checkpoints" / "step_4.bak"
    backup.mkdir(parents=True)
    checkpoint.save_checkpoint(_Stub(2), tmp_path, keep=1)
    checkpoint.remove_checkpoints(tmp_path)
    assert checkpoint.completed_checkpoints(tmp_path) == [] and backup.is_dir()


def test_a_save_cut_short_leaves_the_previous_checkpoint_and_is_cleared_later(tmp_path, monkeypatch):
    from comarl import checkpoint

    checkpoint.save_checkpoint(_Stub(2), tmp_path, keep=2)
    real_save = torch.save

    def cut_short(obj, path):  # the process dies halfway through writing its part
        real_save(obj, path)
        raise OSError("the machine went away")

    monkeypatch.setattr(checkpoint.torch, "save", cut_short)
    with pytest.raises(OSError):
        checkpoint.save_checkpoint(_Stub(4), tmp_path, keep=2)
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    previous = tmp_path / "checkpoints" / "step_2"
    assert checkpoint.completed_checkpoints(tmp_path) == [previous]
    assert torch.load(previous / "process_0.pt", weights_only=False)["trainer"] == {"step": 2}

    # Cut short after every part and trainer_state.json were written, before the rename: still not loaded.
    def rename_cut_short(source, target):
        raise OSError("the machine went away")

    monkeypatch.setattr(checkpoint.os, "replace", rename_cut_short)
    with pytest.raises(OSError):
        checkpoint.save_checkpoint(_Stub(5), tmp_path, keep=2)
    monkeypatch.undo()
    partial = tmp_path / "checkpoints" / "step_5.partial"
    assert (partial / "trainer_state.json").is_file() and (partial / "process_0.pt").is_file()
    assert checkpoint.completed_checkpoints(tmp_path) == [previous]
    with pytest.raises(ConfigError, match=r"step_5\.partial': not a finished checkpoint"):
        checkpoint.load_checkpoint(_Stub(5), partial)
    # The run resumed from step 2 saves every 3 steps now: steps 4 and 5's remains go with its next save.
    checkpoint.save_checkpoint(_Stub(3), tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_3"]


def test_a_new_run_that_stops_before_its_first_save_leaves_no_earlier_checkpoint(qwen_bpe, tmp_path):
    """A run started without resume replaces the folder's checkpoints at once: resuming after it stopped must not
    continue the earlier run's weights under the new run's logs."""
    _trainer("MAGRPO", qwen_bpe, tmp_path, LengthReward(), max_steps=2).train()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_2"]
    stopped = _trainer("MAGRPO", qwen_bpe, tmp_path, LengthReward(crash_at=1), max_steps=2)
    with pytest.raises(RuntimeError, match="the machine went away"):
        stopped.train()  # dies in its first step, before any save
    assert list((tmp_path / "checkpoints").iterdir()) == []
    again = _trainer("MAGRPO", qwen_bpe, tmp_path, LengthReward(), max_steps=2)
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint=True: no finished checkpoint in "):
        again.train(resume_from_checkpoint=True)


def test_truncate_log_drops_a_row_cut_off_by_a_crash(tmp_path):
    from comarl.checkpoint import truncate_log

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.7}\n{"step": 3, "rew')
    truncate_log(log, 2)
    assert log.read_text() == '{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.7}\n'


def test_resume_on_fewer_gpus_restores_the_streams_of_those_it_sees(monkeypatch):
    """A checkpoint written where 2 GPUs were visible resumes where 1 is: set_rng_state_all would index a second
    GPU that is not there; only GPU 0's stream is restored."""
    from comarl.checkpoint import rng_state, set_rng_state

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.tensor([0]), torch.tensor([1])])
    state = rng_state()
    set_rng_state(state)
    assert [(int(s), d) for s, d in restored] == [(0, 0)]


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path):
    """step_10 comes after step_9 (by name it sorts first): resume takes step_10, the limit drops step_9."""
    from comarl import checkpoint

    for step in (9, 10):
        checkpoint.save_checkpoint(_Stub(step), tmp_path, keep=2)
    assert [p.name for p in checkpoint.completed_checkpoints(tmp_path)] == ["step_9", "step_10"]
    checkpoint.save_checkpoint(_Stub(11), tmp_path, keep=2)
    assert [p.name for p in checkpoint.completed_checkpoints(tmp_path)] == ["step_10", "step_11"]


@pytest.mark.parametrize(("keep", "kept"), [(1, [4]), (2, [3, 4]), (4, [1, 2, 3, 4]), (5, [1, 2, 3, 4])])
def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path, keep, kept):
    """Saving steps 1-4 with save_total_limit=keep leaves the newest min(keep, 4) of them."""
    from comarl import checkpoint

    for step in (1, 2, 3, 4):
        checkpoint.save_checkpoint(_Stub(step), tmp_path, keep=keep)
    assert [p.name for p in checkpoint.completed_checkpoints(tmp_path)] == [f"step_{s}" for s in kept]


def test_the_remains_of_a_save_cut_short_never_count_and_never_block_a_save(tmp_path, monkeypatch):
    """A save cut short leaves step_<N>.partial: the next save removes it even below its own step (it is not one of
    the kept checkpoints), and a save of step N itself writes over it."""
    from comarl import checkpoint

    real_save = torch.save

    def cut_short(obj, path):
        real_save(obj, path)
        raise OSError("the machine went away")

    def save_cut_short(step):
        with monkeypatch.context() as patch:
            patch.setattr(checkpoint.torch, "save", cut_short)
            with pytest.raises(OSError):
                checkpoint.save_checkpoint(_Stub(step), tmp_path, keep=3)

    folders = tmp_path / "checkpoints"
    checkpoint.save_checkpoint(_Stub(2), tmp_path, keep=3)
    save_cut_short(3)
    checkpoint.save_checkpoint(_Stub(4), tmp_path, keep=3)
    assert sorted(p.name for p in folders.iterdir()) == ["step_2", "step_4"]
    save_cut_short(6)  # the run dies while saving step 6, resumes from step 4 and saves step 6 again
    directory = checkpoint.save_checkpoint(_Stub(6), tmp_path, keep=3)
    assert sorted(p.name for p in folders.iterdir()) == ["step_2", "step_4", "step_6"]
    assert torch.load(directory / "process_0.pt", weights_only=False)["trainer"] == {"step": 6}


def test_a_deletion_cut_short_leaves_no_checkpoint_to_resume(tmp_path, monkeypatch):
    """trainer_state.json is deleted first: a folder whose deletion stopped before its parts went is not loaded."""
    from comarl import checkpoint

    for step in (2, 4):
        checkpoint.save_checkpoint(_Stub(step), tmp_path, keep=2)
    # The process dies before rmtree deletes a file.
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda path, ignore_errors=False: None)
    checkpoint.remove_checkpoints(tmp_path, past=2)
    assert (tmp_path / "checkpoints" / "step_4" / "process_0.pt").is_file()
    assert [p.name for p in checkpoint.completed_checkpoints(tmp_path)] == ["step_2"]


def test_check_resumable_compares_the_trainer_the_processes_and_the_settings(tmp_path):
    """A checkpoint of another trainer or another process count is refused; a list setting given as a tuple (as it
    was saved, or as JSON gives it back) is the same setting."""
    from comarl import checkpoint

    stub = _Stub(2)
    stub.args = MAGRPOConfig(lora_r=4, lora_target_modules=("q_proj", "v_proj"))
    directory = checkpoint.save_checkpoint(stub, tmp_path, keep=1)
    for modules in (("q_proj", "v_proj"), ["q_proj", "v_proj"]):
        args = MAGRPOConfig(lora_r=4, lora_target_modules=modules)
        assert checkpoint.check_resumable(directory, "_Stub", 1, 1, args) == 2
    with pytest.raises(
        ConfigError, match=r"the checkpoint has trainer='_Stub', this run trainer='IPPOTrainer'"
    ):
        checkpoint.check_resumable(directory, "IPPOTrainer", 1, 1, stub.args)
    with pytest.raises(ConfigError, match=r"the checkpoint has processes=1, this run processes=2"):
        checkpoint.check_resumable(directory, "_Stub", 1, 2, stub.args)
    with pytest.raises(ConfigError, match=r"lora_target_modules=\['q_proj', 'v_proj'\], this run has"):
        checkpoint.check_resumable(
            directory, "_Stub", 1, 1, MAGRPOConfig(lora_r=4, lora_target_modules=["q_proj"])
        )


def _model_folder(path, config, weights):
    """A stand-in model folder: a config.json and one weight file of ``weights`` bytes."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(config)
    (path / "model.safetensors").write_bytes(b"\0" * weights)
    return str(path)


def test_resume_compares_agent_sources_by_path_then_by_config_and_weight_sizes(tmp_path, monkeypatch):
    """A local model folder elsewhere is the same model when its config and weight files' names and sizes are (in
    whatever order the folder lists them); another config or weight size is another model; a model object (no
    source) is not checked; hub ids are compared as they are."""
    import pathlib
    from types import SimpleNamespace

    from comarl import checkpoint

    def saved_with(source, run):
        stub = _Stub(2)
        stub.team = (SimpleNamespace(source=source),)
        return checkpoint.save_checkpoint(stub, tmp_path / run, keep=1)

    def check(directory, source):
        return checkpoint.check_resumable(directory, "_Stub", 1, 1, _Stub.args, [source])

    model = _model_folder(tmp_path / "a" / "model", '{"hidden_size": 8}', 16)
    directory = saved_with(model, "local")
    assert check(directory, model) == 2 and check(directory, None) == 2
    copy = _model_folder(tmp_path / "b" / "model", '{"hidden_size": 8}', 16)
    listed = pathlib.Path.iterdir
    with monkeypatch.context() as patch:  # another file system lists the files in another order
        patch.setattr(pathlib.Path, "iterdir", lambda self: reversed(sorted(listed(self))))
        assert check(directory, copy) == 2
    for other in (
        _model_folder(tmp_path / "c" / "model", '{"hidden_size": 16}', 16),
        _model_folder(tmp_path / "d" / "model", '{"hidden_size": 8}', 32),
    ):
        with pytest.raises(
            ConfigError, match=r"the checkpoint's agent 0 is '.*/a/model', this run's '.*/model'"
        ):
            check(directory, other)
    hub = saved_with("org/model-a", "hub")
    assert check(hub, "org/model-a") == 2
    with pytest.raises(ConfigError, match=r"agent 0 is 'org/model-a', this run's 'org/model-b'"):
        check(hub, "org/model-b")
    # A checkpoint written before fingerprints were recorded compares the paths alone.
    state_file = directory / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["agent_fingerprints"]
    state_file.write_text(json.dumps(state))
    with pytest.raises(
        ConfigError, match=r"the checkpoint's agent 0 is '.*/a/model', this run's '.*/b/model'"
    ):
        check(directory, copy)


def test_a_resume_brings_back_the_python_numpy_and_torch_streams(tmp_path):
    """A reward function or a model's dropout drawing from the global streams draws after a resume what it would
    have drawn without the stop."""
    import random

    import numpy as np

    from comarl import checkpoint

    directory = checkpoint.save_checkpoint(_Stub(2), tmp_path, keep=1)
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    random.random(), np.random.rand(), torch.rand(2)  # the stopped run went on drawing
    resumed = _Stub(0)
    assert checkpoint.load_checkpoint(resumed, directory) == 2 and resumed.loaded == {"step": 2}
    python, numpy, torch_ = random.random(), float(np.random.rand()), torch.rand(2)
    assert (python, numpy) == expected[:2] and torch.equal(torch_, expected[2])


def test_the_checkpoint_over_the_limit_goes_only_once_the_new_one_is_in_place(tmp_path, monkeypatch):
    """With save_total_limit=1, step 2 is deleted after step 4 is renamed into place: a save cut short before the
    rename leaves step 2 to resume from."""
    from comarl import checkpoint

    checkpoint.save_checkpoint(_Stub(2), tmp_path, keep=1)

    def rename_cut_short(source, target):
        raise OSError("the machine went away")

    monkeypatch.setattr(checkpoint.os, "replace", rename_cut_short)
    with pytest.raises(OSError):
        checkpoint.save_checkpoint(_Stub(4), tmp_path, keep=1)
    assert [p.name for p in checkpoint.completed_checkpoints(tmp_path)] == ["step_2"]


def test_truncate_log_keeps_the_rows_up_to_the_step_and_drops_lines_that_are_not_rows(tmp_path):
    """Rows of steps 1 and 2 stay for a resume from step 2; step 3's row goes, and so does a line that is JSON but
    not an object (no row of ours), rather than stopping the resume."""
    from comarl.checkpoint import truncate_log

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n[1, 2]\n{"step": 2}\n\n{"step": 3}\n')
    truncate_log(log, 2)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'
