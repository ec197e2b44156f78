"""Agent parallelism (one process per agent under torchrun, gloo on CPU) computes what one process computes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import comarl
from comarl import ConfigError, MAREINFORCEConfig, MAREINFORCETrainer
from comarl.distributed import DataParallel
from comarl.trainers.preference import dataset_chunks, reward_scores

DATA = [{"prompt": p} for p in ("def add(a, b):", "the agents meet at", "alice and bob", "return a + b")]


def two_word_reward(a, b):
    """Shared reward that differs between joint actions, so every agent gets a gradient."""
    return [len(x) / 10 - len(y) / 20 for x, y in zip(a, b)]


def second_turn_for_the_first(item, completions, history):
    """A transition: the first DATA item gets a second turn, the others end at turn 1. Under data parallelism
    (2 shards, all 4 items in every step) one shard then plays turn 2 while the other has nothing left."""
    return [f"again: {c}" for c in completions] if item["prompt"] == DATA[0]["prompt"] else None


def run_args(**kw) -> dict:
    # Real sampling (top_k=None): train() draws item j of step s from streams keyed (seed, j, s) alone, so processes
    # and data shards sample what one process samples.
    base = dict(
        prompts_per_step=2,
        num_generations=2,
        max_new_tokens=5,
        top_k=None,
        learning_rate=1e-3,
        max_steps=2,
        progress_bar=False,
        reward_call="batched",
        eval_interval=0,
        seed=5,
    )
    base.update(kw)
    return base


@pytest.fixture
def one_thread():
    """One intra-op thread, as in the workers, so both runs sum floats in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def one_process_run(trainer: str, agents: list[str], **settings) -> tuple:
    """The single-process run a distributed launch must match: the trainer and its last metrics."""
    single = getattr(comarl, f"{trainer}Trainer")(
        agents=agents,
        train_dataset=DATA,
        eval_dataset=DATA,
        reward_func=two_word_reward,
        transition=second_turn_for_the_first if settings.get("num_turns", 1) > 1 else None,
        args=getattr(comarl, f"{trainer}Config")(**run_args(**settings)),
    )
    return single, single.train()


