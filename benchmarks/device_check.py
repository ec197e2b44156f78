"""One short, prepared check of the accelerator paths, for a session that is lent a GPU.

    python benchmarks/device_check.py                 # on CUDA (what it is for)
    python benchmarks/device_check.py --device cpu    # the same checks on the CPU (to test this script)

Each check prints one line ``CHECK <name> ok|FAIL <detail>``; the exit status is 1 when any check
fails. Everything is built offline (tiny models from ``comarl.tiny`` and the demo team), so the
device machine needs no network. The checks:

1. ``decode``: the engine's greedy decode, through comarl's own step (``LlamaDecoder``), equals ``model.generate`` on the
   device;
2. ``bf16_step``: one MAGRPO step with ``bf16=True`` (autocast) changes every parameter, weights stay fp32,
   generation and the update both ran in bf16, and the memory check read the device's free memory;
3. ``demo``: the demo game for 200 steps on the device (as its CPU learning test); greedy joint success ≥ 0.9;
4. ``agent_parallel``: two processes (torchrun, one agent each, sharing the device when there is one
   GPU) train what one process trains on a heterogeneous team;
5. ``trainers``: two steps on the device of MADPO with its defaults (candidates of the initial team, whose
   reference log-probs are cached), IPPO (value heads) and MAGRPO with LoRA, activation checkpointing and a
   KL reference; each must move the weights it trains and log finite losses;
6. ``resume``: a run stopped after its checkpoint and resumed on the device ends with the weights of the
   unbroken run (to 1e-5: CUDA's embedding backward adds in no fixed order), and on a GPU the same checkpoint
   resumed with the agents on the CPU stops with the ConfigError that names the device.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def check_decode(device: str, base: Path) -> str:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from comarl.agents import Agent
    from comarl.engines import HFEngine, SamplingParams
    from comarl.llama_decoder import unsupported_reason
    from comarl.tiny import tiny_model

    path = tiny_model(base / "qwen", kind="bpe", arch="qwen2", seed=0)
    agent = Agent.from_pretrained(path, device=device)
    reason = unsupported_reason(agent.model)
    if reason is not None:  # the check is of comarl's own decode step on this device
        raise AssertionError(f"LlamaDecoder refused the tiny Qwen2 model: {reason}")
    prompts = ["def add(a, b):", "the agents meet at the"]
    ours = HFEngine().generate(agent, prompts, 1, SamplingParams(max_new_tokens=12, do_sample=False))
    ids, mask = agent.encode(prompts)
    model = AutoModelForCausalLM.from_pretrained(path).to(device)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, pad_token_id=agent.tokenizer.pad_token_id)
    theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
    width = min(theirs.shape[1], ours.completion_ids.shape[1])
    same = torch.equal(ours.completion_ids[:, :width].cpu(), theirs[:, :width].cpu())
    if not same:
        raise AssertionError(f"greedy ids differ: {ours.completion_ids.tolist()} vs {theirs.tolist()}")
    return f"{width} tokens equal (LlamaDecoder)"


def check_bf16_step(device: str, base: Path) -> str:
    from comarl import MAGRPOConfig, MAGRPOTrainer
    from comarl.tiny import tiny_model

    path = tiny_model(base / "qwen_bf16", kind="bpe", arch="qwen2", seed=0)
    data = [{"prompt": p} for p in ("def add(a, b):", "alice and bob", "the agents meet at", "return a + b")]
    trainer = MAGRPOTrainer(
        model=str(path),
        num_agents=2,
        train_dataset=data,
        reward_func=lambda a, b: [len(x) / 10 - len(y) / 20 for x, y in zip(a, b)],
        args=MAGRPOConfig(
            max_steps=1,
            prompts_per_step=2,
            num_generations=3,
            max_new_tokens=6,
            learning_rate=1e-3,
            bf16=True,
            agent_devices=device,
            progress_bar=False,
            reward_call="batched",
        ),
    )
    before = [[p.detach().clone() for p in a.model.parameters()] for a in trainer.team]
    seen = set()  # (gradients on: the update; off: generation, logits dtype)
    trainer.team[0].model.lm_head.register_forward_hook(
        lambda m, i, out: seen.add((torch.is_grad_enabled(), out.dtype))
    )
    trainer.train()
    if seen != {(False, torch.bfloat16), (True, torch.bfloat16)}:
        raise AssertionError(
            f"logits of generation / update: {sorted(map(str, seen))}, expected bf16 in both"
        )
    if trainer.memory_summary is None or device.split(":")[0] not in trainer.memory_summary:
        raise AssertionError(f"memory_summary={trainer.memory_summary!r} does not name {device}")
    for i, agent in enumerate(trainer.team):
        params = list(agent.model.parameters())
        if any(p.dtype != torch.float32 for p in params):
            raise AssertionError(f"agent {i}: weights are not fp32 after a bf16 step")
        unchanged = sum(torch.equal(p, q) for p, q in zip(params, before[i]))
        if unchanged:
            raise AssertionError(f"agent {i}: {unchanged} parameter tensors did not change")
    return f"agents on {trainer.team[0].device}, every parameter moved, weights fp32, bf16 logits; {trainer.memory_summary}"


def check_demo(device: str, base: Path) -> str:
    from comarl import MAGRPOTrainer
    from comarl.tasks import demo

    paths = demo.build_team(base / "demo")
    args = demo.demo_config(None, max_steps=200, progress_bar=False)
    args.agent_devices = device
    trainer = demo.demo_trainer(MAGRPOTrainer, paths, args)
    started = time.perf_counter()
    trainer.train()
    success = trainer.evaluate()["eval/success"]
    if success < 0.9:
        raise AssertionError(f"greedy success {success:.3f} < 0.9 after 200 steps")
    return f"greedy success {success:.3f}, {time.perf_counter() - started:.0f} s"


def check_agent_parallel(device: str, base: Path) -> str:
    # The torchrun test of the suite, pointed at the device: two processes equal one process.
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        str(ROOT / "tests" / "test_distributed.py"),
        "-k",
        "test_two_processes_train_what_one_process_trains and MAREINFORCE",
        "-p",
        "no:cacheprovider",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if done.returncode != 0:
        raise AssertionError(done.stdout[-2000:] + done.stderr[-2000:])
    return done.stdout.strip().splitlines()[-1]


def check_trainers(device: str, base: Path) -> str:
    import comarl
    from comarl.tiny import tiny_model

    path = str(tiny_model(base / "qwen_trainers", kind="bpe", arch="qwen2", seed=0))
    data = [{"prompt": p} for p in ("def add(a, b):", "alice and bob", "the agents meet at", "return a + b")]

    def length_reward(a, b):  # noqa: ANN001, ANN202
        return [len(x) / 10 - len(y) / 20 for x, y in zip(a, b)]

    shared = {
        "max_steps": 2,
        "prompts_per_step": 2,
        "num_generations": 2,
        "max_new_tokens": 6,
        "learning_rate": 1e-3,
        "agent_devices": device,
        "progress_bar": False,
    }
    cases = {
        "MADPO": (comarl.MADPOTrainer, comarl.MADPOConfig(**shared)),
        "IPPO": (comarl.IPPOTrainer, comarl.IPPOConfig(**shared)),
        "MAGRPO+LoRA": (
            comarl.MAGRPOTrainer,
            comarl.MAGRPOConfig(**shared, lora_r=4, gradient_checkpointing=True, beta=0.05),
        ),
    }
    details = []
    for name, (cls, args) in cases.items():
        trainer = cls(model=path, num_agents=2, train_dataset=data, reward_func=length_reward, args=args)
        before = [
            {n: p.detach().clone() for n, p in a.model.named_parameters() if p.requires_grad}
            for a in trainer.team
        ]
        metrics = trainer.train()
        for i, agent in enumerate(trainer.team):
            if str(agent.device).split(":")[0] != device.split(":")[0]:
                raise AssertionError(f"{name}: agent {i} is on {agent.device}, not {device}")
            trained = dict(agent.model.named_parameters())
            still = [n for n, p in before[i].items() if torch.equal(p, trained[n].detach())]
            if still:
                raise AssertionError(
                    f"{name}: agent {i} did not move {len(still)} trained tensors, e.g. {still[0]}"
                )
        losses = [v for k, v in metrics.items() if k.endswith("loss")]
        if not losses or not all(math.isfinite(v) for v in losses):
            raise AssertionError(f"{name}: losses {losses}")
        details.append(name)
    return ", ".join(details) + " moved every trained tensor"


def check_resume(device: str, base: Path) -> str:
    from comarl import ConfigError, MAGRPOConfig, MAGRPOTrainer
    from comarl.tiny import tiny_model

    path = tiny_model(base / "qwen_resume", kind="bpe", arch="qwen2", seed=0)
    data = [{"prompt": p} for p in ("def add(a, b):", "alice and bob", "the agents meet at", "return a + b")]

    def reward(crash_at: int | None):  # noqa: ANN202
        calls = [0]

        def length_reward(a, b):  # noqa: ANN001, ANN202
            calls[0] += 1
            if calls[0] == crash_at:
                raise RuntimeError("the machine went away")
            return [len(x) / 10 - len(y) / 20 for x, y in zip(a, b)]

        return length_reward

    def trainer(out: Path, crash_at: int | None = None, on: str = device) -> MAGRPOTrainer:
        return MAGRPOTrainer(
            model=str(path),
            num_agents=2,
            train_dataset=data,
            reward_func=reward(crash_at),
            args=MAGRPOConfig(
                max_steps=4,
                save_steps=2,
                prompts_per_step=2,
                num_generations=3,
                max_new_tokens=6,
                learning_rate=1e-3,
                beta=0.05,
                agent_devices=on,
                output_dir=str(out),
                progress_bar=False,
                reward_call="batched",
                seed=11,
            ),
        )

    unbroken = trainer(base / "unbroken")
    unbroken.train()
    try:
        trainer(base / "stopped", crash_at=3).train()  # steps 1-2 and the checkpoint at 2; dies in step 3
    except RuntimeError as error:
        if "went away" not in str(error):
            raise
    else:
        raise AssertionError("the run meant to stop in step 3 did not stop")
    resumed = trainer(base / "stopped")
    resumed.train(resume_from_checkpoint=True)
    with torch.no_grad():
        worst = max(
            float((p - q).abs().max())
            for a, b in zip(unbroken.team, resumed.team)
            for p, q in zip(a.model.parameters(), b.model.parameters())
        )
    if worst > 1e-5:
        raise AssertionError(f"resumed weights differ from the unbroken run's by up to {worst:.2e}")
    detail = f"resumed = unbroken to {worst:.1e}"
    if device.startswith("cuda"):
        try:
            trainer(base / "stopped", on="cpu").train(resume_from_checkpoint=True)
        except ConfigError as error:
            if "sampled on cuda when the checkpoint was written and is on cpu now" not in str(error):
                raise
            detail += "; on the CPU: the ConfigError"
        else:
            raise AssertionError("a GPU checkpoint resumed on the CPU did not stop")
    return detail


CHECKS = {
    "decode": check_decode,
    "bf16_step": check_bf16_step,
    "demo": check_demo,
    "agent_parallel": check_agent_parallel,
    "trainers": check_trainers,
    "resume": check_resume,
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run only these checks")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CHECK device FAIL torch.cuda.is_available() is False")
        return 1
    failed = 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or CHECKS:
            try:
                detail = CHECKS[name](args.device, Path(tmp))
                print(f"CHECK {name} ok {detail}", flush=True)
                results[name] = {"ok": True, "detail": detail}
            except Exception as error:  # noqa: BLE001 - report every check, then fail at the end
                failed += 1
                print(f"CHECK {name} FAIL {type(error).__name__}: {error}", flush=True)
                results[name] = {"ok": False, "detail": f"{type(error).__name__}: {error}"}
    print("SUMMARY " + json.dumps({"device": args.device, "torch": torch.__version__, "checks": results}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
