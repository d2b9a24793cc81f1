"""Requests per second of the project's scoring against lm-eval's `hf` backend, on the same model on the same
CPU, and the programs a whole suite compiles.

  PYTHONPATH=. HF_DATASETS_OFFLINE=1 python experiments/few_shot/bench.py [--requests 512] [--out runs/few_shot]

The model: a random GPT-2 (4 layers, width 128, 256 positions) made by transformers and converted. The
requests: the keymap_mc suite's own (lm-eval builds them: 8 shots, 8 choices a document), scored once by
each backend at batch size 16 after one warm-up pass (our compile is timed apart). Writes bench.json here.
"""

import argparse
import json
import os
import time

import numpy as np
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))


def model_dir(out: str) -> str:
    from transformer.data.text import tokenizers

    path = os.path.join(out, "bench-gpt2-hf")
    bpe = tokenizers.train_bpe([open(os.path.join(HERE, "run.py")).read()] * 2, 400).tokenizer
    bpe.add_special_tokens(["<|endoftext|>"])
    tok = transformers.GPT2TokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>",
                                         eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=128, n_head=4, vocab_size=len(tok), n_positions=256, bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def suite_requests(shots: int, count: int) -> list:
    """lm-eval's loglikelihood Instances of keymap_mc at `shots`, the first `count`."""
    from transformer.inference import harness

    manager = harness.task_manager(os.path.join(HERE, "tasks"))
    task = next(iter(manager.load(["keymap_mc"])["tasks"].values()))
    task.set_config(key="num_fewshot", value=shots)
    task.build_all_requests(rank=0, world_size=1)
    return task.instances[:count]


def timed(fn, requests) -> float:
    start = time.perf_counter()
    fn(requests)
    return time.perf_counter() - start


def main():
    from lm_eval.models.huggingface import HFLM

    from transformer.inference import harness
    from transformer.interop import hf_import

    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(HERE)), "runs", "few_shot"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    hf_path, workdir = model_dir(args.out), os.path.join(args.out, "bench-gpt2-converted")
    if not os.path.isdir(workdir):
        hf_import.convert(hf_path, workdir)
    torch.set_num_threads(os.cpu_count())
    ours = harness.RunLM(workdir, batch_size=16)
    theirs = HFLM(pretrained=hf_path, device="cpu", batch_size=16)
    requests = suite_requests(8, args.requests)
    first = timed(lambda r: ours.loglikelihood(r, disable_tqdm=True), requests)  # compiles
    results = {"requests": len(requests), "ours_first_pass_s": first}
    for name, lm in (("ours", ours), ("hf", theirs)):
        lm.loglikelihood(requests[:16], disable_tqdm=True)
        seconds = [timed(lambda r, lm=lm: lm.loglikelihood(r, disable_tqdm=True), requests) for _ in range(2)]
        results[f"{name}_requests_per_s"] = len(requests) / min(seconds)
    a = np.array([x for x, _ in ours.loglikelihood(requests, disable_tqdm=True)])
    b = np.array([x for x, _ in theirs.loglikelihood(requests, disable_tqdm=True)])
    results["max_abs_difference"] = float(np.abs(a - b).max())
    for shots in (0, 1, 2, 4):
        ours.loglikelihood(suite_requests(shots, 10**6), disable_tqdm=True)
    results["programs_for_the_suite_0_to_8_shots"] = ours.scorer.programs
    results["cpu_count"] = os.cpu_count()
    print(json.dumps(results, indent=1))
    with open(os.path.join(HERE, "bench.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
