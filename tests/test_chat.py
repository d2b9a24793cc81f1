"""The chat session (through the engine) answers as a whole recomputation does, turn after turn; the
`chat` command answers --message and a scripted conversation with /reset through stdin."""

import json
import os
import subprocess
import sys

import pytest
from conftest import FAST_COMPILES
from test_sft import pretrained, sft_config, write_conversations  # noqa: F401 (a fixture)

from transformer import rundir
from transformer.data.text import chat_templates, tokenizers
from transformer.inference import chat, sampling
from transformer.training import harness_tasks, loop, shapes
from transformer.training.tasks import sft

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, pretrained):  # noqa: F811
    workdir = tmp_path_factory.mktemp("chat")
    write_conversations(workdir / "chat.jsonl", 100)
    loop.train(shapes.resolved(sft_config(pretrained, workdir / "chat.jsonl", "train.steps=20",
                                          "data.eval_fraction=0.2")), str(workdir / "run"))
    return str(workdir / "run")


@pytest.mark.slow
def test_turns_over_the_cache_answer_as_recomputing_the_history(chat_run):
    run = rundir.open(chat_run)
    model, params, fmt = run.model(), run.restore_params(), run.chat_format()
    session = chat.Session(model, params, fmt, system="Be brief.", settings=sampling.Sampling(max_new_tokens=4))
    messages = [{"role": "system", "content": "Be brief."}]
    for text in ["reverse cat", "reverse dog", "<|end|> sun"]:
        answer = session.say(text)
        messages.append({"role": "user", "content": text})
        assert answer == sft.reply(model, params, fmt, messages, 4)
        messages.append({"role": "assistant", "content": answer})
    session.reset()
    assert session.messages == messages[:1]
    assert session.say("reverse box") == sft.reply(model, params, fmt, messages[:1] + [
        {"role": "user", "content": "reverse box"}], 4)
    with pytest.raises(ValueError, match="--top_p=0"):
        chat.Session(model, params, fmt, settings=sampling.Sampling(top_p=0))


@pytest.mark.slow
def test_chat_command_answers_a_message_and_a_scripted_conversation(chat_run):
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILES}
    command = [sys.executable, "-m", "transformer.chat", "--workdir", chat_run, "--max_new_tokens", "4"]
    session = chat.Session.open(chat_run, settings=sampling.Sampling(max_new_tokens=4))
    one = subprocess.run([*command, "--message", "reverse cat"], capture_output=True, text=True, env=env, cwd=REPO)
    assert one.returncode == 0, one.stderr
    assert one.stdout == session.say("reverse cat") + "\n"
    session.reset()
    script = "reverse cat\nreverse dog\n/reset\nreverse sun\n"
    out = subprocess.run(command, input=script, capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    expected = [session.say("reverse cat"), session.say("reverse dog"), "(conversation reset)"]
    session.reset()
    assert out.stdout.splitlines() == [*expected, session.say("reverse sun")]
    bad = subprocess.run([*command, "--temperature", "-1", "--message", "x"], capture_output=True, text=True,
                         env=env, cwd=REPO)
    assert bad.returncode == 2 and "--temperature=-1.0 must be >= 0" in bad.stderr


def test_the_oldest_turns_are_dropped_to_fit_the_context():
    fmt = chat_templates.built_in(tokenizers.ByteTokenizer())
    system = {"role": "system", "content": "Be brief."}
    turns = [{"role": role, "content": f"{role} {i}"} for i in range(3) for role in ("user", "assistant")]
    asked = [system, *turns, {"role": "user", "content": "the last"}]
    kept, prompt, dropped = fmt.fitted(asked, len(fmt.prompt([system, *turns[2:], asked[-1]])))
    assert (kept, dropped) == ([system, *turns[2:], asked[-1]], 2) and prompt == fmt.prompt(kept).tolist()
    assert fmt.fitted(asked, 10_000)[2] == 0
    assert fmt.fitted(asked, len(fmt.prompt([system, asked[-1]])))[0] == [system, asked[-1]]
    with pytest.raises(ValueError, match=r"^the message is \d+ tokens with the chat markers and the system prompt, "
                                         r"more than the 12 the model's context leaves it: shorten it"):
        fmt.fitted(asked, 12)


@pytest.mark.slow
def test_the_chat_command_drops_the_oldest_turns_saying_so(chat_run):
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILES}
    command = [sys.executable, "-m", "transformer.chat", "--workdir", chat_run, "--max_new_tokens", "4"]
    script = "".join(f"reverse the word number {i}\n" for i in range(4))  # ~30 tokens a turn: 64 hold two
    out = subprocess.run(command, input=script, capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stdout.splitlines() if line.startswith("(the ")]
    assert notes and all(line.endswith("oldest messages dropped: the conversation outgrew the model's context of "
                                       "64 tokens)") for line in notes)
    assert "error" not in out.stdout


@pytest.mark.torch
def test_an_exported_chat_model_answers_as_the_run_does_through_transformers(chat_run, tmp_path):
    import torch
    import transformers

    from transformer.interop import hf_export
    hf_export.export_run(chat_run, str(tmp_path / "hf"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    run = rundir.open(chat_run)
    model, params, fmt = run.model(), run.restore_params(), run.chat_format()
    answers = []
    for messages in ([{"role": "user", "content": "reverse cat"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "reverse <|end|> sun"}]):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        if "<|end|>" not in messages[-1]["content"]:  # transformers parses marker text in a message; we do not
            assert list(ids) == fmt.prompt(messages).tolist()
        ids = fmt.prompt(messages).tolist()
        out = theirs.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
        answers.append(sft.reply(model, params, fmt, messages, 6))
        assert tok.decode(out, skip_special_tokens=True) == answers[-1]
    assert any(answers)


GEN_YAML = """task: reverse_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "reverse {{{{word}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow
def test_the_harness_scores_a_chat_run_on_chat_templated_prompts(chat_run, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from transformer.inference import harness

    words = ["cat", "sky", "box", "<|end|>"]
    with open(tmp_path / "reverse.jsonl", "w") as f:
        f.writelines(json.dumps({"word": w, "answer": w[::-1]}) + "\n" for w in words)
    (tmp_path / "reverse.yaml").write_text(GEN_YAML.format(data=tmp_path / "reverse.jsonl"))
    lm = harness.RunLM(chat_run)
    results = lm_eval.simple_evaluate(model=lm, tasks=["reverse_gen"], apply_chat_template=True,
                                      task_manager=harness.task_manager(str(tmp_path)), log_samples=True,
                                      bootstrap_iters=0, verbosity="WARNING")
    run = rundir.open(chat_run)
    model, params, fmt = run.model(), run.restore_params(), run.chat_format()
    samples = sorted(results["samples"]["reverse_gen"], key=lambda s: s["doc_id"])
    for w, sample in zip(words, samples):
        messages = [{"role": "user", "content": f"reverse {w}"}]
        assert sample["arguments"][0][0] == fmt.render(messages, add_generation_prompt=True).text
        assert sample["filtered_resps"][0] == sft.reply(model, params, fmt, messages, 6)
    right = sum(s["filtered_resps"][0] == w[::-1] for w, s in zip(words, samples))
    assert results["results"]["reverse_gen"]["exact_match,none"] == right / len(words)
    assert lm.chat_template(True) == fmt.source
    _, through = harness_tasks.evaluate_tasks(chat_run, ["reverse_gen"], include_path=str(tmp_path), record=False,
                                              apply_chat_template=True)
    assert through["results"]["reverse_gen"]["exact_match,none"] == right / len(words)
