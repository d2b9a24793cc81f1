"""Few-shot evaluation: a run scored through lm-evaluation-harness equals lm-eval's own `hf` backend on the
same saved model; the scoring's windows and batches give a model's own numbers; bad tasks and runs fail in one
line before a model is loaded."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import FAST_COMPILES, REPO, SMALL_GPT

lm_eval = pytest.importorskip("lm_eval")

from transformer import config as config_lib  # noqa: E402
from transformer import rundir  # noqa: E402
from transformer.data.text import tokenizers  # noqa: E402
from transformer.inference import harness, scoring  # noqa: E402
from transformer.training import harness_tasks  # noqa: E402

LOCAL = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
MC_YAML = LOCAL + """fewshot_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def local_task(folder, name="sums_mc", docs=12, data=None) -> str:
    """A multiple-choice task in `folder` (YAML + JSON lines): which sum is right; its folder."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    path = data or os.path.join(folder, f"{name}.jsonl")
    if data is None:
        with open(path, "w") as f:
            for _ in range(docs):
                a, b = rng.integers(1, 20, 2)
                f.write(json.dumps({"question": f"{a} + {b} =", "choices": [f" {a + b}", f" {a + b + 1}",
                                                                             f" {a * b}"], "answer": 0}) + "\n")
    with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
        f.write(MC_YAML.format(name=name, data=path))
    return str(folder)


def random_run(path, *overrides) -> str:
    """A byte-level GPT run of SMALL_GPT's shapes with random weights (no training), at step 0."""
    from transformer.training import shapes

    config = shapes.resolved(config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"),
                                             [*SMALL_GPT, "model.max_len=64", *overrides]))
    run = rundir.RunDir(str(path))
    run.write_config(config)
    model = run.model()
    params = model.init(jax.random.key(1), np.zeros((1, 4), np.int32))["params"]
    checkpointer = run.checkpointer()
    checkpointer.save_params(jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params,
                                          is_leaf=lambda x: hasattr(x, "unbox")))
    checkpointer.wait()
    tokenizers.ByteTokenizer().save(str(path))
    return str(path)


def test_rolling_windows_are_lm_evals():
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for n, max_len in [(1, 8), (7, 8), (8, 8), (9, 8), (30, 8), (17, 4), (50, 16)]:
        ids = list(range(100, 100 + n))
        theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, 0, max_len, 1)]
        assert scoring.rolling_pairs(ids, 0, max_len) == [(list(a), list(b)) for a, b in theirs], (n, max_len)


@pytest.mark.slow
def test_scores_are_the_models_own_in_any_batch_and_bucket(tmp_path):
    """Each request's log-likelihood is the model's on that sequence alone (padding, bucketing and the
    batch's other rows change nothing); the greedy flag is argmax's; generation is the cached decoder's."""
    from transformer.inference import sampling

    workdir = random_run(tmp_path / "run")
    scorer = scoring.Scorer.from_run(workdir, batch_size=8)
    rng = np.random.default_rng(0)
    requests = [(rng.integers(0, 256, rng.integers(1, 20)).tolist(), rng.integers(0, 256, rng.integers(1, 6)).tolist())
                for _ in range(11)]
    requests.append((list(range(60)), list(range(20))))  # longer than max_len + 1: cut on the left
    model, params = scorer.model, scorer.params
    for (context, continuation), (logp, greedy) in zip(requests, scorer.loglikelihood(requests)):
        whole = (context + continuation)[-65:]
        logits = np.asarray(model.apply({"params": params}, np.asarray(whole[:-1])[None]))[0]
        logsm = np.asarray(jax.nn.log_softmax(logits))[-len(continuation):]
        targets = whole[-len(continuation):]
        assert logp == pytest.approx(logsm[np.arange(len(targets)), targets].sum(), abs=1e-4)
        assert greedy == bool((logsm.argmax(-1) == targets).all())
    assert scorer.programs == 2  # a batch in bucket 64 (the long request), one in 32
    prompt = [ord(c) for c in "def f(x):"]
    new = scorer.generate([prompt, prompt[:3]], max_new_tokens=6)[0]
    full = list(prompt)
    for _ in range(6):  # greedy by whole forwards, no cache
        full.append(int(np.argmax(model.apply({"params": params}, np.asarray([full]))[0, -1])))
    assert new == sampling.until_stop(full[len(prompt):], (scorer.stop_id,))
    doc = rng.integers(0, 256, 150).tolist()  # three windows of 64
    total = scorer.loglikelihood_rolling([doc])[0]
    assert total == pytest.approx(sum(lp for lp, _ in scorer.loglikelihood(scoring.rolling_pairs(doc, 255, 64))))