def assert_metrics_equal(ranks: list[dict], expected: dict) -> None:
    """Every process reports the single process's metrics (timings aside)."""
    compared = [k for k in expected if not k.startswith("time/") and k != "completions_per_s"]
    assert any(k.startswith("agent_1/") for k in compared)
    for r in ranks:
        for key in compared:
            assert r["metrics"][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key


def assert_saved_agents_compute(out: Path, single) -> None:
    """The agents a distributed run saved compute the single process's logits."""
    for i, agent in enumerate(single.team):
        loaded = AutoModelForCausalLM.from_pretrained(out / "agents" / f"agent_{i}").to(agent.device)
        ids = agent.tokenizer(["alice and bob", "def add(a, b):"], return_tensors="pt", padding=True)
        ids = ids.to(agent.device)
        with torch.no_grad():
            assert torch.allclose(loaded(**ids).logits, agent.model(**ids).logits, atol=1e-5), i


def candidate_texts(candidates: list[dict]) -> list[list[list[str]]]:
    """MADPO's cached candidates of the initial team as texts: per item, the completions of each agent held."""
    return [sorted(g.completions for g in c["generations"].values()) for c in candidates]


def failure(stderr: str) -> str:
    """What a failed launch printed: each process's own last lines (its traceback), the first abort with the
    Python stacks faulthandler printed, then torchrun's summary."""
    lines = stderr.splitlines()
    ranks = [line for line in lines if line.startswith("[rank")]
    abort = next(
        (k for k, line in enumerate(lines) if line.startswith(("terminate called", "Fatal Python"))), None
    )
    stacks = lines[abort : abort + 40] if abort is not None else []
    return "\n".join(ranks)[-4000:] + "\n" + "\n".join(stacks) + "\n" + stderr[-1500:]


def _torchrun(runs: list[dict], processes: int) -> subprocess.CompletedProcess:
    """Run tests/agent_parallel_worker.py in ``processes`` processes (torchrun, gloo): it trains ``runs`` one
    after the other, and each process writes <output_dir>/rank_<r>.json of each."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={processes}",
            str(Path(__file__).parent / "agent_parallel_worker.py"),
            json.dumps(runs),
        ],
        # faulthandler: a process that aborts (e.g. at exit) prints every thread's Python stack into the failure
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_spec(trainer: str, overrides: dict, launch: str = "agent", **extra) -> dict:
    """One run of the worker: ``launch`` is 'agent' (agent_parallel), 'data' (data_parallel) or 'grid' (both);
    ``resume`` resumes from the newest checkpoint; ``fit_first`` fits MARLHF's reward model by hand first. Its
    ``name`` (its output folder) comes from the trainer and settings, so a test finds its run again."""
    settings = json.dumps([trainer, overrides, launch, extra], sort_keys=True)
    name = f"{trainer}-{zlib.crc32(settings.encode()):08x}"
    return {"name": name, "trainer": trainer, "overrides": overrides, "launch": launch, **extra}


# The cases of each test below, and the launches that run them. Starting the processes (torchrun, then torch,
# transformers and two models in each) takes ~10 s, a 2-step run of these tiny agents ~1 s: so the runs of all
# the tests of one kind share a launch, run when the first of those tests asks (`launched`), once. The tests of a
# kind carry xdist_group(kind): with pytest-xdist, one worker runs them all (addopts: --dist loadgroup).

TWO_PROCESS_CASES = [  # (trainer, overrides, files saved besides the weights)
    # sampled evaluation: each process draws its agent's streams from the seeds the episode's processes share
    ("MAREINFORCE", {"eval_do_sample": True, "num_generations_eval": 2}, []),
    (  # each process samples and scores its agent by the agent's own settings
        "IPPO",
        {
            "num_iterations": 2,
            "agent_settings": [{"max_new_tokens": 3, "temperature": 0.7}, {"min_new_tokens": 5}],
        },
        ["agent_0/value_head.pt", "agent_1/value_head.pt"],
    ),
    # the centralized critic (with agent 0) learns returns less each agent's KL, scored in its own process
    ("MAPPO", {"num_iterations": 2, "beta": 0.1, "kl_penalty": "reward"}, ["critic/value_head.pt"]),
    (
        "MAREINFORCE",
        {"lora_r": 4, "beta": 0.05},
        ["agent_0/adapter_config.json", "agent_1/adapter_config.json"],
    ),
]
DATA_SHARD_CASES = [
    ("MAREINFORCE", {}),
    # KL, PPO iterations (batch-wide advantage statistics: test_data_shards_scale_advantages_by_the_whole_batch)
    ("MAREINFORCE", {"beta": 0.05, "num_iterations": 2, "loss_aggregation": "grpo"}),
    # each process keeps half of every weight (FSDP2): the KL reference copy too, here scoring the KL penalty
    # of the rewards (batch-wide metrics of every shard's penalties)
    ("MAREINFORCE", {"beta": 0.05, "kl_penalty": "reward", "shard_weights": True}),
    # sharded base and adapters, gradients summed over micro-batches
    ("MAREINFORCE", {"lora_r": 4, "micro_batch_size": 1, "shard_weights": True}),
    # a second turn for one shard's item only: the other shard still takes part in turn 2's generate calls
    ("MAREINFORCE", {"num_turns": 2, "discount": 0.5, "shard_weights": True}),
    # whitening, value heads (whole copies) on sharded agents, mini-batches drawn from the whole batch; one-row
    # micro-batches, so a shard holding fewer rows of a mini-batch runs weightless ones (the layers' gathers)
    ("IPPO", {"num_iterations": 2, "num_mini_batches": 2, "micro_batch_size": 1, "shard_weights": True}),
    ("MAPPO", {"num_iterations": 2, "num_mini_batches": 2}),  # a separate centralized critic
    # each process keeps half of every AdamW state: the agents' and the critic's
    ("MAPPO", {"num_iterations": 2, "num_mini_batches": 2, "shard_optimizer": True}),
]
GRID_CASES = [
    # each agent split between its two processes (FSDP2 over the agent's group)
    ("MAREINFORCE", {"beta": 0.05, "num_iterations": 2, "shard_weights": True}),
    ("MAPPO", {"num_iterations": 2, "num_mini_batches": 2}),  # the centralized critic on agent 0's processes
]
RESUME_CASES = [
    ("MAREINFORCE", None),
    ("MAPPO", None),
    ("MAREINFORCE", "shard_optimizer"),
    ("MAREINFORCE", "shard_weights"),
]
MADPO_CANDIDATES = ["current", "initial"]
MARLHF_LAUNCHES = ["data", "agent", "grid"]
MADPO_DATA = {"prompts_per_step": 4, "num_generations": 4, "beta": 0.0}
MADPO_DATA_SAMPLING = {  # random pairs: each item's from a stream keyed by its seed
    "prompts_per_step": 4,
    "num_generations": 4,
    "candidates_from": "current",
    "pair_selection": "random",
    "preference_pairs_per_sample": 2,
}
MARLHF_SETTINGS = {
    "prompts_per_step": 4,
    "pair_selection": "random",
    "preference_pairs_per_sample": 2,
    "preference_num_candidates": 4,
    "reward_learning_rate": 1e-3,
    "reward_train_batch_size": 8,
    "reward_num_train_epochs": 1,
}
RESUME_SCHEDULE = {"beta": 0.05, "warmup_steps": 3}  # the learning rate changes at every step


def two_process_run(trainer: str, overrides: dict) -> dict:
    # a checkpoint at the last step
    return run_spec(trainer, {**overrides, "save_steps": 2})


def madpo_run(candidates_from: str) -> dict:
    overrides = {"num_generations": 4, "candidates_from": candidates_from, "save_steps": 2}
    return run_spec("MADPO", overrides)


def data_shard_run(trainer: str, overrides: dict, launch: str = "data") -> dict:
    return run_spec(trainer, {"prompts_per_step": 4, **overrides, "save_steps": 2}, launch)


def marlhf_run(launch: str) -> dict:
    return run_spec("MARLHF", MARLHF_SETTINGS, launch, fit_first=True)


def resume_runs(trainer: str, sharded: str | None) -> tuple[dict, dict]:
    """Two processes stopping after a checkpoint at step 2, and the same relaunched with --resume to step 4."""
    first = {"prompts_per_step": 2, **RESUME_SCHEDULE, "max_steps": 2, "save_steps": 2}
    if sharded:
        first[sharded] = True
    stop = run_spec(trainer, first, "data")
    return stop, {**run_spec(trainer, {**first, "max_steps": 4}, "data", resume=True), "name": stop["name"]}


LAUNCHES: dict[str, tuple[int, list[list[dict]]]] = {  # kind: (processes, its launches, each a list of runs)
    "agent": (
        2,
        [
            [
                *(two_process_run(trainer, overrides) for trainer, overrides, _ in TWO_PROCESS_CASES),
                *(madpo_run(c) for c in MADPO_CANDIDATES),
                marlhf_run("agent"),
            ]
        ],
    ),
    "data": (
        2,
        [
            [
                *(data_shard_run(trainer, overrides) for trainer, overrides in DATA_SHARD_CASES),
                run_spec("MADPO", {**MADPO_DATA, "save_steps": 2}, "data"),
                run_spec("MADPO", {**MADPO_DATA_SAMPLING, "shard_weights": True}, "data"),
                marlhf_run("data"),
            ]
        ],
    ),
    "grid": (4, [[*(data_shard_run(t, o, "grid") for t, o in GRID_CASES), marlhf_run("grid")]]),
    "resume": (2, [list(runs) for runs in zip(*(resume_runs(t, s) for t, s in RESUME_CASES))]),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, qwen_bpe, llama_word):
    """``launched(kind, run)``: every process's results of ``run`` (one of LAUNCHES[kind]) and its output folder.
    A kind's launches run the first time one of its runs is asked for; a failed launch fails all its tests."""
    done: dict[str, tuple[Path, str]] = {}

    def results(kind: str, run: dict) -> tuple[list[dict], Path]:
        processes, launches = LAUNCHES[kind]
        if kind not in done:
            root, error = tmp_path_factory.mktemp(kind), ""
            for runs in launches:
                for r in runs:
                    (root / r["name"]).mkdir(exist_ok=True)
                specs = [
                    {**r, "agents": [qwen_bpe, llama_word], "output_dir": str(root / r["name"])} for r in runs
                ]
                finished = _torchrun(specs, processes)
                if finished.returncode != 0:
                    error = failure(finished.stderr)
                    break
            done[kind] = root, error
        root, error = done[kind]
        if error:
            pytest.fail(f"the {kind!r} launch failed:\n{error}", pytrace=False)
        out = root / run["name"]
        return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(processes)], out

    return results


