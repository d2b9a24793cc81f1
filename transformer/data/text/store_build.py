"""Building a token store: a corpus tokenized once, in parallel, into the shards and index that
token_store.py describes (the command is `python -m transformer.data.tokenize`).

The corpus is cut into chunks of about `shard_mb` MB of files (`plan`: a rule of the files
alone); worker processes (or Ray tasks) tokenize whole chunks, each with one thread, and write
a chunk's shards when it is whole, so the shards are the same bytes for any number of workers.
`build` on a directory whose build was interrupted skips the finished chunks and writes the
index last. A bpe or wordpiece tokenizer is first trained on a bounded sample of the train
documents (`sample_mb`, spread over the chunks). The eval split is the documents whose name
hashes below `eval_fraction` (`sources.split_of`, as training runs split), or all of
`eval_source`.
"""

import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import time
import types

from transformer import console
from transformer.data import spawn
from transformer.data.text import sources, store_encoding, tokenizers
from transformer.data.text import token_store as store

# A worker is one core, and never an accelerator's (it imports no jax; this keeps it so).
_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Documents tokenized together into one shard per split; `rule` 'hash', 'train' or 'eval'."""

    index: int
    rule: str
    segments: tuple[sources.Segment, ...]

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segments)


def settings_of(f) -> dict:
    """What a store's content depends on (a resumed build must be given the same)."""
    trained = f.tokenizer in ("bpe", "wordpiece") and not f.tokenizer_path
    return {"source": f.source, "eval_source": f.eval_source or None, "text_field": f.text_field,
            "tokenizer": f.tokenizer, "tokenizer_path": os.path.abspath(f.tokenizer_path) if f.tokenizer_path else None,
            "vocab_size": f.vocab_size if trained else None, "sample_mb": f.sample_mb if trained else None,
            "eval_fraction": None if f.eval_source else f.eval_fraction, "shard_mb": f.shard_mb}


def plan(settings: dict) -> list[Chunk]:
    """The chunks: consecutive segments of --source (then of --eval_source) of about shard_mb MB."""
    piece = max(1, int(settings["shard_mb"] * 1e6))
    chunks = []
    for source, rule in [(settings["source"], "train" if settings["eval_source"] else "hash"),
                         (settings["eval_source"], "eval")]:
        if not source:
            continue
        group, size = [], 0
        segments = sources.segments_of(sources.resolve_files(source), settings["text_field"], piece)
        for i, segment in enumerate(segments):
            group.append(segment)
            size += segment.size
            if size >= piece or i == len(segments) - 1:
                chunks.append(Chunk(len(chunks), rule, tuple(group)))
                group, size = [], 0
    return chunks


def chunk_documents(chunk: Chunk, text_field: str, eval_fraction: float | None):
    """(split, text) of each document of a chunk, in order."""
    for segment in chunk.segments:
        for name, text in sources.read_segment(segment, text_field):
            yield (sources.split_of(name, eval_fraction) if chunk.rule == "hash" else chunk.rule), text


