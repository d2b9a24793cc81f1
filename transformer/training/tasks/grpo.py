"""Reinforcement learning with verifiable rewards (GRPO): sample G completions per prompt, score them, and
step the clipped policy-ratio objective on group-normalised advantages (`training.grpo_loss`).

Glossary of shapes: P prompts per rollout batch, G completions per prompt (config.grpo.group_size),
B = P * G rollouts = config.data.batch_size, N new tokens (config.grpo.max_new_tokens), W the fixed row
width (config.data.seq_len: at least the longest prompt + N). A train batch is {'seqs': int32 [B, W]
(prompt ‖ completion ‖ 0), 'starts': int32 [B], 'mask', 'old_logp' (and 'ref_logp' with a KL): float32
[B, N], 'advantages', 'reward', 'correct', 'rollout_seconds': float32 [B]}.

Prompts are JSON-lines records {"prompt": text} or {"messages": [...]}, with whatever their rewards read
(e.g. "answer"), rendered by the run's chat template where config.init_from has one (stopping at its end of
turn), else encoded as plain text. Rollouts need the params, so the task is on-policy
(`tasks.OnPolicy`): the loop calls `roll_out(model, params, step)` before asking for step's batch. Every
config.grpo.updates_per_rollout steps a new batch is sampled with the params of that step (the key:
`rollouts.rollout_key(seed, step)`), scored and saved to the workdir (`rollouts/train_batch.npz`), so a run
stopped between rollouts resumes on the very batch it had. The KL penalty's reference is the starting
policy: under LoRA the params with the adapters left out (no copy); with full weights config.init_from's
params, held as a second copy on the devices (one more copy of the weights, and one forward pass per
rollout batch). Eval (at step 0 too: the baseline) samples one greedy completion per held-out prompt, writes
them with their rewards to `rollouts/eval_STEP.jsonl` and logs eval/reward and eval/accuracy (the share the
first reward scores >= 1) with the other eval metrics; the jitted eval reports the held-out answers' loss
(records with an "answer"). Each reward is called on sample completions when the task is built, so that a
reward that answers wrongly stops the launch, not the first rollout. In a run of several processes each rolls
out a share of the prompts with the whole params gathered onto its first device (`inference.hosts`), and
every process scores the whole batch and keeps its rows.
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from transformer import rundir
from transformer.data.text import chat_templates, conversations, order
from transformer.inference import hosts, rollouts, sampling
from transformer.layers import lora
from transformer.training import grpo_loss, rewards, tasks

ROLLOUTS = "rollouts"  # the run directory's folder of the held rollout batch and each eval's rollouts
HELD = "train_batch.npz"
SHOWN = 2


def check(config) -> None:
    g = config.grpo
    tasks.check_post_training(config, "trains a fine-tuned run", "prompts")
    if config.data.batch_size % g.group_size:
        raise ValueError(f"config.data.batch_size={config.data.batch_size} (rollouts per step) must be a multiple "
                         f"of config.grpo.group_size={g.group_size}")
    for key in ("group_size", "max_new_tokens", "updates_per_rollout"):
        if g[key] < 1:
            raise ValueError(f"config.grpo.{key}={g[key]} must be at least 1")
    if g.loss_type not in grpo_loss.LOSS_TYPES:
        raise ValueError(f"config.grpo.loss_type={g.loss_type!r}: choose one of {', '.join(grpo_loss.LOSS_TYPES)}")
    if g.advantage_scale not in grpo_loss.ADVANTAGE_SCALES:
        raise ValueError(f"config.grpo.advantage_scale={g.advantage_scale!r}: choose one of "
                         f"{', '.join(grpo_loss.ADVANTAGE_SCALES)}")
    if g.kl_weight < 0:
        raise ValueError(f"config.grpo.kl_weight={g.kl_weight} must be >= 0 (0: no KL penalty)")
    rewards.parse(g.rewards)


def from_data(config) -> list[str]:
    chat = rundir.open(config.init_from).chat_format()
    return [f"grpo: prompts rendered by {config.init_from}'s chat template (end of turn {chat.end_ids[0]})" if chat
            else f"grpo: {config.init_from} has no chat template: plain prompts",
            *rewards.user_code(config.grpo.rewards)]


def prompt_format(init_from: str):
    """The run's chat format, where it has one (chat_template.json), else its tokenizer."""
    run = rundir.open(init_from)
    return run.chat_format() or run.tokenizer(framed=False)