@pytest.mark.slow
@pytest.mark.xdist_group("agent")
@pytest.mark.parametrize(("trainer", "overrides", "saved"), TWO_PROCESS_CASES)
def test_two_processes_train_what_one_process_trains(
    qwen_bpe, llama_word, launched, trainer, overrides, saved, one_thread
):
    """Same rewards, per-agent (and critic) metrics, evaluation and saved weights as one process, with real
    sampling: every agent draws from its own generator, in one process or in its own."""
    agents = [qwen_bpe, llama_word]
    single, expected = one_process_run(trainer, agents, **overrides)
    expected_eval = single.evaluate()

    ranks, out = launched("agent", two_process_run(trainer, overrides))
    assert [r["local"] for r in ranks] == [[0], [1]]
    assert [r["torch_seed"] for r in ranks] == [5, 6]  # agents never share sampling random numbers
    # but the processes of one episode step their copies of the environment alike: equal Python/joint streams
    assert (
        ranks[0]["python_draw"] == ranks[1]["python_draw"]
        and ranks[0]["joint_seed"] == ranks[1]["joint_seed"]
    )
    assert_metrics_equal(ranks, expected)  # every process reports the team's, every agent's and the critics'
    for r in ranks:
        assert r["eval"]["eval/reward"] == pytest.approx(expected_eval["eval/reward"], rel=1e-5)
    # Each process saved what it holds; the saved agents (weights, or base + adapter) compute the single
    # process's logits.
    assert_saved_agents_compute(out, single)
    for path in saved:
        assert (out / "agents" / path).exists(), path
    checkpoint = out / "checkpoints" / "step_2"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "process_0.pt",
        "process_1.pt",
        "trainer_state.json",
    ]
    assert json.loads((checkpoint / "trainer_state.json").read_text())["processes"] == 2
    assert (out / "metrics.jsonl").exists()  # process 0 writes the run folder


def test_agent_parallel_needs_torchrun(qwen_bpe, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(
        ConfigError,
        match=r"agent_parallel=True needs one process per agent: launch with `torchrun --nproc-per-node=2",
    ):
        MAREINFORCETrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=two_word_reward,
            args=MAREINFORCEConfig(**run_args(agent_parallel=True)),
        )