def _sample(chunks: list[Chunk], settings: dict, record: dict) -> list[str]:
    """A bounded, spread-out training sample: the first sample_mb / N MB of train text of each of
    the N chunks that hold train documents (a document cut at the budget)."""
    train_chunks = [c for c in chunks if c.rule != "eval"]
    budget = max(1, int(settings["sample_mb"] * 1e6) // max(1, len(train_chunks)))
    texts, total = [], 0
    for chunk in train_chunks:
        taken = 0
        for split, text in chunk_documents(chunk, settings["text_field"], settings["eval_fraction"]):
            if split != "train":
                continue
            data = text.encode("utf-8")[:budget - taken]
            texts += store_encoding.pieces(data.decode("utf-8", errors="ignore"))  # a trainer's memory bounded
            taken += len(data)
            if taken >= budget:
                break
        total += taken
    record.update(documents=len(texts), bytes=total, sample_mb=settings["sample_mb"], chunks=len(train_chunks),
                  rule="the first sample_mb/chunks MB of train text of each chunk, in document order")
    return texts


def _prepare_tokenizer(out: str, settings: dict, chunks: list[Chunk]) -> dict:
    """Builds (or trains) the tokenizer, saves it into out/tokenizer; its record for the index."""
    directory = os.path.join(out, store.TOKENIZER_DIR)
    partial = directory + store.TMP
    shutil.rmtree(partial, ignore_errors=True)
    trained_on = {}
    config = types.SimpleNamespace(tokenizer=settings["tokenizer"], tokenizer_path=settings["tokenizer_path"] or "",
                                   vocab_size=settings["vocab_size"])
    tokenizer = tokenizers.build_tokenizer(config, partial, lambda: _sample(chunks, settings, trained_on), None)
    if tokenizer.kind == "gpt2":
        for name in store_encoding.GPT2_FILES:  # for tiktoken in the workers
            shutil.copy(os.path.join(os.path.expanduser(settings["tokenizer_path"]), name), partial)
    os.replace(partial, directory)
    return {"kind": tokenizer.kind, "directory": store.TOKENIZER_DIR, "vocab_size": tokenizer.vocab_size,
            "end_of_document": store_encoding.end_of_document_id(tokenizer),
            "fingerprint": store.tokenizer_fingerprint(directory), "trained_on": trained_on or None}


def _start(out: str, settings: dict, chunks: list[Chunk]) -> dict:
    """The build record: the existing one (same settings and plan, else an error), or a new one."""
    plan_hash = hashlib.sha256(json.dumps([dataclasses.asdict(c) for c in chunks]).encode()).hexdigest()
    build_path = os.path.join(out, store.BUILD)
    if os.path.isfile(build_path):
        build = store.read_json(build_path)
        if build["settings"] != settings:
            changed = sorted(k for k in settings if build["settings"].get(k) != settings[k])
            raise ValueError(f"{out} holds a build with other settings ({', '.join(changed)}): give the same "
                             "command, or another --out")
        if build["plan_sha256"] != plan_hash:
            raise ValueError(f"the source changed since the build of {out} began: delete {out} and rebuild")
        return build
    leftovers = set(os.listdir(out)) - {store.TOKENIZER_DIR, store.TOKENIZER_DIR + store.TMP, store.CHUNKS_DIR,
                                        *store.SPLITS}
    if leftovers:
        raise ValueError(f"{out} is not empty and holds no token store build: choose another --out")
    for name in (store.CHUNKS_DIR, *store.SPLITS):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    tokenizer = _prepare_tokenizer(out, settings, chunks)
    build = {"settings": settings, "plan_sha256": plan_hash, "chunks": len(chunks), "tokenizer": tokenizer}
    store.write_json(build_path, build)
    return build


_WORKER = {}  # the encoder of a worker process, made once per store


def _init_worker() -> None:
    os.environ.update(_ENV)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def run_chunk(out: str, settings: dict, chunk: Chunk, tokenizer_fingerprint: str) -> dict:
    """In a worker: tokenizes one chunk into its shards (see store.write_chunk)."""
    if _WORKER.get("key") != (out, tokenizer_fingerprint):
        directory = os.path.join(out, store.TOKENIZER_DIR)
        tokenizer = tokenizers.load_tokenizer(directory)
        _WORKER.update(key=(out, tokenizer_fingerprint), encode=store_encoding.batch_encoder(tokenizer, directory),
                       end=store_encoding.end_of_document_id(tokenizer),
                       dtype=store.storage_dtype(tokenizer.vocab_size))
    documents = chunk_documents(chunk, settings["text_field"], settings["eval_fraction"])
    return store.write_chunk(out, chunk.index, documents, _WORKER["encode"], _WORKER["end"], _WORKER["dtype"])


def _local(out, settings, chunks, workers, fingerprint):
    if workers == 0:
        saved = {k: os.environ.get(k) for k in _ENV}
        os.environ.update(_ENV)
        try:
            yield from (run_chunk(out, settings, c, fingerprint) for c in chunks)
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
        return
    with spawn.main_not_reimported():  # the Pool starts them here
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker)
    try:
        tasks = [(out, settings, c, fingerprint) for c in chunks]
        yield from pool.imap_unordered(_star_run_chunk, tasks)
    finally:
        pool.terminate()
        pool.join()


def _star_run_chunk(args):
    return run_chunk(*args)


