"""The post-training story at tiny size, each step a command on the previous step's run directory, as the
README types it: pretrain, score on a local harness task, SFT, DPO, GRPO, chat, export to Hugging Face (whose
logits transformers reproduces). tests/test_docs.py checks that the README's story runs these commands, in order."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import FAST_COMPILES, SMALL_GPT
from test_harness import local_task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["train.steps=4", "train.log_every=2", "train.eval_every=4", "train.checkpoint_every=4",
         "train.sample_tokens=0", "data.batch_size=8", "data.eval_batches=1"]


def command(module: str, *args: str, cwd: str) -> str:
    """Runs `python -m module args` as a user would; its stderr and stdout, or the failure."""
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILES}
    env.update(PYTHONPATH=REPO, HF_DATASETS_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, f"{module} {' '.join(args)}\n{out.stderr[-3000:]}"
    return out.stderr + out.stdout


def flags(*overrides: str) -> list[str]:
    return [f"--config.{o}" for o in overrides]


def write_lines(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


def last_metrics(run) -> dict:
    last = {}
    for line in open(os.path.join(run, "metrics.jsonl")):
        last.update(json.loads(line))
    return last


@pytest.mark.slow
@pytest.mark.torch
def test_pretrain_score_sft_dpo_grpo_export(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    (tmp_path / "text.txt").write_text("".join(f"{a} + {b} = {a + b}. " for a in range(20) for b in range(20)))
    sums = [(a, b) for a in range(1, 9) for b in range(1, 4)]
    chat = write_lines(tmp_path / "chat.jsonl", [{"prompt": f"{a} + {b} =", "completion": str(a + b)}
                                                 for a, b in sums])
    pairs = write_lines(tmp_path / "pairs.jsonl", [{"prompt": [{"role": "user", "content": f"{a} + {b} ="}],
                                                    "chosen": str(a + b), "rejected": str(a + b + 1)}
                                                   for a, b in sums])
    prompts = write_lines(tmp_path / "prompts.jsonl", [{"prompt": f"{a} + {b} =", "answer": str(a + b)}
                                                       for a, b in sums])
    tasks = local_task(tmp_path / "tasks")
    run = lambda module, *args: command(module, *args, cwd=str(tmp_path))  # noqa: E731

    small = [o for o in SMALL_GPT if not o.startswith(("train.", "data.batch_size", "data.eval_batches"))]
    run("transformer.train", "--config", os.path.join(REPO, "configs/gpt.py:tiny"), "--workdir", "pre",
        *flags(*small, "model.max_len=48", "data.source=text.txt", "data.eval_fraction=0.2", *STEPS))
    scored = run("transformer.evaluate", "--workdir", "pre", "--tasks", "sums_mc", "--include_path", tasks)
    assert "sums_mc" in scored
    assert any("eval/harness/sums_mc/acc" in json.loads(line) for line in open(tmp_path / "pre" / "evals.jsonl"))

    run("transformer.train", "--config", os.path.join(REPO, "configs/sft.py:init_from=pre"), "--workdir", "sft",
        *flags(f"data.train_path={chat}", f"data.eval_path={chat}", "data.seq_len=24", *STEPS))
    run("transformer.train", "--config", os.path.join(REPO, "configs/dpo.py:init_from=sft"), "--workdir", "dpo",
        *flags(f"data.train_path={pairs}", f"data.eval_path={pairs}", "data.seq_len=24", *STEPS))
    assert "eval/rewards/accuracies" in last_metrics(tmp_path / "dpo")
    run("transformer.train", "--config", os.path.join(REPO, "configs/grpo.py:init_from=dpo"), "--workdir", "grpo",
        *flags(f"data.train_path={prompts}", f"data.eval_path={prompts}", "data.seq_len=16",
               "grpo.group_size=2", "grpo.max_new_tokens=4", "grpo.eval_prompts=2", "grpo.rewards=numeric", *STEPS))
    assert np.isfinite(last_metrics(tmp_path / "grpo")["train/reward"])

    assert run("transformer.chat", "--workdir", "grpo", "--message", "3 + 1 =", "--max_new_tokens", "4").strip()
    exported = run("transformer.convert", "--workdir", "grpo", "--to_hf", "hf")
    assert "GPT2LMHeadModel" in exported
    from transformer import rundir
    ours = rundir.open(str(tmp_path / "grpo"))
    ids = np.array([[1, 50, 43, 32, 51, 32, 61, 32]], np.int32)
    logits = np.asarray(ours.model().apply({"params": ours.restore_params()}, ids))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        expected = theirs(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4)