@pytest.mark.parametrize("opened", [False, True], ids=["torchrun", "own-group"])
def test_several_processes_without_a_mode_are_refused(qwen_bpe, monkeypatch, opened):
    """torchrun without agent_parallel or data_parallel: every process would train the whole team alone and write
    the same output_dir (duplicate log rows, checkpoint parts replaced under each other); it stops at once."""
    monkeypatch.setenv("WORLD_SIZE", "1" if opened else "2")
    if opened:  # a process group the user opened: its size counts
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(
        ConfigError,
        match=r"this process is one of 2 .* agent_parallel=False and data_parallel=False: every process would "
        r"train the whole team .* Set agent_parallel=True .* or data_parallel=True",
    ):
        MAREINFORCETrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=two_word_reward,
            args=MAREINFORCEConfig(**run_args()),
        )


@pytest.mark.slow
@pytest.mark.xdist_group("agent")
@pytest.mark.parametrize("candidates_from", MADPO_CANDIDATES)
def test_madpo_in_two_processes_exchanges_margins(launched, candidates_from):
    """MADPO's joint loss needs every agent's margin: each process computes its own agent's and they are
    exchanged once per iteration. Sampled candidates differ between launches, so the processes are compared
    with each other: the same team loss, and the team margin is the sum of the agents' margins."""
    ranks, _ = launched("agent", madpo_run(candidates_from))
    first, second = (r["metrics"] for r in ranks)
    assert first["pairs"] == second["pairs"] > 0
    for key in ("loss", "margin", "accuracy", "agent_0/margin", "agent_1/margin", "agent_1/grad_norm"):
        assert first[key] == second[key], key
    assert first["margin"] == pytest.approx(first["agent_0/margin"] + first["agent_1/margin"], abs=1e-6)
    assert (
        first["agent_0/margin"] != 0 and first["agent_1/margin"] != 0
    )  # both agents moved off the reference


# ---------------------------------------------------------------------------- data parallelism


@pytest.mark.slow
@pytest.mark.xdist_group("data")
@pytest.mark.parametrize(("trainer", "overrides"), DATA_SHARD_CASES)
def test_two_data_shards_train_what_one_process_trains(
    qwen_bpe, llama_word, launched, trainer, overrides, one_thread
):
    """data_parallel: each process takes half of every step's prompts; it samples what one process samples for them
    (real sampling), and the summed gradients, the metrics of the whole batch and the saved agents equal one
    process's run on all the prompts."""
    agents = [qwen_bpe, llama_word]
    one_process = {k: v for k, v in overrides.items() if k not in ("shard_optimizer", "shard_weights")}
    single, expected = one_process_run(trainer, agents, prompts_per_step=4, max_steps=2, **one_process)
    ranks, out = launched("data", data_shard_run(trainer, overrides))
    for i in ("0", "1"):  # shard_weights: the processes hold disjoint parts of each agent, adding up to it
        held, whole = [r["held"][i] for r in ranks], ranks[0]["parameters"][i]
        assert sum(held) == whole if overrides.get("shard_weights") else held == [whole, whole]
        if (
            overrides.get("shard_weights") and ranks[0]["reference_held"]
        ):  # its KL reference too, after training
            assert sum(r["reference_held"][i] for r in ranks) == whole
    assert_metrics_equal(ranks, expected)
    # each shard evaluates its share of the items (shard_weights: all of them, together); the pooled numbers are one
    # process's
    expected_eval = single.evaluate()
    for r in ranks:
        assert r["eval"] == pytest.approx(expected_eval, rel=1e-5)
    assert_saved_agents_compute(out, single)
    # shards play different episodes: their Python/NumPy and joint-action streams differ (they were equal)
    assert (
        ranks[0]["python_draw"] != ranks[1]["python_draw"]
        and ranks[0]["joint_seed"] != ranks[1]["joint_seed"]
    )
    # the rate counts every shard's completions, as one process's run on all the prompts does (not half)
    m = ranks[0]["metrics"]
    assert m["completions_per_s"] * m["time/step"] == pytest.approx(
        expected["completions_per_s"] * expected["time/step"]
    )
    checkpoint = out / "checkpoints" / "step_2"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "process_0.pt",
        "process_1.pt",
        "trainer_state.json",
    ]


@pytest.mark.slow
@pytest.mark.xdist_group("data")
def test_madpo_data_shards_train_what_one_process_trains(qwen_bpe, llama_word, launched, one_thread):
    """MADPO under data_parallel: each process samples the initial team's candidates for half of the dataset, the
    ones one process samples, and then holds them all; a step's pairs come from each process's items, the DPO loss
    is the mean over every process's pairs. One process trains the same team."""
    agents = [qwen_bpe, llama_word]
    ranks, out = launched("data", run_spec("MADPO", {**MADPO_DATA, "save_steps": 2}, "data"))
    assert ranks[0]["candidates"] == ranks[1]["candidates"]  # every process holds every item's candidates
    assert len(ranks[0]["candidates"]) == len(DATA)
    single = comarl.MADPOTrainer(
        agents=agents,
        train_dataset=DATA,
        reward_func=two_word_reward,
        args=comarl.MADPOConfig(**run_args(**MADPO_DATA)),
    )
    expected = single.train()
    assert candidate_texts(single.candidates) == ranks[0]["candidates"]
    assert expected["pairs"] > 0 and expected["agent_1/margin"] != 0
    assert_metrics_equal(ranks, expected)
    assert_saved_agents_compute(out, single)