def read_prompts(path: str) -> list[dict]:
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                record = json.loads(line)
                if not isinstance(record, dict) or not ({"prompt", "messages"} & set(record)):
                    raise ValueError(f"{path}:{number}: a prompt record needs a 'prompt' or 'messages' field")
                records.append(record)
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


class GRPOTask:
    item_name = "rollouts"

    def __init__(self, config, workdir: str, rows: np.ndarray, start_step: int):
        self.config, self.g, self.rows, self.workdir, d = config, config.grpo, rows, workdir, config.data
        self.format = prompt_format(config.init_from)
        self.chat = isinstance(self.format, chat_templates.ChatFormat)
        if jax.process_index() == 0:
            (self.format.tokenizer if self.chat else self.format).save(workdir)
            if self.chat:
                self.format.save(workdir)
        self.stop_id = self.format.end_ids[0] if self.chat else None
        every = read_prompts(d.train_path)
        if d.eval_path:
            self.train, self.held = every, read_prompts(d.eval_path)
        else:
            out = conversations.split([[r] for r in every], d.eval_fraction)
            self.train, self.held = [r for r, o in zip(every, out) if not o], [r for r, o in zip(every, out) if o]
        if not self.train:
            raise ValueError(f"{d.train_path}: every prompt is held out: lower config.data.eval_fraction")
        self.train_ids = [self.encode(r) for r in self.train]
        self.held_ids = [self.encode(r) for r in self.held]
        self.width = d.seq_len
        longest = max(map(len, self.train_ids + self.held_ids)) + self.g.max_new_tokens
        if longest > self.width:
            raise ValueError(f"the longest prompt plus config.grpo.max_new_tokens={self.g.max_new_tokens} is "
                             f"{longest} tokens, more than config.data.seq_len={self.width}: raise it")
        self.rewards = rewards.parse(self.g.rewards)
        rewards.at_launch(self.rewards, self.train)
        self.items_per_step = d.batch_size
        self.batch, self.batch_step, self.seconds = None, None, 0.0
        self.logp, self.reference, self.shown = None, None, []
        self.eval = self._eval_batches()
        self._resume(start_step)
        if jax.process_index() == 0:
            held = conversations.split_said(len(self.held), len(every), "prompts", d.eval_path, d.eval_fraction)
            print(f"data: {d.train_path}: {len(self.train):,} prompts for training, {held}; "
                  f"{d.batch_size // self.g.group_size} prompts x {self.g.group_size} completions per rollout "
                  f"batch, {self.g.updates_per_rollout} steps on each", file=sys.stderr)

    def encode(self, record: dict) -> np.ndarray:
        messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        if self.chat:
            return np.asarray(self.format.prompt(messages), np.int32)
        return np.asarray(self.format.encode("".join(m["content"] for m in messages)), np.int32)

    def decode(self, ids) -> str:
        return self.format.decode(ids if self.stop_id is None else sampling.until_stop(ids, (self.stop_id,)))

    # the rollouts

    def rollout_step(self, step: int) -> int:
        return step - step % self.g.updates_per_rollout

    def _resume(self, start: int) -> None:
        """The saved rollout batch of start's rollout step, where the run resumes between rollouts."""
        path, wanted = os.path.join(self.workdir, ROLLOUTS, HELD), self.rollout_step(start)
        saved = dict(np.load(path)) if os.path.exists(path) else {}
        if saved and int(saved.pop("step")) == wanted:
            self.seconds = float(saved.pop("seconds"))
            self.batch, self.batch_step = saved, wanted
        elif wanted < start:
            raise FileNotFoundError(f"{path}: the rollouts of step {wanted} are missing, so step {start} cannot "
                                    "resume exactly: resume from a checkpoint at a rollout step")

    def roll_out(self, model, params, step: int) -> None:
        """Samples, scores and saves the rollout batch of `step` with `params`, where a new one starts there."""
        if self.batch_step == self.rollout_step(step):
            return
        jax.block_until_ready(params)  # the update before is not the rollouts' time
        start, g, n = time.perf_counter(), self.g, self.g.max_new_tokens
        params = hosts.local_params(params)  # on several processes each rolls out its share with the whole params
        if self.logp is None:
            self.logp = jax.jit(lambda p, s, st: grpo_loss.token_logprobs(model, p, s, st, n))
        count = self.config.data.batch_size // g.group_size
        index = order.epochs(step // g.updates_per_rollout * count + np.arange(count), len(self.train),
                             (self.config.train.seed, 6))
        drawn = rollouts.sample(model, params, [self.train_ids[i] for i in index], g.group_size,
                                rollouts.rollout_key(self.config.train.seed, step), max_new_tokens=n,
                                stop_id=self.stop_id)  # the policy itself (temperature 1, no cut): the ratio's
        examples = [self.train[i] for i in index for _ in range(g.group_size)]
        total, each = rewards.score(self.rewards, [self.decode(c) for c in drawn.completions], examples)
        seqs, starts = self.sequences(drawn)
        batch = {"seqs": seqs, "starts": starts, "mask": drawn.mask, "reward": total,
                 "advantages": np.asarray(grpo_loss.group_advantages(jnp.asarray(total), g.group_size,
                                                                     g.advantage_scale)),
                 "correct": (next(iter(each.values())) >= 1).astype(np.float32),
                 "old_logp": drawn.logp if drawn.policy else np.asarray(self.logp(params, seqs, starts))}
        if g.kl_weight:
            batch["ref_logp"] = np.asarray(self.logp(self.reference_params(params), seqs, starts))
        self.batch, self.batch_step, self.seconds = batch, step, time.perf_counter() - start
        if jax.process_index() == 0:
            self._save(batch, step)

    def _save(self, batch: dict, step: int) -> None:
        os.makedirs(os.path.join(self.workdir, ROLLOUTS), exist_ok=True)
        path = os.path.join(self.workdir, ROLLOUTS, HELD)
        with open(path + ".tmp", "wb") as f:
            np.savez(f, step=step, seconds=self.seconds, **batch)
        os.replace(path + ".tmp", path)

    def reference_params(self, params):
        """The starting policy: under LoRA the params without their adapters, else config.init_from's."""
        if lora.ADAPTERS in params:
            return {k: v for k, v in params.items() if k != lora.ADAPTERS}
        if self.reference is None:
            self.reference = rundir.open(self.config.init_from).restore_onto(params)
        return self.reference

    def sequences(self, drawn: rollouts.Rollouts) -> tuple[np.ndarray, np.ndarray]:
        seqs, starts = grpo_loss.sequences(drawn)
        return np.pad(seqs, ((0, 0), (0, self.width - seqs.shape[1]))), starts

    # the Task protocol

    def init_inputs(self):
        return (jnp.zeros((1, self.width - 1), jnp.int32),)

    def train_batch(self, step: int) -> dict:
        """The rows of the rollout batch `roll_out` made at step's rollout step; before any is made, a batch
        of its shapes with nothing to learn (mask 0), which the loop compiles against."""
        if self.batch is None:
            b, n = self.config.data.batch_size, self.g.max_new_tokens
            zeros = lambda *shape: np.zeros(shape, np.float32)
            batch = {"seqs": np.zeros((b, self.width), np.int32), "starts": np.zeros(b, np.int32), "mask": zeros(b, n),
                     "old_logp": zeros(b, n), "advantages": zeros(b), "reward": zeros(b), "correct": zeros(b)}
            batch |= {"ref_logp": zeros(b, n)} if self.g.kl_weight else {}
        elif self.batch_step != self.rollout_step(step):
            raise RuntimeError(f"step {step}'s rollouts were not made: call roll_out(model, params, {step}) first")
        else:
            batch = self.batch
        seconds = self.seconds if step == self.batch_step else 0.0
        rows = {k: v[self.rows] for k, v in batch.items()}
        return rows | {"rollout_seconds": np.full(len(self.rows), seconds, np.float32)}

    def eval_batches(self) -> list[dict]:
        return self.eval

    def _eval_batches(self) -> list[dict]:
        """The held-out prompts with their answers (as the assistant's reply) in batches of rows."""
        b, n = self.config.data.batch_size, self.g.max_new_tokens
        answered = [(ids, r) for ids, r in zip(self.held_ids, self.held) if "answer" in r]
        answered = answered[:self.config.data.eval_batches * b]
        batches = []
        for i in range(0, len(answered), b):
            part = answered[i:i + b]
            seqs, starts = np.zeros((b, self.width), np.int32), np.zeros(b, np.int32)
            mask = np.zeros((b, n), np.float32)
            for row, (ids, record) in enumerate(part):
                answer = self.answer_ids(str(record["answer"]))[:n]
                seqs[row, :len(ids)], seqs[row, len(ids):len(ids) + len(answer)] = ids, answer
                starts[row], mask[row, :len(answer)] = len(ids) - 1, 1.0
            batches.append({"seqs": seqs[self.rows], "starts": starts[self.rows], "mask": mask[self.rows]})
        return batches

    def answer_ids(self, answer: str) -> np.ndarray:
        tokenizer = self.format.tokenizer if self.chat else self.format
        ids = np.asarray(tokenizer.encode(answer), np.int32)
        return ids if self.stop_id is None else np.append(ids, self.stop_id)

    def loss(self, model, params, batch, rng):
        n = batch["mask"].shape[1]
        logp = grpo_loss.token_logprobs(model, params, batch["seqs"], batch["starts"], n)
        g, mask = self.g, batch["mask"]
        loss, metrics = grpo_loss.policy_loss(
            logp, batch["old_logp"], batch["advantages"], mask, clip_low=g.clip_low, clip_high=g.clip_high,
            loss_type=g.loss_type, kl_weight=g.kl_weight, ref_logp_BT=batch.get("ref_logp"))
        tokens = jnp.maximum(mask.sum(), 1.0)
        return loss, {"loss": loss, **metrics, "reward": batch["reward"].mean(), "reward_std": batch["reward"].std(),
                      "accuracy": batch["correct"].mean(), "completion_length": mask.sum(axis=1).mean(),
                      "entropy": -(batch["old_logp"] * mask).sum() / tokens,
                      "rollout_seconds": batch["rollout_seconds"].mean()}

    def loss_weights(self, batch) -> dict:
        mask = batch["mask"]
        rows = jnp.asarray(mask.shape[0], jnp.float32)
        return {"loss": {"dapo": mask.sum(), "grpo": rows, "dr_grpo": rows * mask.shape[1]}[self.g.loss_type]}

    def eval_outputs(self, model, params, batch) -> dict:
        n = batch["mask"].shape[1]
        logp = grpo_loss.token_logprobs(model, params, batch["seqs"], batch["starts"], n)
        return {"loss_sum": -(logp * batch["mask"]).sum(), "count": batch["mask"].sum()}

    def eval_metrics(self, outputs: list[dict]) -> dict:
        count = sum(float(o["count"]) for o in outputs)
        return {"eval/answer_loss": sum(float(o["loss_sum"]) for o in outputs) / max(count, 1.0)}

    def eval_rollouts(self, model, params, step: int) -> dict[str, float]:
        """Greedy completions of the first config.grpo.eval_prompts held-out prompts, scored and written:
        eval/reward, eval/accuracy (the share the first reward scores >= 1) and eval/completion_length."""
        held = list(zip(self.held_ids, self.held))[:self.g.eval_prompts]
        self.shown = []
        if not held:
            return {}
        drawn = rollouts.sample(model, hosts.local_params(params), [ids for ids, _ in held], 1,
                                rollouts.rollout_key(0, step), max_new_tokens=self.g.max_new_tokens, temperature=0.0,
                                stop_id=self.stop_id)
        texts = [self.decode(c) for c in drawn.completions]
        total, each = rewards.score(self.rewards, texts, [r for _, r in held])
        correct = next(iter(each.values())) >= 1
        path = os.path.join(self.workdir, ROLLOUTS, f"eval_{step:06d}.jsonl")
        summary = {"step": step, "reward": float(total.mean()), "accuracy": float(correct.mean()),
                   "completion_length": float(drawn.mask.sum(axis=1).mean()), "prompts": len(held)}
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                for i, ((_, record), text) in enumerate(zip(held, texts)):
                    f.write(json.dumps({"step": step, **record, "completion": text, "reward": float(total[i]),
                                        **{k: float(v[i]) for k, v in each.items()}}) + "\n")
            with open(os.path.join(self.workdir, ROLLOUTS, "eval.jsonl"), "a") as f:
                f.write(json.dumps(summary) + "\n")
        self.shown = [f"eval rollouts: greedy, {len(held)} held-out prompts -> {path}"]
        self.shown += [f"--- {shown_prompt(record)!r} -> {text!r}" for (_, record), text in zip(held[:SHOWN], texts)]
        return {f"eval/{k}": summary[k] for k in ("reward", "accuracy", "completion_length")}

    def report(self, model, params, step: int) -> list[str]:
        """The last eval's rollouts: where they are written, and the first completions."""
        return self.shown


def build(config, workdir: str, rows: np.ndarray, start_step: int) -> GRPOTask:
    return GRPOTask(config, workdir, rows, start_step)


def shown_prompt(record: dict) -> str:
    """The prompt a person reads in a report line: its text, or its last message's."""
    return record["prompt"] if "prompt" in record else record["messages"][-1]["content"]