@pytest.mark.slow
def test_bad_tasks_and_runs_fail_in_one_line_before_a_model_is_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    workdir = random_run(tmp_path / "run")
    monkeypatch.setattr(scoring.Scorer, "from_run", lambda *a, **k: pytest.fail("a model was loaded"))
    tasks = local_task(tmp_path / "tasks")
    with pytest.raises(ValueError, match=r"^--tasks: no task named nope_task \(a local task"):
        harness_tasks.evaluate_tasks(workdir, ["sums_mc", "nope_task"], include_path=tasks)
    local_task(tmp_path / "tasks", "lost_mc", data=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="^--tasks: the data of task lost_mc cannot be had: .*missing.jsonl"):
        harness_tasks.evaluate_tasks(workdir, ["lost_mc"], include_path=tasks)
    bert = tmp_path / "bert"
    bert.mkdir()
    config_lib.save_json(config_lib.load(os.path.join(REPO, "configs/bert.py:tiny")), str(bert / "config.json"))
    with pytest.raises(ValueError, match="holds a bert model, not a language model"):
        harness_tasks.evaluate_tasks(str(bert), ["sums_mc"], include_path=tasks)


CODE_YAML = LOCAL + """output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
process_results: !function helpers.code
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
metric_list:
  - metric: code
    aggregation: mean
    higher_is_better: true
"""


def code_task(folder) -> None:
    """A generate_until task `sums_gen` in `folder` whose metric is a code of the generated text's characters,
    so that two runs agree on it only where they generate the same text."""
    (folder / "helpers.py").write_text("def code(doc, results):\n"
                                       "    return {'code': float(sum(map(ord, results[0])) % 9973)}\n")
    data = folder / "sums_gen.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a} + {a % 7} =", "answer": str(a + a % 7)}) + "\n"
                            for a in range(10)))
    (folder / "sums_gen.yaml").write_text(CODE_YAML.format(name="sums_gen", data=data))


@pytest.mark.slow
def test_evaluate_tasks_from_the_command_line_on_two_processes_equals_one(tmp_path):
    """`python -m transformer.evaluate --tasks` on two processes (2 fake devices each: process 0 drives the
    harness, both compute; a generation task's prompts decoded half by each) records the metrics one process
    does, and prints the harness's table."""
    from test_multihost import finish, free_port

    workdir = random_run(tmp_path / "run")
    tasks = local_task(tmp_path / "tasks")
    code_task(tmp_path / "tasks")
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {FAST_COMPILES}",
           "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": REPO}
    command = [sys.executable, "-m", "transformer.evaluate", "--workdir", workdir, "--tasks", "sums_mc,sums_gen",
               "--include_path", tasks, "--num_fewshot", "2", "--batch_size", "4"]
    one = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-2000:]
    assert "|sums_mc " in one.stdout and "acc" in one.stdout
    coordinator = f"127.0.0.1:{free_port()}"
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    procs = [subprocess.Popen([*command, "--coordinator", coordinator, "--num_processes", "2", "--process_id",
                               str(i)], env=env, stdout=logs[i], stderr=subprocess.STDOUT, cwd=tmp_path)
             for i in range(2)]
    assert finish(procs) == [0, 0], "".join((tmp_path / f"p{i}.log").read_text()[-2000:] for i in range(2))
    records = [json.loads(line) for line in open(os.path.join(workdir, "evals.jsonl"))]  # a task a record, a run
    metrics = [{k: v for r in records[at:at + 2] for k, v in r.items() if k.startswith("eval/")} for at in (0, 2)]
    assert len(records) == 4 and metrics[0] == metrics[1] and metrics[0]["eval/harness/sums_gen/code"] > 0


# ---- parity with lm-eval's own `hf` backend on transformers models, converted


def hf_dir(tmp_path, family: str):
    """A tiny random transformers model (GPT-2 or Qwen3) with a byte-level BPE tokenizer, saved."""
    import transformers
    from test_hf import decoder, perturbed
    from test_hf_tokenizers import json_module_source

    torch = pytest.importorskip("torch")
    texts = [open(json_module_source()).read()] * 2
    bpe = tokenizers.train_bpe(texts, 400).tokenizer
    eot = "<|endoftext|>"
    bpe.add_special_tokens([eot])
    tok = transformers.GPT2TokenizerFast(tokenizer_object=bpe, bos_token=eot, eos_token=eot, unk_token=eot)
    torch.manual_seed(0)
    if family == "gpt2":
        theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=len(tok), n_positions=64, bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id))
    else:
        theirs = decoder("Qwen3ForCausalLM", vocab_size=len(tok), head_dim=8, bos_token_id=tok.eos_token_id,
                         eos_token_id=tok.eos_token_id)
    perturbed(theirs, scale=0.3).save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    return str(tmp_path / "hf")