@pytest.mark.slow
@pytest.mark.xdist_group("data")
def test_madpo_data_shards_sampling_every_step_stay_in_step(qwen_bpe, llama_word, launched, one_thread):
    """candidates_from='current': each process samples its own items every step, as one process samples them, and
    picks their random pairs as one process does; both report the whole batch's metrics, one process's, and keep
    the same weights. Here each process holds half of every agent and of its DPO reference (shard_weights)."""
    ranks, _ = launched("data", run_spec("MADPO", {**MADPO_DATA_SAMPLING, "shard_weights": True}, "data"))
    first, second = ranks
    assert first["metrics"]["pairs"] > 0
    for key in ("pairs", "candidates/reward", "loss", "margin", "agent_0/margin", "agent_1/grad_norm"):
        assert first["metrics"][key] == second["metrics"][key], key
    assert first["weights"] == second["weights"]
    assert first["metrics"]["agent_0/margin"] != 0
    for i in ("0", "1"):
        assert first["held"][i] + second["held"][i] == first["parameters"][i] and second["held"][i] > 0
    _, expected = one_process_run("MADPO", [qwen_bpe, llama_word], max_steps=2, **MADPO_DATA_SAMPLING)
    assert_metrics_equal(ranks, expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch", [pytest.param(launch, marks=pytest.mark.xdist_group(launch)) for launch in MARLHF_LAUNCHES]
)
def test_marlhf_processes_fit_the_reward_model_one_process_fits(
    qwen_bpe, llama_word, launched, launch, one_thread
):
    """MARLHF in two processes (data shards, or one per agent) or four (both): every process ends stage 1 with
    every preference pair; each scores its share of every batch and the gradients are summed, so every copy of the
    reward model is the one a single process fits on those pairs; then all train the team on equal scores."""
    agents = [qwen_bpe, llama_word]
    ranks, out = launched(launch, marlhf_run(launch))
    first = ranks[0]
    texts = first["fitted"]["texts"]
    assert len(texts[0]) >= 4
    assert all(r["fitted"]["texts"] == texts for r in ranks)  # every pair, on every process
    single = comarl.MARLHFTrainer(
        agents=agents,
        train_dataset=DATA,
        reward_func=two_word_reward,
        args=comarl.MARLHFConfig(**run_args(**MARLHF_SETTINGS)),
    )
    assert list(single._preference_texts()) == texts  # the pairs one process samples and picks (JSON: a list)
    expected = single.fit_reward_model(pairs=texts)
    scores = reward_scores(single.reward_model, texts[0] + texts[1]).tolist()
    P = len(texts[0])

    def margins(scores: list[float]) -> torch.Tensor:
        # Bradley-Terry sees score differences only: the head's bias has no gradient but rounding noise, which
        # AdamW turns into a drift that differs with the order of the sums (the same on every copy of one run).
        return torch.tensor(scores[:P]) - torch.tensor(scores[P:])

    for r in ranks:
        for key, value in expected.items():
            assert r["fitted"]["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        assert torch.allclose(margins(r["fitted"]["scores"]), margins(scores), rtol=1e-4, atol=1e-5)
        assert r["fitted"]["scores"] == first["fitted"]["scores"]  # the copies are equal
        for key in ("reward", "reward/task", "agent_0/loss", "agent_1/grad_norm"):
            assert r["metrics"][key] == pytest.approx(first["metrics"][key], rel=1e-6, abs=1e-9), key
    assert margins(scores).abs().max() > 1e-2  # the model learned
    assert (out / "agents" / "reward_model" / "value_head.pt").is_file()


@pytest.mark.slow
@pytest.mark.xdist_group("grid")
@pytest.mark.parametrize(("trainer", "overrides"), GRID_CASES)
def test_agents_by_data_shards_grid_trains_what_one_process_trains(
    qwen_bpe, llama_word, launched, trainer, overrides, one_thread
):
    """agent_parallel and data_parallel together: 2 agents x 2 shards = 4 processes. Each shard's two processes
    play their episodes together, each agent's two processes sum their gradients; metrics, checkpoint and saved
    agents equal one process's run on all the prompts."""
    agents = [qwen_bpe, llama_word]
    one_process = {k: v for k, v in overrides.items() if k != "shard_weights"}
    single, expected = one_process_run(trainer, agents, prompts_per_step=4, max_steps=2, **one_process)
    ranks, out = launched("grid", data_shard_run(trainer, overrides, "grid"))
    assert [r["local"] for r in ranks] == [[0], [1], [0], [1]]  # rank = shard * agents + agent
    if overrides.get("shard_weights"):  # agent i's processes (ranks i and i + 2) hold its two halves
        for i in (0, 1):
            held = [ranks[r]["held"][str(i)] for r in (i, i + 2)]
            assert sum(held) == ranks[i]["parameters"][str(i)] and min(held) > 0
    assert [r["torch_seed"] for r in ranks] == [5, 6, 7, 8]
    assert_metrics_equal(ranks, expected)
    assert_saved_agents_compute(out, single)
    # one shard's processes (ranks 0, 1) play the same episodes: equal Python/NumPy and joint-action streams;
    # shards (ranks 0, 2) play different ones: different streams
    draws = [(r["python_draw"], r["joint_seed"]) for r in ranks]
    assert (
        draws[0] == draws[1]
        and draws[2] == draws[3]
        and draws[0][0] != draws[2][0]
        and draws[0][1] != draws[2][1]
    )
    # the rate counts every shard's completions, as one process's run on all the prompts does (not half)
    m = ranks[0]["metrics"]
    assert m["completions_per_s"] * m["time/step"] == pytest.approx(
        expected["completions_per_s"] * expected["time/step"]
    )
    checkpoint = out / "checkpoints" / "step_2"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        *(f"process_{r}.pt" for r in range(4)),
        "trainer_state.json",
    ]


