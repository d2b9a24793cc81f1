"""The harness's generate tasks through the engine, against lm-eval's `hf` backend on the same model.

  PYTHONPATH=. python experiments/engine/harness_bench.py --layers 12 --docs 32 --rounds 2   # GPT-2-small's shape
  PYTHONPATH=. python experiments/engine/harness_bench.py --layers 2 --docs 16 --rounds 1    # a laptop minute

A GPT-2-small-shaped transformers model (random weights, a byte-level BPE of --vocab ids trained on the
standard library's text) is saved, converted (`transformer.convert --hf_dir`'s library call), and a local
generate_until task of --docs prompts (lines of the standard library's code, 8 to 120 characters; greedy, up
to --new tokens, until a newline) is scored by lm_eval.simple_evaluate twice per round: the run through
`harness.RunLM` (the engine, `--batch` slots) and the saved model through lm-eval's `HFLM` (PyTorch, the same
threads, the same batch size), interleaved round by round; the best round of each is kept. Prints requests
per second of each and how many of the greedy answers are the same text. No network: the task is local.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

TASK = """task: lines_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {new}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def stdlib_lines(count: int) -> list[str]:
    """`count` code lines of the standard library (8 to 120 characters), spread over their lengths."""
    import sysconfig

    folder = sysconfig.get_paths()["stdlib"]
    lines = [line.strip() for name in sorted(os.listdir(folder)) if name.endswith(".py")
             for line in open(os.path.join(folder, name), encoding="utf-8", errors="replace")]
    lines = sorted({line for line in lines if 8 <= len(line) <= 120}, key=len)
    return [lines[i] for i in np.linspace(0, len(lines) - 1, count).astype(int)]


def saved_model(folder: str, layers: int, vocab: int) -> str:
    """A random GPT2LMHeadModel of GPT-2-small's widths and its byte-level BPE, saved in folder/hf."""
    import torch
    import transformers

    from transformer.data.text import tokenizers

    bpe = tokenizers.train_bpe([open(os.path.join(os.path.dirname(json.__file__), "decoder.py")).read()] * 2 +
                               stdlib_lines(2000), vocab).tokenizer
    eot = "<|endoftext|>"
    bpe.add_special_tokens([eot])
    tok = transformers.GPT2TokenizerFast(tokenizer_object=bpe, bos_token=eot, eos_token=eot, unk_token=eot)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=len(tok), n_positions=256,
                                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    path = os.path.join(folder, "hf")
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    a = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM

    from transformer.inference import harness
    from transformer.interop import hf_import

    torch.set_num_threads(int(os.environ.get("THREADS", os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as folder:
        hf = saved_model(folder, a.layers, a.vocab)
        hf_import.convert(hf, os.path.join(folder, "run"))
        data = os.path.join(folder, "lines.jsonl")
        with open(data, "w") as f:
            for line in stdlib_lines(a.docs):
                cut = len(line) // 2
                f.write(json.dumps({"prompt": line[:cut], "answer": line[cut:]}) + "\n")
        with open(os.path.join(folder, "lines_gen.yaml"), "w") as f:
            f.write(TASK.format(data=data, new=a.new))
        manager = harness.task_manager(folder)
        ours = harness.RunLM(os.path.join(folder, "run"), batch_size=a.batch, max_gen_toks=a.new)
        theirs = HFLM(pretrained=hf, device="cpu", batch_size=a.batch)

        def scored(lm):
            start = time.perf_counter()
            out = lm_eval.simple_evaluate(model=lm, tasks=["lines_gen"], task_manager=manager, log_samples=True,
                                          bootstrap_iters=0, verbosity="WARNING")
            answers = [s["filtered_resps"][0] for s in sorted(out["samples"]["lines_gen"], key=lambda s: s["doc_id"])]
            return time.perf_counter() - start, answers

        scored(ours)  # compiled, warmed
        times = {"ours": [], "theirs": []}
        for _ in range(a.rounds):
            for name, lm in (("ours", ours), ("theirs", theirs)):
                seconds, answers = scored(lm)
                times[name].append(seconds)
                if name == "ours":
                    mine = answers
                else:
                    yours = answers
    same = sum(x == y for x, y in zip(mine, yours))
    best = {name: min(t) for name, t in times.items()}
    print(f"layers {a.layers}, vocab {a.vocab + 1}, {a.docs} requests of <= {a.new} greedy tokens, batch {a.batch}, "
          f"{torch.get_num_threads()} torch threads, best of {a.rounds}")
    print("| generate_until | ours (engine) | lm-eval hf | ours' speed-up | same answers |\n|---|---|---|---|---|")
    print(f"| requests/s | {a.docs / best['ours']:.2f} ({best['ours']:.1f} s) | {a.docs / best['theirs']:.2f} "
          f"({best['theirs']:.1f} s) | {best['theirs'] / best['ours']:.2f}x | {same} of {a.docs} |")


if __name__ == "__main__":
    main()