CONTEXTS = ["def f(x):\n    return", "import json\n", "The answer is ", "  spaced  ", "a" * 90,
            "class Decoder(object):\n    def decode(self, s): "]
CONTINUATIONS = [" x", " json.dumps(x)", "42", "\n", " end", "pass"]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_every_request_equals_lm_evals_hf_backend(tmp_path, family, monkeypatch):
    """Log-likelihoods within 1e-4, greedy flags equal, rolling log-likelihoods alike, and a local multiple-choice
    task's accuracy identical: our model against lm-eval's `hf` on the same saved transformers model."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from transformer.interop import hf_import

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    directory = hf_dir(tmp_path, family)
    hf_import.convert(directory, str(tmp_path / "run"))
    ours = harness.RunLM(str(tmp_path / "run"), batch_size=4)
    # logits_cache=False: lm-eval's shortcut reuses one window's logits for another whose tokens but the last
    # agree, and a repeated text's windows are such (its rolling sum of "a" * 360 is then 4 nats off)
    theirs = HFLM(pretrained=directory, device="cpu", batch_size=4, logits_cache=False)
    requests = [Instance("loglikelihood", {}, (c, t), i) for i, (c, t) in
                enumerate((c, t) for c in CONTEXTS for t in CONTINUATIONS)]
    a, b = ours.loglikelihood(requests), theirs.loglikelihood(requests)
    np.testing.assert_allclose([x for x, _ in a], [x for x, _ in b], atol=1e-4, rtol=0)
    assert [g for _, g in a] == [g for _, g in b]
    documents = [Instance("loglikelihood_rolling", {}, (text * 4,), i) for i, text in enumerate(CONTEXTS)]
    np.testing.assert_allclose(ours.loglikelihood_rolling(documents), theirs.loglikelihood_rolling(documents),
                               atol=1e-3, rtol=1e-6)

    manager = harness.task_manager(local_task(tmp_path / "tasks", docs=16))
    scores = [lm_eval.simple_evaluate(model=lm, tasks=["sums_mc"], num_fewshot=2, task_manager=manager,
                                      bootstrap_iters=0)["results"]["sums_mc"]["acc,none"] for lm in (ours, theirs)]
    assert scores[0] == scores[1]


@pytest.mark.slow
def test_harness_tasks_are_scored_during_training(tmp_path, corpus, small_gpt_config, monkeypatch):
    """config.train.harness_tasks logs eval/harness/TASK/METRIC at harness_every steps and at the end, to
    metrics.jsonl; an unknown task stops the run before its first step."""
    from transformer.training import loop
    from transformer.training import metrics as metrics_lib

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = local_task(tmp_path / "tasks", docs=6)
    harness_keys = ["train.steps=4", "train.eval_every=4", "train.harness_tasks=sums_mc", "train.harness_every=2",
                    "train.harness_num_fewshot=1", f"train.harness_include_path={tasks}", "train.sample_tokens=0"]
    with pytest.raises(ValueError, match="no task named nope"):
        loop.train(small_gpt_config(f"data.source={corpus}", *harness_keys, "train.harness_tasks=nope"),
                   str(tmp_path / "bad"), jax.devices()[:1])
    loop.train(small_gpt_config(f"data.source={corpus}", *harness_keys), str(tmp_path / "run"), jax.devices()[:1])
    records = metrics_lib.read(str(tmp_path / "run" / "metrics.jsonl"))
    logged = {r["step"]: r["eval/harness/sums_mc/acc"] for r in records if "eval/harness/sums_mc/acc" in r}
    assert sorted(logged) == [2, 4] and all(0 <= v <= 1 for v in logged.values())


@pytest.mark.slow
@pytest.mark.torch
def test_a_converted_bart_scores_targets_given_sources_as_lm_evals_hf_backend(tmp_path):
    """An encoder-decoder's requests: the continuation's log-likelihood as the target of the context, the
    source with the tokenizer's own special tokens (<s> ... </s>), equal to lm-eval's `hf` seq2seq backend."""
    import torch
    import transformers
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from test_hf import perturbed
    from test_hf_tokenizers import json_module_source

    from transformer.interop import hf_import

    bpe = tokenizers.train_bpe([open(json_module_source()).read()] * 2, 400).tokenizer
    bpe.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok = transformers.BartTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                         unk_token="<pad>")
    torch.manual_seed(0)
    theirs = transformers.BartForConditionalGeneration(transformers.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=len(tok), max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.eos_token_id))
    perturbed(theirs, scale=0.3).save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    hf_import.convert(str(tmp_path / "hf"), str(tmp_path / "run"))
    ours = harness.RunLM(str(tmp_path / "run"), batch_size=4)
    reference = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", batch_size=4, backend="seq2seq",
                     logits_cache=False)
    requests = [Instance("loglikelihood", {}, (c, t), i) for i, (c, t) in
                enumerate((c, t) for c in CONTEXTS[:4] for t in CONTINUATIONS[:4])]
    a, b = ours.loglikelihood(requests), reference.loglikelihood(requests)
    np.testing.assert_allclose([x for x, _ in a], [x for x, _ in b], atol=1e-4, rtol=0)
    assert [g for _, g in a] == [g for _, g in b]


@pytest.mark.slow  # lm-eval indexes its thousands of built-in task files (about 10 s on an idle CPU)
def test_the_shipped_few_shot_tasks_load_offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    manager = harness.task_manager(os.path.join(REPO, "experiments", "few_shot", "tasks"))
    harness_tasks.check_tasks(["keymap_mc", "keymap_gen"], manager)
    task = manager.load(["keymap_mc"])["tasks"]["keymap_mc"]
    docs = list(task.test_docs())
    assert len(docs) == 64 and {d["key"] for d in docs} <= set("abcdefgh")
    shown = [task.fewshot_context(d, num_fewshot=8)[:-1] for d in docs]  # the shots, less the query's key
    assert sum(d["key"] in text for d, text in zip(docs, shown)) > len(docs) / 2  # the answer can be in context


GEN_YAML = LOCAL + """output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
process_docs: !function helpers.same
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    {option}
"""


def test_a_tasks_yaml_mistake_fails_before_scoring_and_its_python_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "tasks"
    local_task(folder)
    (folder / "helpers.py").write_text("def same(dataset):\n    return dataset\n")
    data = folder / "gen.jsonl"
    data.write_text(json.dumps({"question": "1 + 1 =", "answer": "2"}) + "\n")
    for name, option in (("gen_ok", "ignore_case: true"), ("gen_bad", "no_such_option: true")):
        (folder / f"{name}.yaml").write_text(GEN_YAML.format(name=name, data=data, option=option))
    manager = harness.task_manager(str(folder))
    harness_tasks.check_tasks(["sums_mc", "gen_ok"], manager)
    said = capsys.readouterr().err
    assert f"harness: task gen_ok ({folder / 'gen_ok.yaml'}) runs Python from its folder (helpers.same: " \
           "!function) in this process" in said and "sums_mc" not in said
    with pytest.raises(ValueError) as error:
        harness_tasks.check_tasks(["sums_mc", "gen_bad"], manager)
    assert str(error.value).startswith("--tasks: task gen_bad's metrics fail on its first document before any "
                                       "scoring: TypeError: ")  # lm-eval's own error at scoring, seconds in


def test_each_task_is_kept_as_it_finishes_with_its_standard_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    workdir = random_run(tmp_path / "run")
    folder = local_task(tmp_path / "tasks", docs=8)
    local_task(folder, "later_mc", docs=8)
    real, calls = lm_eval.simple_evaluate, []

    def second_fails(**kwargs):
        calls.append(kwargs["tasks"])
        if len(calls) > 1:
            raise RuntimeError("the second task broke")
        return real(**kwargs)
    monkeypatch.setattr(lm_eval, "simple_evaluate", second_fails)
    with pytest.raises(RuntimeError, match="the second task broke"):
        harness_tasks.evaluate_tasks(workdir, ["sums_mc", "later_mc"], num_fewshot=6, include_path=folder, batch_size=4)
    records = [json.loads(line) for line in open(os.path.join(workdir, "evals.jsonl"))]
    assert calls == [["sums_mc"], ["later_mc"]] and len(records) == 1
    assert records[0]["harness"]["tasks"] == ["sums_mc"] and 0 < records[0]["eval/harness/sums_mc/acc_stderr"] < 1
    said = capsys.readouterr().err  # 6-shot prompts of at least 66 bytes: past the 64-byte context, cut
    assert re.search(r"harness: \d+ of \d+ requests were longer than the model's context of 64 tokens and lost "
                     r"their first \d+\.\.\d+ tokens", said)