def _ray(out, settings, chunks, workers, address, fingerprint):
    try:
        import ray
    except ImportError:
        raise ImportError("--backend ray needs ray: pip install -e '.[ray]'") from None
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    ray.init(address=address or None, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": env})
    task = ray.remote(num_cpus=1, max_retries=1)(run_chunk)
    try:
        waiting, pending = list(chunks), []
        while waiting or pending:
            while waiting and len(pending) < max(1, workers):
                pending.append(task.remote(out, settings, waiting.pop(0), fingerprint))
            done, pending = ray.wait(pending, num_returns=1)
            try:
                yield ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                raise e.cause if isinstance(e.cause, console.USER_ERRORS) else e from None
    finally:
        ray.shutdown()


def build(settings: dict, out: str, workers: int, backend: str = "local", ray_address: str = "",
          progress: bool | None = None) -> dict:
    """Builds (or finishes building) the store at `out`; returns its index."""
    out = os.path.abspath(os.path.expanduser(out))
    if os.path.isfile(os.path.join(out, store.INDEX)):
        index = store.Store.open(out).index
        if index["settings"] != settings:
            raise ValueError(f"{out} is a complete store of other settings: choose another --out")
        return index
    chunks = plan(settings)
    if not sum(c.size for c in chunks):
        raise ValueError(f"{_named(settings)} holds no text (0 bytes): nothing to tokenize into {out}")
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    build_record = _start(out, settings, chunks)
    remove_partials(out)  # what a killed worker was writing
    todo = [c for c in chunks if store.chunk_meta(out, c.index) is None]
    bar = console.progress(total=sum(c.size for c in chunks),
                       initial=sum(c.size for c in chunks) - sum(c.size for c in todo), unit="B", unit_scale=True,
                       unit_divisor=1000, desc=f"tokenizing {len(todo)}/{len(chunks)} chunks",
                       disable=None if progress is None else not progress, smoothing=0.1)
    start, tokens, text_bytes, cpu = time.perf_counter(), 0, 0, 0.0
    fingerprint = build_record["tokenizer"]["fingerprint"]
    results = (_ray(out, settings, todo, workers, ray_address, fingerprint) if backend == "ray"
               else _local(out, settings, todo, workers, fingerprint))
    sizes = {c.index: c.size for c in todo}
    try:
        for meta in results:
            tokens += sum(s["tokens"] for s in meta["splits"].values())
            text_bytes += sum(s["text_bytes"] for s in meta["splits"].values())
            cpu += meta["cpu_seconds"]
            bar.update(sizes[meta["chunk"]])
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start) / 1e6:.2f}M tokens/s")
        bar.close()  # not on an error, whose one line is then the last
    except BaseException:
        results.close()  # stops the workers on an error or Ctrl-C
        remove_partials(out)  # theirs, cut short (a full disk: the space back)
        raise
    finally:
        results.close()
    seconds = time.perf_counter() - start
    header = {"dtype": store.storage_dtype(build_record["tokenizer"]["vocab_size"]).name,
              "vocab_size": build_record["tokenizer"]["vocab_size"],
              "end_of_document": build_record["tokenizer"]["end_of_document"],
              "tokenizer": build_record["tokenizer"], "settings": settings,
              "split_rule": ({"rule": "source", "eval_source": settings["eval_source"]} if settings["eval_source"] else
                             {"rule": "hash", "eval_fraction": settings["eval_fraction"],
                              "function": "transformer.data.text.sources.split_of(document name, eval_fraction)"})}
    metas = [store.chunk_meta(out, c.index) for c in chunks]
    if not sum(meta["splits"][split]["text_bytes"] for meta in metas for split in store.SPLITS):
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise ValueError(f"{_named(settings)} holds no text (its {sum(c.size for c in chunks):,} bytes hold no "
                         f"document's text): no store written at {out}")
    index = store.finish(out, header, metas)
    index["_run"] = {"chunks": len(todo), "seconds": seconds, "tokens": tokens, "text_bytes": text_bytes,
                    "worker_cpu_seconds": cpu}
    return index


def remove_partials(out: str) -> None:
    """Removes the temporary files (`*.PID.tmp`) of the store at `out` that no worker will finish."""
    for directory in (out, *(os.path.join(out, d) for d in (store.CHUNKS_DIR, *store.SPLITS))):
        for name in os.listdir(directory) if os.path.isdir(directory) else []:
            if name.endswith(store.TMP):
                os.remove(os.path.join(directory, name))


def _named(settings: dict) -> str:
    return " and ".join(repr(s) for s in (settings["source"], settings["eval_source"]) if s)


def describe(path: str, show: int = 3, width: int = 240) -> str:
    """A store's index in a few lines, and its first `show` documents of each split decoded."""
    st = store.Store.open(path)
    index, tok = st.index, st.index["tokenizer"]
    lines = [f"store        {st.path}",
             f"tokenizer    {tok['kind']}, {index['vocab_size']} ids, fingerprint {tok['fingerprint']}",
             f"dtype        {index['dtype']}, end of document id {index['end_of_document']}",
             f"fingerprint  {index['fingerprint']}",
             f"split rule   {json.dumps(index['split_rule'])}",
             f"settings     {json.dumps({k: v for k, v in index['settings'].items() if v is not None})}"]
    if tok.get("trained_on"):
        lines.append(f"trained on   {json.dumps(tok['trained_on'])}")
    for name, split in index["splits"].items():
        per = split["text_bytes"] / split["tokens"] if split["tokens"] else float("nan")
        lines.append(f"{name:<12} {split['tokens']:,} tokens, {split['documents']:,} documents, "
                     f"{len(split['shards'])} shards, {split['text_bytes'] / 1e6:,.1f} MB of text "
                     f"({per:.2f} bytes/token)")
        if split["documents_holding_end_id"]:
            lines.append(f"warning      {split['documents_holding_end_id']:,} {name} documents hold the "
                         "end-of-document id in their own text: more end ids than documents")
    tokenizer = st.tokenizer()
    for name in index["splits"]:
        for i, ids in enumerate(st.documents(name, show)):
            text = tokenizer.decode(ids)
            text = text if len(text) <= width else text[:width] + f"... [{len(text):,} characters]"
            lines.append(f"--- {name} document {i} ({len(ids):,} tokens)\n{text}")
    return "\n".join(lines)