def test_grid_needs_a_multiple_of_the_agents(qwen_bpe, llama_word, tmp_path):
    spec = {
        **run_spec("MAREINFORCE", {}, "grid"),
        "agents": [qwen_bpe, llama_word],
        "output_dir": str(tmp_path),
    }
    launched = _torchrun([spec], 3)
    assert launched.returncode != 0
    assert (
        "agent_parallel=True and data_parallel=True: the world has 3 processes, not a multiple of the 2 agents"
        in launched.stderr
    )


@pytest.mark.slow
@pytest.mark.xdist_group("resume")
@pytest.mark.parametrize(("trainer", "sharded"), RESUME_CASES)
def test_data_parallel_run_resumes_exactly(qwen_bpe, llama_word, launched, one_thread, trainer, sharded):
    """Two processes stop after a checkpoint at step 2; relaunched with --resume they end where one process's
    unbroken 4-step run ends. Each process saves and restores its share: of AdamW's state and the warmup's
    learning rate (shard_optimizer), or of the weights, the KL reference and AdamW's state (shard_weights).
    Whole copies (and MAPPO's critic) are written once, in the first shard's part, and the second shard resumes
    from it."""
    agents = [qwen_bpe, llama_word]
    single = getattr(comarl, f"{trainer}Trainer")(
        agents=agents,
        train_dataset=DATA,
        reward_func=two_word_reward,
        args=getattr(comarl, f"{trainer}Config")(
            **run_args(prompts_per_step=2, max_steps=4, **RESUME_SCHEDULE)
        ),
    )
    expected = single.train()
    ranks, out = launched("resume", resume_runs(trainer, sharded)[1])
    parts = [(out / "checkpoints" / "step_2" / f"process_{r}.pt").stat().st_size for r in (0, 1)]
    if sharded is None:  # the second part holds only its random streams and schedules
        assert parts[1] < parts[0] / 20, parts
    for key in ("reward", "agent_0/loss", "agent_1/kl", "agent_1/grad_norm", "agent_1/lr"):
        assert ranks[1]["metrics"][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert_saved_agents_compute(out, single)


def test_data_shards_scale_advantages_by_the_whole_batch(qwen_bpe):
    """scale='batch' under data parallelism: each shard's advantages are its rows of the whole batch's. (The
    launches sample greedily, so their groups' centred advantages are all 0: this checks the statistics here.)"""
    trainer = MAREINFORCETrainer(
        model=qwen_bpe,
        num_agents=1,
        train_dataset=DATA,
        reward_func=lambda a: [0.0] * len(a),
        args=MAREINFORCEConfig(**run_args(baseline="group_mean", scale="batch")),
    )
    returns, depth = (
        torch.tensor([[0.0, 1.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0]]),
        torch.zeros(2, dtype=torch.long),
    )
    parts = [(returns[d : d + 1], None, depth[d : d + 1]) for d in (0, 1)]
    whole = comarl.algorithms.group_advantages(returns, "group_mean", "batch").flatten()
    for d in (0, 1):

        def gather(obj, d=d):
            assert obj[0].equal(parts[d][0])  # each shard sends its own returns
            return parts

        trainer.data = type("Shard", (), {"rank": d, "gather": staticmethod(gather)})()
        advantages, zero = trainer._advantages(*parts[d])
        assert torch.equal(advantages, whole[4 * d : 4 * d + 4]) and zero == 0.5  # the second group is flat
    # the first shard's rows scaled by its own spread alone would differ
    assert not torch.allclose(
        whole[:4], comarl.algorithms.group_advantages(returns[:1], "group_mean", "batch")[0]
    )


def test_backend_counts_the_gpus_of_this_machine(monkeypatch):
    """2 nodes x 8 GPUs: 16 processes, 8 on each node, each with a GPU: NCCL; more processes on a node than its
    GPUs: gloo. Agents on the CPU of a GPU machine: gloo (NCCL cannot sum CPU gradients)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert comarl.distributed._backend(8, on_gpus=True) == "nccl"
    assert comarl.distributed._backend(9, on_gpus=True) == "gloo"
    assert comarl.distributed._backend(8, on_gpus=False) == "gloo"


@pytest.mark.parametrize(
    "devices, backend",
    [("cpu", "gloo"), ("cuda", "nccl"), (["cuda", "cpu"], "gloo")],
    ids=["cpu", "gpu", "mixed"],
)
def test_the_agents_devices_choose_the_backend(qwen_bpe, monkeypatch, devices, backend):
    """On a machine with a GPU per process, agents trained on the CPU get gloo and no CUDA device is bound;
    agents on GPUs get NCCL, each process bound to its own GPU; a GPU agent beside a CPU one gets gloo (which NCCL's
    CPU gradients need) and its GPU bound. (The group is not really opened: the trainer stops at
    init_process_group.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    bound, opened = [], []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)

    def init_process_group(backend):
        opened.append(backend)
        raise RuntimeError("stop before any process group opens")

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match="stop before any process group opens"):
        MAREINFORCETrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=two_word_reward,
            args=MAREINFORCEConfig(**run_args(agent_parallel=True, agent_devices=devices)),
        )
    assert opened == [backend]
    assert bound == ([] if devices == "cpu" else ["cuda:1"])  # LOCAL_RANK 1


