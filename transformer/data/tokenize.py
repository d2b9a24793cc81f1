"""Tokenize a corpus once, in parallel, into a token store (see transformer/data/text/token_store.py).

  python -m transformer.data.tokenize --source SOURCE --out STORE --tokenizer KIND [--workers N]
  python -m transformer.data.tokenize --inspect STORE

SOURCE is what `config.data.source` takes (`stdlib`, a glob of text / JSON-lines / .jsonl.gz /
.jsonl.zst / Parquet files, a `datasets.save_to_disk` directory). KIND: byte, bpe, wordpiece
(trained on a bounded sample of the train documents, `--sample_mb`, or a BERT vocab.txt from
`--tokenizer_path`), gpt2 (`--tokenizer_path` holds encoder.json and vocab.bpe; encoded with
tiktoken, the same ids), hf (a Hugging Face tokenizer directory). The eval split is the
documents whose name hashes below `--eval_fraction` (`sources.split_of`, as training runs
split), or all of `--eval_source`.

The corpus is cut into chunks of about `--shard_mb` MB of files (a rule of the files alone);
worker processes (`--workers`, or Ray tasks with `--backend ray`) tokenize whole chunks, each
with one thread, and write a chunk's shards when it is whole. The shards are the same bytes
for any number of workers. Run the same command again after an interruption (Ctrl-C, a
killed process): it skips the finished chunks and writes the index last.
"""

import os
import signal
import sys

from absl import flags

from transformer import cli
from transformer.data.text import sources, store_build, token_store

KINDS = ("byte", "bpe", "wordpiece", "gpt2", "hf")
BACKENDS = ("local", "ray")


def define_flags() -> None:
    flags.DEFINE_string("source", sources.STDLIB, "The corpus: stdlib, a glob or path, or a datasets directory.")
    flags.DEFINE_string("out", None, "The store directory to write (or to finish writing).")
    flags.DEFINE_enum("tokenizer", "byte", KINDS, "The tokenizer.")
    flags.DEFINE_string("tokenizer_path", "", "gpt2: a folder with encoder.json and vocab.bpe; hf: a tokenizer "
                        "folder; wordpiece: a BERT vocab.txt (else one is trained).")
    flags.DEFINE_integer("vocab_size", 8192, "Ids of a trained bpe or wordpiece tokenizer.")
    flags.DEFINE_float("sample_mb", 32.0, "MB of train text a bpe or wordpiece tokenizer is trained on.")
    flags.DEFINE_string("text_field", "text", "The text field of JSON lines, or column of Parquet and datasets.")
    flags.DEFINE_float("eval_fraction", 0.02, "Documents whose name hashes below this go to the eval split.")
    flags.DEFINE_string("eval_source", "", "The eval split's own source (then all of --source is train).")
    flags.DEFINE_float("shard_mb", 16.0, "MB of source files per chunk (one shard per split per chunk).")
    flags.DEFINE_integer("workers", os.cpu_count() or 1, "Processes (or Ray tasks at once) that tokenize; 0 "
                         "tokenizes in this process.")
    flags.DEFINE_enum("backend", "local", BACKENDS, "Worker processes here, or Ray tasks.")
    flags.DEFINE_string("ray_address", "", "The Ray cluster (default: a local Ray instance); the store "
                        "directory must be on a file system every node writes to.")
    flags.DEFINE_string("inspect", None, "Print a store's index and decode a few documents, then exit.")
    flags.DEFINE_integer("show", 3, "With --inspect: documents of each split to decode.")


def _interrupted(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str]) -> None:
    f = flags.FLAGS
    if f.inspect:
        print(store_build.describe(f.inspect, f.show))
        return
    if not f.out:
        raise ValueError("--out is required: the store directory to write")
    if f.tokenizer in ("gpt2", "hf") and not f.tokenizer_path:
        raise ValueError(f"--tokenizer={f.tokenizer} needs --tokenizer_path")
    if f.tokenizer == "bpe" and f.tokenizer_path:
        raise ValueError("--tokenizer=bpe is trained here: drop --tokenizer_path (or use --tokenizer=hf)")
    if f.ray_address and f.backend != "ray":
        raise ValueError("--ray_address needs --backend ray")
    if f.workers < 0 or f.shard_mb <= 0 or f.sample_mb <= 0 or not 0 <= f.eval_fraction < 1:
        raise ValueError("--workers >= 0, --shard_mb > 0, --sample_mb > 0 and 0 <= --eval_fraction < 1")
    for sig in (signal.SIGINT, signal.SIGTERM):  # also where the shell started it with SIGINT ignored (`cmd &`)
        signal.signal(sig, _interrupted)
    try:
        index = store_build.build(store_build.settings_of(f), f.out, f.workers, f.backend, f.ray_address)
    except KeyboardInterrupt:
        chunks = os.path.join(f.out, token_store.CHUNKS_DIR)
        done = len(os.listdir(chunks)) if os.path.isdir(chunks) else 0
        print(f"\ninterrupted with {done} chunks finished: run the same command to resume", file=sys.stderr)
        sys.exit(130)
    run = index.get("_run", {"seconds": 0, "chunks": 0, "tokens": 0, "text_bytes": 0})
    seconds = max(run["seconds"], 1e-9)
    print(f"{f.out}: {index['splits']['train']['tokens']:,} train and {index['splits']['eval']['tokens']:,} eval "
          f"tokens ({index['dtype']}), fingerprint {index['fingerprint']}")
    if run["chunks"]:
        print(f"this run: {run['chunks']} chunks, {run['text_bytes'] / 1e6:,.1f} MB in {run['seconds']:.1f} s = "
              f"{run['text_bytes'] / 1e6 / seconds:.2f} MB/s, {run['tokens'] / seconds:,.0f} tokens/s; workers' CPU "
              f"{run['worker_cpu_seconds']:.1f} s = "
              f"{run['text_bytes'] / 1e6 / max(run['worker_cpu_seconds'], 1e-9):.2f} MB per CPU-second")
    if not index["splits"]["eval"]["tokens"] and (f.eval_source or f.eval_fraction > 0):
        print("warning: the eval split is empty (too few documents): a run on this store holds out the end of its "
              "train tokens for eval (config.data.eval_fraction of them); raise --eval_fraction or give "
              "--eval_source for an eval split of whole documents", file=sys.stderr)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
