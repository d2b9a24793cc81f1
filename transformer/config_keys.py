"""Every key of a config a user can set: its value, its default and its one-line meaning.

    python -m transformer.inspect --config configs/gpt.py:tiny --config.optim.lr=1e-3 --keys

A key's meaning is its line in `MEANINGS` below (or a family's or config file's own line in `OWN`): a new key gets
its line there, and tests/test_config.py checks that every key of every config file has one. A key's default is
its family's base: the module field's default for config.model (but a shape the config file leaves to the data:
its 0), and for the rest the value the config file sets before its preset's training settings and any override.
"""

import pathlib

from transformer import config as config_lib
from transformer import models
from transformer.models import common
from transformer.training import shapes

WIDTH = 28  # the most characters of a value shown


def meaning(key: str, family: str, config_file: str | None = None) -> str:
    """The one-line meaning of dotted `key` of a config of `family` made by `config_file` (configs/NAME.py;
    None: the family's own) ('' where the table has none)."""
    owners = [family] if key.startswith("model.") or not config_file else [pathlib.Path(config_file).stem, family]
    own = next((table for table in map(OWN.get, owners) if table and key in table), {})
    return own.get(key, MEANINGS.get(key, ""))


def defaults(config, base) -> dict:
    """Each key's default: the family module's field defaults for config.model, else `base`'s value (and
    `base`'s for a model key that the config file leaves to the data: shapes.FROM_DATA)."""
    fam = models.family(config.model.family)
    found = config_lib.leaves(base) if base is not None else {}
    left = [key for key in shapes.FROM_DATA if key in found and found[key] == shapes.FROM_DATA[key]]
    found.update({f"model.{k}": v for k, v in common.fields_of(fam.module).items() if f"model.{k}" not in left},
                 **{"model.family": fam.name})
    return found


def rows(config, base=None, config_file: str | None = None) -> list[tuple[str, str, str, str]]:
    """(key, value, default, meaning) of every settable key of `config`; a value that differs from its
    default is marked '*'."""
    family, base_values = config.model.family, defaults(config, base)
    found = []
    for key, value in sorted(config_lib.leaves(config).items()):
        default = base_values.get(key, "")
        mark = "*" if key in base_values and _same(value) != _same(default) else ""
        found.append((key, _short(value) + mark, _short(default) if key in base_values else "",
                      meaning(key, family, config_file)))
    return found


def format_keys(config, base=None, config_file: str | None = None) -> str:
    """The key table: a line per key, `key  value  default  meaning`."""
    table = [("key", "value", "default", "meaning"), *rows(config, base, config_file)]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3] for row in table]
    return "\n".join(lines) + "\n(* differs from the default: set by the preset or an override; "\
        "set any key with --config.KEY=VALUE)"