def test_shard_weights_on_shared_gpus_is_refused(qwen_bpe, monkeypatch):
    """Two data shards sharing one GPU get gloo, which cannot all-gather CUDA tensors: FSDP2 could not run, and the
    trainer says so before loading anything (a process group already opened as gloo stands in for the launch)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: "gloo")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(
        ConfigError,
        match=r"shard_weights=True with agents on GPUs needs NCCL, one GPU per process and every agent on a GPU; "
        r"this run's process group is gloo \(agent_devices=\['cuda', 'cuda'\], 1 GPU for 2 processes on "
        r"this machine\). Launch at most one process per GPU with every agent on a GPU, or set shard_weights=False",
    ):
        MAREINFORCETrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=two_word_reward,
            args=MAREINFORCEConfig(
                **run_args(data_parallel=True, shard_weights=True, agent_devices="cuda", prompts_per_step=2)
            ),
        )


def test_processes_outnumbering_the_gpus_share_them(monkeypatch):
    """Two processes on a one-GPU machine (gloo) both train on cuda:0, not on a cuda:1 that does not exist."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert comarl.distributed.local_gpu(1) == "cuda:0"
    data = DataParallel(None, rank=1, world_size=2)
    assert data.device(["cuda", "cpu"]) == ["cuda:0", "cpu"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert comarl.distributed.local_gpu(1) == "cuda:1"


@pytest.mark.parametrize("count, words", [(0, "no GPU"), (1, "1 GPU"), (4, "4 GPUs")])
def test_gpu_count_in_words(monkeypatch, count, words):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert comarl.distributed._gpu_count() == words


def test_data_parallel_checks(qwen_bpe, monkeypatch):
    with pytest.raises(
        ConfigError, match=r"shard_optimizer=True shares AdamW's state .* set data_parallel=True"
    ):
        MAREINFORCEConfig(shard_optimizer=True)
    with pytest.raises(
        ConfigError, match=r"shard_weights=True splits each agent among the copies .* set data_parallel=True"
    ):
        MAREINFORCEConfig(shard_weights=True)
    with pytest.raises(
        ConfigError, match=r"shard_weights=True shards each agent's own model; lora_shared_base=True"
    ):
        MAREINFORCEConfig(data_parallel=True, shard_weights=True, lora_r=4, lora_shared_base=True)
    # Answering a whole training set of 9 items 2 per call: 3 calls on shard 0, 2 on shard 1 (both refuse).
    for rank in (0, 1):
        shard = DataParallel(None, rank, 2)
        assert len(dataset_chunks(9, 4, shard)) == 3 - rank
        with pytest.raises(ConfigError, match=r"the 9 training items give the data shards different numbers"):
            dataset_chunks(9, 4, shard, sharded=True)
        assert len(dataset_chunks(8, 4, shard, sharded=True)) == 2
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="data_parallel=True needs its processes: launch with `torchrun"):
        MAREINFORCETrainer(
            model=qwen_bpe,
            num_agents=2,
            train_dataset=DATA,
            reward_func=two_word_reward,
            args=MAREINFORCEConfig(**run_args(data_parallel=True)),
        )


EXIT_SCRIPT = """
import sys
import torch.distributed as dist
from comarl.distributed import _process_group, finish
_process_group("launch hint")
if sys.argv[1] == "user-destroys":  # as torch's docs advise; comarl's own atexit close must then do nothing
    dist.destroy_process_group()
    print("destroyed")
else:
    print("finished", end="")  # no newline: finish must flush it before leaving
    finish(int(sys.argv[2]))
"""


def test_process_group_ends_cleanly_and_finish_leaves_with_its_status(tmp_path):
    """A user who destroys the group comarl opened exits 0 without a traceback from comarl's atexit close;
    finish() leaves with the given status after flushing (a one-process gloo world)."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    for argv, code, printed in ((["user-destroys"], 0, "destroyed\n"), (["finish", "3"], 3, "finished")):
        with socket.socket() as s:  # a free port for this world's store
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
        done = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=120
        )
        assert (done.returncode, done.stdout) == (code, printed), done.stderr
        assert "Traceback" not in done.stderr, done.stderr


TIED_SCRIPT = """
import sys
import torch
from transformers import AutoModelForCausalLM
from comarl.distributed import DataParallel, _process_group, finish, save_own_model, whole_state_dict
dist = _process_group("launch hint")
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
assert model.lm_head.weight is model.get_input_embeddings().weight  # tied
rank = dist.get_rank()
DataParallel(dist, rank, 2).shard_model(model)
weights = whole_state_dict(model, keep=rank == 0)
if rank == 0:
    save_own_model(model, sys.argv[2], weights)
finish()
"""


def test_sharded_agent_saves_tied_weights_once(qwen_bpe, tmp_path):
    """An agent sharded over two processes, with tied embeddings (Qwen2, as Qwen2.5's small models), is saved as
    save_pretrained saves the model itself: the shared tensor once, not a second copy as lm_head.weight."""
    from safetensors.torch import load_file

    script, out = tmp_path / "save_tied.py", tmp_path / "agent"
    script.write_text(TIED_SCRIPT)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
            *(str(script), qwen_bpe, str(out)),
        ],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, failure(done.stderr)
    saved, source = load_file(out / "model.safetensors"), load_file(Path(qwen_bpe) / "model.safetensors")
    assert sorted(saved) == sorted(source) and "lm_head.weight" not in saved
    assert all(torch.equal(saved[k], source[k]) for k in source)


class _TwoIdenticalProcesses:
    """A torch.distributed stand-in for two processes holding the same gradients: all_reduce doubles the tensor.
    It records the size of every collective."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def all_reduce(self, tensor: torch.Tensor, group=None) -> None:  # noqa: ANN001
        self.sizes.append(tensor.numel())
        tensor.mul_(2)


def test_gradient_sum_is_in_place_through_bounded_buckets():
    """all_reduce_grads writes the sums into the gradients it was given (no second copy of every gradient), one
    collective per bucket of at least bucket_elements values, and a parameter without a gradient gets the sum."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 4, 5, 2)]
    for k, p in enumerate(params[:3]):
        p.grad = torch.arange(p.numel(), dtype=torch.float) + k
    before = [p.grad for p in params[:3]]
    dist = _TwoIdenticalProcesses()
    comarl.distributed.Processes(dist, rank=0, world_size=2).all_reduce_grads(params, bucket_elements=6)
    assert dist.sizes == [7, 7]  # (3 + 4) >= 6, then 5 + 2
    assert all(p.grad is g for p, g in zip(params, before))
    assert params[1].grad.tolist() == [2.0, 4.0, 6.0, 8.0]  # 2 x (arange(4) + 1)
    assert params[2].grad.tolist() == [4.0, 6.0, 8.0, 10.0, 12.0]
    assert params[3].grad.tolist() == [0.0, 0.0]
    dist.sizes.clear()
    comarl.distributed.Processes(dist, rank=0, world_size=2).all_reduce_grads(params)
    assert dist.sizes == [14] and params[0].grad.tolist() == [
        0.0,
        4.0,
        8.0,
    ]  # one collective for a small model


@pytest.mark.slow
def test_cli_demo_under_data_parallel_resumes(tmp_path):
    """`comarl train` of the demo task in two processes, stopped after step 1 and relaunched with --resume: every
    process builds the tiny team into the same folders, so the sources the checkpoint records are every process's
    (each used to build its own rank_<r>/ copy, and the second process refused to resume)."""
    out = tmp_path / "run"
    spec = tmp_path / "run.yaml"

    def launch(steps: int, *extra: str) -> subprocess.CompletedProcess:
        spec.write_text(
            "task: demo\nargs:\n  data_parallel: true\n  prompts_per_step: 2\n  num_generations: 2\n"
            f"  max_new_tokens: 3\n  max_steps: {steps}\n  save_steps: 1\n  progress_bar: false\n"
            f"  eval_at_end: false\n  output_dir: {out}\n"
        )
        return subprocess.run(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
                *("-m", "comarl", "train", str(spec), *extra),
            ],
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=300,
        )

    first = launch(1)
    assert first.returncode == 0, failure(first.stderr)
    assert sorted(p.name for p in (out / "base_models").iterdir()) == ["alice-llama", "bob-gpt2"]
    resumed = launch(2, "--resume")
    assert resumed.returncode == 0, failure(resumed.stderr)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