def _same(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _short(value) -> str:
    text = repr(_same(value))
    return text if len(text) <= WIDTH else text[:WIDTH - 3] + "..."


# A key's meaning in every family; OWN: a family's own where it differs (by family for config.model's keys,
# by the config file's name, configs/NAME.py, for the others).
MEANINGS = {
    "dpo.beta": "the strength of the reference's pull (IPO's tau; SimPO's scale, ~2)",
    "dpo.disable_dropout": "True: the policy trains without dropout (model and LoRA), as TRL's DPOConfig; False "
                           "keeps config.model.dropout and config.lora.dropout",
    "dpo.gamma": "simpo: the reward margin",
    "dpo.loss": "sigmoid (DPO) | ipo | simpo",
    "grpo.advantage_scale": "std: divide by the group's spread (GRPO) | none (Dr. GRPO)",
    "grpo.clip_high": "and above 1 + clip_high (DAPO's clip-higher)",
    "grpo.clip_low": "the ratio's clip below 1 - clip_low",
    "grpo.eval_prompts": "held-out prompts answered greedily and written at each eval",
    "grpo.group_size": "completions sampled per prompt (advantages are normalised within them)",
    "grpo.kl_weight": "> 0: the k3 KL to the starting policy (LoRA: the adapters off)",
    "grpo.loss_type": "dapo (each token alike) | grpo (each completion alike) | dr_grpo",
    "grpo.max_new_tokens": "a completion's most tokens (it ends at the chat template's end of turn)",
    "grpo.rewards": "name=weight,...: exact_match | numeric | format | package.module:function (your code: imported "
                    "and run in the training process, again on every relaunch)",
    "grpo.updates_per_rollout": "optimizer steps on each rollout batch before sampling the next",
    "data.augment.crop_padding": "train view: a random crop of the image padded by this many zeros",
    "data.augment.cutmix_alpha": "cutmix's Beta(alpha, alpha) (0: off)",
    "data.augment.flip": "train view: a horizontal flip with probability 1/2",
    "data.augment.mix_switch": "with both on: the probability that a step uses cutmix",
    "data.augment.mixup_alpha": "mixup's Beta(alpha, alpha) (0: off)",
    "data.augment.rand_augment_magnitude": "RandAugment: their strength, of 10",
    "data.augment.rand_augment_ops": "RandAugment: operations per image (0: off)",
    "data.augment.random_resized_crop": "train view: a random crop of `scale` of the area and aspect `ratio`",
    "data.augment.ratio": "random_resized_crop: the range of the crop's aspect ratio",
    "data.augment.scale": "random_resized_crop: the range of the crop's share of the area",
    "data.augment.views": "where train views are made: auto | device | host",
    "data.batch_size": "rows of each step's batch, over all devices",
    "data.crop_fraction": "eval view: the shorter side resized to image_size / this, then centre-cropped",
    "data.document_mask": "each token attends only to its own document within a packed row",
    "data.eval_batches": "batches of each evaluation",
    "data.eval_fraction": "the share of documents held out for eval (split by a hash of each one's name)",
    "data.eval_path": "its eval file, in the same format",
    "data.eval_source": "a store whose eval split is evaluated too, as eval/NAME/*",
    "data.image_side": "images (data.source: digits, .npz, IDX, class folders): viewed at this side (ImageGPT: "
                       "data.seq_len is its square, model.max_len at least that)",
    "data.mean": "per-channel mean in 0..255 (): sampled from statistics_sample images",
    "data.palette_size": "images: the most colours of the k-means palette each pixel becomes the id of (fewer where "
                         "the train images hold fewer)",
    "data.seq_len": "tokens of each training row",
    "data.source": "stdlib | a glob of text, .jsonl or Parquet files | a token store, or several weighted",
    "data.source_eos": "each source ends in [EOS] too (T5's </s>)",
    "data.source_len": "tokens of a source (longer ones are cut)",
    "data.statistics_sample": "train images the channel statistics are sampled from",
    "data.std": "per-channel std in 0..255 (): sampled with the mean",
    "data.target_len": "tokens of a target (longer ones are cut)",
    "data.test_fraction": "the share of the images held out (a fixed draw) where the source has no split",
    "data.text_field": "the field of a JSON line or Parquet row that holds the text",
    "data.tokenizer": "'' (the data's: a store's, init_from's, else wordpiece) | byte | bpe | wordpiece | gpt2 | hf",
    "data.tokenizer_path": "a folder holding the tokenizer's files (gpt2, hf, a BERT vocab.txt)",
    "data.train_path": "a classification task's train file: TSV label<TAB>text, or CoNLL token<TAB>tag",
    "data.val_labels": "ImageNet's flat val/ folder: the file of its labels (FILE,CLASS lines)",
    "data.vocab_size": "ids of a tokenizer trained on the data (0: model.vocab_size)",
    "data.workers": "processes decoding and augmenting on the host (-1: as the CPUs and views need)",
    "init_from": "a run directory (a trained or converted run) whose weights this run starts from",
    "lora.dropout": "dropout of each adapter's input, in training (peft's lora_dropout)",
    "lora.alpha": "the adapters' update is scaled by alpha / R",
    "lora.rank": "the adapters' rank R (0: no adapters, every weight trains)",
    "lora.targets": "kernels adapted: attention, mlp, experts (comma-separated) or regexes of paths",
    "mesh.context": "devices the sequence is split over (ring attention: model.attention=ring)",
    "mesh.data": "devices of the mesh's data axis, each a replica fed its share of the batch (-1: the rest)",
    "mesh.expert": "devices the experts of a mixture-of-experts layer are split over",
    "mesh.fsdp": "devices the params and optimizer state are sharded over (ZeRO-3 / FSDP), also splitting the batch",
    "mesh.rules": "logical axis -> mesh axes (sharding.py)",
    "mesh.tensor": "devices each weight matrix is split over (Megatron tensor parallelism)",
    "model.activation": "the mlp's: gelu | gelu_exact | relu | swiglu | geglu ... (layers/mlp.py)",
    "model.attention": "the attention implementation: auto | dense | blockwise | ring | flash",
    "model.attention_block": "the query and key block of blockwise, ring and flash attention",
    "model.cache_length": "positions of the decode cache (0: max_len; generate sets it)",
    "model.capacity_factor": "capacity: each expert takes ceil(this x L x k / E) token-slots of a sequence",
    "model.channels": "the images' channels (1: grayscale, 3: RGB; 0: the data's)",
    "model.d_model": "the model's width D",
    "model.dense_first": "the first this many Blocks keep a dense mlp (DeepSeek's first_k_dense_replace)",
    "model.dense_layers": "Blocks that keep a dense mlp, by index: '0,2' (Qwen3-MoE's mlp_only_layers)",
    "model.drop_path": "stochastic depth's rate at the top layer (linear from 0 at the bottom)",
    "model.dropout": "the rate of every dropout (0: none)",
    "model.dtype": "what the layers compute in: float32 | bfloat16 | float16",
    "model.embed_norm": "a norm (model.norm) after the embeddings (BLOOM)",
    "model.experts_per_token": "k: the experts the router sends each token to (its top k)",
    "model.family": "the model family, a file of transformer/models/: gpt | bert | vit | encdec",
    "model.global_tokens": "with window > 0: the first positions that see every token ([CLS])",
    "model.head": "lm (logits) | none (the normed hidden states)",
    "model.head_dim": "each head's width Dh (0: d_model / num_heads)",
    "model.image_size": "the side S of the square images it takes (0: the data's, training/shapes.py)",
    "model.logit_softcap": "> 0: logits over the vocabulary are cap x tanh(logits / cap) (Gemma 2; 0: none)",
    "model.logits_bias": "a learned bias on the logits (BART)",
    "model.loss_block": "the most positions whose logits the loss holds at once",
    "model.max_len": "the longest sequence (the learned positions' table)",
    "model.mlp_dim": "the mlp's hidden width F",
    "model.moe_dispatch": "how tokens reach their experts: auto | dropless | capacity | dense (layers/moe.py)",
    "model.moe_every": "Block i (from 0) is a mixture where (i + 1) % moe_every == 0 (Qwen3-MoE's step)",
    "model.moe_mlp_dim": "each expert's hidden width (0: mlp_dim)",
    "model.mup_base_depth": "mup: > 0 multiplies each residual branch by mup_base_depth / num_layers (CompleteP)",
    "model.mup_base_width": "mup: the d_model the learning rate was tuned at (m = d_model / it)",
    "model.norm": "layernorm | rmsnorm",
    "model.norm_epsilon": "the norms' epsilon",
    "model.norm_placement": "where each Block's norms sit: pre | post (of each residual branch)",
    "model.normalize_topk": "the k router weights renormalised to sum to 1 (Mixtral, Qwen3-MoE)",
    "model.nsp": "pretrain adds next-sentence prediction",
    "model.num_classes": "classes of the classifier head (0: the data's)",
    "model.num_decoder_layers": "Blocks of the decoder (0: num_layers)",
    "model.num_experts": "> 0: a mixture of this many experts as mlp (the Blocks moe_every, dense_first pick)",
    "model.num_heads": "attention heads H of each Block",
    "model.num_kv_heads": "key/value heads shared by groups of query heads (0: num_heads)",
    "model.num_labels": "classes of the sequence and token heads (0: the data's labels)",
    "model.num_layers": "Blocks of the stack (an encoder-decoder's encoder)",
    "model.param_dtype": "what the params are stored in",
    "model.parametrization": "sp (each family's own scales) | mup (lr transfers across width: "
                             "layers/parametrization.py)",
    "model.patch_size": "the side of each square patch (a token)",
    "model.pool": "what the head reads: cls (a [CLS] token) | mean (of the patches)",
    "model.pooler": "the [CLS] pooler (dense + tanh) of the sequence and NSP heads",
    "model.position_offset": "rows the learned positions' table starts in (BART: 2)",
    "model.positions": "learned | sinusoidal | rotary | alibi | none",
    "model.qk_norm": "RMSNorm over each head's query and key before rotary (Qwen3; epsilon norm_epsilon)",
    "model.qkv_bias": "biases of the query, key and value projections alone (Qwen2)",
    "model.relative_buckets": "relative positions: buckets of the distance",
    "model.relative_max_distance": "relative positions: the distance from which all share the last bucket",
    "model.remat": "recompute in the backward pass: none | full | save_dots | auto (fits the memory)",
    "model.rope_factor": "rope_scaling's factor",
    "model.rope_high_freq_factor": "llama3 rope_scaling: the high-frequency bound's factor",
    "model.rope_low_freq_factor": "llama3 rope_scaling: the low-frequency bound's factor",
    "model.rope_original_max_len": "llama3 rope_scaling: the context the model was trained at",
    "model.rope_scaling": "rotary rescaling for longer contexts: none | linear | llama3",
    "model.rope_theta": "rotary positions turn at rope_theta^(-2i/Dh)",
    "model.routed_scale": "the k router weights times this (DeepSeek-V3's routed_scaling_factor)",
    "model.router": "the router's scores: softmax | sigmoid (DeepSeek-V3's, with a choice bias)",
    "model.router_groups": "> 0: the experts in this many groups, chosen within the best groups (n_group)",
    "model.router_topk_groups": "with router_groups: the groups each token chooses its experts in (topk_group)",
    "model.scale_embeddings": "embeddings times sqrt(D)",
    "model.scale_output": "the decoder's output times D^-0.5 before a tied projection (T5 v1.0)",
    "model.scan_layers": "compile one Block for all (jax.lax.scan): faster compiles, same numbers",
    "model.shared_expert_dim": "> 0: the hidden width of a shared expert that every token also goes through",
    "model.shared_expert_gate": "the shared expert's output scaled by sigmoid(x w) (Qwen2-MoE)",
    "model.tie_embeddings": "the output projection is the embedding's transpose (else its own)",
    "model.type_vocab_size": "token types (segment A / B) of the type embedding",
    "model.use_bias": "biases in the dense layers",
    "model.vocab_size": "rows of the embedding: at least the tokenizer's ids (0: its ids)",
    "model.window": "> 0: each token attends within a window of this many (its family's shape)",
    "optim.accum_steps": "microbatches each step's batch is split into, their gradients summed",
    "optim.adafactor_clip": "adafactor: update clipping threshold, >= 1 (0: none)",
    "optim.adafactor_decay_rate": "adafactor: second-moment decay 1 - step^-rate",
    "optim.adafactor_momentum": "adafactor: first-moment decay (0: none, T5's)",
    "optim.b1": "AdamW's betas and epsilon (and muon's AdamW part's)",
    "optim.b2": "AdamW's betas and epsilon (and muon's AdamW part's)",
    "optim.clip_norm": "global gradient-norm clipping (0: none)",
    "optim.cooldown": "wsd's decay: linear | 1-sqrt",
    "optim.decay_fraction": "wsd: the final fraction of the steps, in (0, 1], that decays",
    "optim.eps": "AdamW's betas and epsilon (and muon's AdamW part's)",
    "optim.final_lr_fraction": "cosine, linear and wsd end at lr x this",
    "optim.lion_b1": "lion: the interpolation of momentum and gradient in the update",
    "optim.lion_b2": "lion: the momentum's decay",
    "optim.lr": "peak learning rate (muon: of its hidden matrices)",
    "optim.muon_adamw_lr_scale": "muon: the lr of its AdamW part (embeddings, head, norms, biases) / lr",
    "optim.muon_momentum": "muon: momentum (Nesterov) of its matrices",
    "optim.muon_ns_steps": "muon: Newton-Schulz iterations orthogonalising the momentum",
    "optim.muon_rms": "muon: the update's RMS, AdamW's (0: Keller Jordan's sqrt(max(1, out/in)) scale)",
    "optim.optimizer": "adamw | muon | adafactor | lion",
    "optim.schedule": "cosine | constant | wsd | linear | inverse_sqrt, after the warmup",
    "optim.warmup_steps": "linear warmup from 0 to lr",
    "optim.weight_decay": "decoupled (lr x weight_decay x w), never on biases and norm scales",
    "task": "the post-training task: sft | dpo | grpo (transformer/training/tasks/NAME.py)",
    "train.checkpoint_every": "steps between checkpoints (and one at the end, or on Ctrl-C)",
    "train.eval_beam_size": "beams of eval's decoding for BLEU (1: greedy)",
    "train.eval_every": "steps between evaluations (and one at the end)",
    "train.eval_length_penalty": "beam search's length penalty alpha (GNMT's)",
    "train.harness_every": "steps between harness scores, logged as eval/harness/TASK/METRIC (0: eval_every)",
    "train.harness_include_path": "a folder of local harness task YAML files (and their data)",
    "train.harness_limit": "at most this many documents per harness task (< 1: a fraction; 0: all)",
    "train.harness_num_fewshot": "shots in each harness prompt (-1: each task's own)",
    "train.harness_tasks": "language models: lm-evaluation-harness tasks (comma-separated) scored during training",
    "train.keep_checkpoints": "the latest checkpoints kept",
    "train.label_smoothing": "the share of a label's probability spread evenly",
    "train.load_balance_weight": "a mixture of experts' load-balancing loss in the objective, times this",
    "train.log_every": "steps between train/* metrics (they leave the device only then)",
    "train.trackers": "where metrics also go, comma-separated: tensorboard, wandb, trackio ('': metrics.jsonl alone)",
    "train.tracker_project": "the wandb / trackio project of the run",
    "train.tracker_group": "the wandb / trackio group of the run (a sweep sets it to its workdir's name)",
    "train.memory_limit_gb": "a device's memory a step may take (0: the device's own; training/memory.py)",
    "train.profile_start": "the first step the profiler traces (with profile_steps)",
    "train.profile_steps": "> 0: steps traced into WORKDIR/profile (transformer.profile)",
    "train.router_bias_rate": "> 0: a sigmoid router's bias moves by this x sign(mean load - load) each step (0: off)",
    "train.router_z_weight": "a mixture of experts' router z-loss in the objective, times this",
    "train.sample_prompt": "a prompt continued at each eval (language models; '': an eval document's first line)",
    "train.sample_tokens": "tokens sampled from sample_prompt at each eval, up to a document's end (0: none)",
    "train.seed": "the seed of the params' init, dropout and the data order",
    "train.steps": "optimizer steps of the run (the learning-rate schedule spans them)",
    "train.stop_at": "> 0: this launch stops after that step (schedule unchanged); a later one resumes",
    "train.z_loss": "language models: the loss adds this x mean(logsumexp(logits)^2), PaLM's (0: none)",
}

OWN = {
    "bert": {
        "model.head": "pretrain (masked LM) | sequence | token (classifiers) | none (hidden states)",
        "model.max_len": "the longest sequence (the positions' table)",
    },
    "encdec": {
        "data.eval_path": "TSV pairs to evaluate on",
        "data.train_path": "TSV pairs source<TAB>target to train on ('': the embedded code2doc task)",
        "model.embed_norm": "a norm after the embeddings (BART)",
        "model.head": "lm (logits) | none (the decoder's hidden states) | encoder (no decoder)",
        "model.max_len": "the longest source or target (the positions' table)",
        "model.positions": "sinusoidal | learned | relative (T5's bucketed bias) | none",
        "model.vocab_size": "rows of the shared embedding: at least the tokenizer's ids",
        "train.label_smoothing": "the share of a target's probability spread evenly",
    },
    "gpt": {
        "data.tokenizer": "'' (the data's: a store's, else byte) | byte | bpe | wordpiece (trained) | gpt2 | hf",
    },
    "dpo": {
        "data.batch_size": "pairs (each two rows)",
        "data.eval_fraction": "the share of train_path held out (by a hash of each prompt; one at least)",
        "data.eval_path": "held-out pairs ('': eval_fraction of train_path)",
        "data.seq_len": "tokens of a row: prompt and one response",
        "data.train_path": 'JSON lines of {"prompt", "chosen", "rejected"}: text or messages',
    },
    "grpo": {
        "data.batch_size": "rollouts per step: prompts x grpo.group_size",
        "data.eval_batches": "batches of held-out answers whose loss eval reports",
        "data.eval_fraction": "the share of train_path held out (by a hash of each record; one at least)",
        "data.eval_path": "held-out prompts ('': eval_fraction of train_path)",
        "data.seq_len": "a rollout row's tokens: at least the longest prompt + max_new_tokens",
        "data.train_path": 'JSON lines of {"prompt": ...} or {"messages": [...]}, with what the rewards read',
    },
    "sft": {
        "data.tokenizer": "'' (the data's: a store's, init_from's, else wordpiece) | byte | bpe | wordpiece | gpt2 "
        "| hf",
        "data.eval_fraction": "the share of train_path held out (by a hash of each conversation; one at least)",
        "data.eval_path": "held-out conversations ('': eval_fraction of train_path)",
        "data.seq_len": "tokens of a packed row",
        "data.train_path": 'JSON lines of {"messages": [...]} or {"prompt": ..., "completion": ...}',
    },
    "vit": {
        "data.source": "digits | a folder of class folders | MNIST-family IDX files | an .npz file",
        "model.head": "classifier (logits) | none (the hidden states)",
        "model.pooler": "with head none: a pooled output (dense + tanh of the first token)",
    },
}
