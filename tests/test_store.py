"""Tests of token stores: the tokenize CLI's build, resume and errors, the source formats and the reader."""

import glob
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import types

import numpy as np
import pytest
from conftest import UNICODE

from transformer.data.text import sources, store_build, store_encoding, token_store, tokenizers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def settings(source, **overrides) -> dict:
    fields = dict(source=source, eval_source="", text_field="text", tokenizer="byte", tokenizer_path="",
                  vocab_size=300, sample_mb=1.0, eval_fraction=0.2, shard_mb=0.004)
    fields.update(overrides)
    return store_build.settings_of(types.SimpleNamespace(**fields))


def build(source, out, workers=0, **overrides) -> token_store.Store:
    store_build.build(settings(source, **overrides), str(out), workers, progress=False)
    return token_store.Store.open(str(out))


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transformer.data.tokenize", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def shard_bytes(path) -> dict[str, bytes]:
    return {os.path.relpath(p, path): open(p, "rb").read()
            for p in sorted(glob.glob(os.path.join(path, "*", "*.bin")))}


def texts_of(tokens: np.ndarray, end: int) -> list[bytes]:
    """A byte store's documents (each ends with the end-of-document id)."""
    assert len(tokens) and tokens[-1] == end
    return tokens.tobytes().split(bytes([end]))[:-1]


def write_formats(directory, texts: list[str]) -> dict[str, str]:
    """The same documents as JSON lines, .jsonl.gz, .jsonl.zst, Parquet and a datasets directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    os.makedirs(directory, exist_ok=True)
    lines = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)).encode()
    paths = {fmt: os.path.join(directory, f"docs.{fmt}") for fmt in ("jsonl", "jsonl.gz", "jsonl.zst", "parquet")}
    open(paths["jsonl"], "wb").write(lines)
    open(paths["jsonl.gz"], "wb").write(gzip.compress(lines))
    open(paths["jsonl.zst"], "wb").write(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), paths["parquet"], row_group_size=7)
    paths["datasets"] = os.path.join(directory, "hf")
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(paths["datasets"])
    except ImportError:  # the same layout written by hand: an Arrow stream listed in state.json
        os.makedirs(paths["datasets"])
        table = pa.table({"text": texts})
        with pa.ipc.new_stream(os.path.join(paths["datasets"], "data-00000-of-00001.arrow"), table.schema) as w:
            w.write_table(table, max_chunksize=5)
        with open(os.path.join(paths["datasets"], "state.json"), "w") as f:
            json.dump({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}, f)
    return paths


def test_byte_store_is_uint8_documents_then_0xff_split_like_runs(corpus, tmp_path):
    st = build(corpus, tmp_path / "store", eval_fraction=0.2)
    assert st.dtype == np.uint8 and st.end_of_document == 0xFF and st.vocab_size == 256
    assert st.index["chunks"] > 3  # several shards, so reads cross their boundaries
    expected = {"train": [], "eval": []}
    for name, text in sources.read_documents(sources.resolve_files(corpus)):
        expected[sources.split_of(name, 0.2)].append(text)
    for name in ("train", "eval"):
        split = st.split(name)
        tokens = split.read(0, len(split))
        assert texts_of(tokens, 0xFF) == [t.encode("utf-8") for t in expected[name]]
        assert split.num_documents == len(expected[name]) == int((tokens == 0xFF).sum())
        assert np.array_equal(np.concatenate(split.shards), tokens)
    assert st.split("train").offsets.dtype == np.int64


def test_reader_reads_across_shard_boundaries(corpus, tmp_path):
    split = build(corpus, tmp_path / "store").split("train")
    whole = np.concatenate([np.asarray(s) for s in split.shards])
    assert len(split.shards) > 2 and split.offsets[-1] == len(split) == len(whole)
    rng = np.random.default_rng(1)
    for start in [*split.offsets[1:-1] - 3, *rng.integers(0, len(whole), 20)]:
        stop = min(len(whole), int(start) + int(rng.integers(0, 3 * len(whole) // len(split.shards))))
        np.testing.assert_array_equal(split.read(int(start), stop), whole[start:stop])
    assert split.read(5, 5).shape == (0,) and split.read(5, 5).dtype == np.uint8
    with pytest.raises(IndexError, match="train split"):
        split.read(0, len(split) + 1)


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_shards_are_the_same_bytes_for_one_and_two_workers(corpus, tmp_path, kind):
    one = build(corpus, tmp_path / "one", workers=1, tokenizer=kind)
    two = build(corpus, tmp_path / "two", workers=2, tokenizer=kind)
    assert len(shard_bytes(one.path)) > 4
    assert shard_bytes(one.path) == shard_bytes(two.path)
    assert one.index == two.index
    assert one.fingerprint == two.fingerprint


def test_resume_from_a_partial_state_gives_the_same_store(corpus, tmp_path):
    whole = build(corpus, tmp_path / "whole", tokenizer="bpe")
    partial = str(tmp_path / "partial")
    shutil.copytree(whole.path, partial)
    os.remove(os.path.join(partial, token_store.INDEX))
    for chunk in (1, 3):  # unfinished chunks: their records gone, a shard cut short, a worker's temp file
        os.remove(token_store.chunk_path(partial, chunk))
    with open(os.path.join(partial, token_store.shard_name("train", 1)), "r+b") as f:
        f.truncate(5)
    open(os.path.join(partial, "train", "000003.bin.999.tmp"), "wb").write(b"junk")
    with pytest.raises(FileNotFoundError, match="unfinished.*same tokenize command"):
        token_store.Store.open(partial)
    index = store_build.build(settings(corpus, tokenizer="bpe"), partial, 0, progress=False)
    assert index["_run"]["chunks"] == 2
    resumed = token_store.Store.open(partial)
    assert shard_bytes(resumed.path) == shard_bytes(whole.path) and resumed.index == whole.index
    assert not glob.glob(os.path.join(partial, "**", "*.tmp"), recursive=True)


def test_resume_after_sigkill_gives_the_same_store(tmp_path):
    out = str(tmp_path / "killed")
    args = ["--source", "stdlib", "--out", out, "--workers", "1", "--shard_mb", "0.5"]
    process = subprocess.Popen([sys.executable, "-m", "transformer.data.tokenize", *args], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(glob.glob(os.path.join(out, token_store.CHUNKS_DIR, "*.json"))) < 3:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not os.path.exists(os.path.join(out, token_store.INDEX)), "the build finished before it was killed"
    with pytest.raises(FileNotFoundError, match="unfinished"):
        token_store.Store.open(out)
    result = cli(*args)
    assert result.returncode == 0, result.stderr
    fresh = build("stdlib", tmp_path / "fresh", eval_fraction=0.02, shard_mb=0.5)
    resumed = token_store.Store.open(out)
    assert shard_bytes(resumed.path) == shard_bytes(fresh.path)
    assert resumed.fingerprint == fresh.fingerprint


def test_ctrl_c_stops_the_workers_and_leaves_a_resumable_build(tmp_path):
    out = str(tmp_path / "interrupted")
    slow = ["--tokenizer", "bpe", "--vocab_size", "300", "--sample_mb", "0.3"]  # seconds, not a byte store's
    source = f"{sysconfig.get_paths()['stdlib']}/asyncio/*.py"  # 0.5 MB, about 25 chunks
    args = ["--source", source, "--out", out, "--workers", "2", "--shard_mb", "0.02", *slow]
    process = subprocess.Popen([sys.executable, "-m", "transformer.data.tokenize", *args], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(glob.glob(os.path.join(out, token_store.CHUNKS_DIR, "*.json"))) < 3:
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C sends: to the command and its workers
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and "run the same command to resume" in stderr, stderr
    assert not os.path.exists(os.path.join(out, token_store.INDEX))
    result = cli(*args)
    assert result.returncode == 0, result.stderr
    fresh = build(source, tmp_path / "fresh", workers=2, eval_fraction=0.02, shard_mb=0.02, tokenizer="bpe",
                  vocab_size=300, sample_mb=0.3)
    assert shard_bytes(out) == shard_bytes(fresh.path)


def test_resume_with_other_settings_fails(corpus, tmp_path):
    build(corpus, tmp_path / "store")
    os.remove(tmp_path / "store" / token_store.INDEX)
    with pytest.raises(ValueError, match="other settings.*eval_fraction"):
        store_build.build(settings(corpus, eval_fraction=0.5), str(tmp_path / "store"), 0, progress=False)


def test_every_source_format_gives_the_same_tokens(tmp_path):
    texts = [f"document {i}: " + "word " * (i % 13) + UNICODE * (i % 3) for i in range(60)]
    paths = write_formats(tmp_path / "formats", texts)
    expected = b"".join(t.encode("utf-8") + b"\xff" for t in texts)
    for fmt, path in paths.items():
        st = build(path, tmp_path / fmt, eval_fraction=0.0, shard_mb=0.0005)
        assert st.split("train").read(0, len(st.split("train"))).tobytes() == expected, fmt
        assert len(st.split("eval")) == 0
    names = [n for n, _ in sources.read_documents(sources.resolve_files(paths["parquet"]))]
    assert names[:2] == ["docs.parquet:0", "docs.parquet:1"]


def test_large_json_lines_are_cut_at_line_starts(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i} " + "é" * (i % 40)}) + "\n" for i in range(3000)))
    pieces = sources.segments_of([str(path)], "text", piece_bytes=5000)
    assert len(pieces) > 10 and pieces[0].start == 0 and pieces[-1].stop == os.path.getsize(path)
    assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))
    read = [doc for piece in pieces for doc in sources.read_segment(piece)]
    assert read == list(sources.read_documents([str(path)]))
    assert read[-1][0] == "big.jsonl:3000"


@pytest.mark.parametrize("case", ["truncated_gzip", "parquet_without_column", "malformed_json"])
def test_malformed_input_fails_in_one_line_naming_the_file_and_leaves_no_store(tmp_path, case):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = "".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(400))
    if case == "truncated_gzip":
        path, where = tmp_path / "data.jsonl.gz", r"data\.jsonl\.gz:\d+: truncated or corrupt gzip"
        data = gzip.compress(good.encode())
        path.write_bytes(data[:len(data) // 2])
    elif case == "parquet_without_column":
        path, where = tmp_path / "data.parquet", r"data\.parquet: no column 'text' \(columns: body\)"
        pq.write_table(pa.table({"body": ["a", "b"]}), path)
    else:
        path, where = tmp_path / "data.jsonl", r"data\.jsonl:301: malformed JSON"
        lines = good.splitlines(keepends=True)
        path.write_text("".join(lines[:300]) + '{"text": oops}\n' + "".join(lines[300:]))
    out = str(tmp_path / "store")
    result = cli("--source", str(path), "--out", out, "--workers", "1", "--shard_mb", "0.002")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: ") and __import__("re").search(where, result.stderr), result.stderr
    with pytest.raises(FileNotFoundError):
        token_store.Store.open(out)


def test_eval_split_from_its_own_source(corpus, tmp_path):
    eval_dir = tmp_path / "held_out"
    eval_dir.mkdir()
    for i in range(3):
        (eval_dir / f"e{i}.txt").write_text(f"held-out document {i}")
    st = build(corpus, tmp_path / "store", eval_source=str(eval_dir / "*.txt"))
    everything = [t.encode() for _, t in sources.read_documents(sources.resolve_files(corpus))]
    assert texts_of(st.split("train").read(0, len(st.split("train"))), 0xFF) == everything
    assert texts_of(st.split("eval").read(0, len(st.split("eval"))), 0xFF) == [
        f"held-out document {i}".encode() for i in range(3)]
    assert st.index["settings"]["eval_fraction"] is None
    assert st.index["split_rule"] == {"rule": "source", "eval_source": str(eval_dir / "*.txt")}


def test_trained_bpe_states_its_bounded_sample(corpus, tmp_path):
    st = build(corpus, tmp_path / "store", tokenizer="bpe", vocab_size=300, sample_mb=0.003)
    sample = st.index["tokenizer"]["trained_on"]
    chunks = st.index["chunks"]
    assert sample["sample_mb"] == 0.003 and sample["chunks"] == chunks > 1
    assert 0 < sample["bytes"] <= 3000 and sample["documents"] >= chunks
    assert st.dtype == np.uint16 and st.end_of_document == tokenizers.SPECIALS.index("[EOS]")
    tokenizer = st.tokenizer()
    assert tokenizer.kind == "bpe" and tokenizer.vocab_size == st.vocab_size
    first = st.documents("train", 1)[0]
    assert tokenizer.decode(first).startswith("document ")
    assert st.index["tokenizer"]["fingerprint"] == token_store.tokenizer_fingerprint(os.path.join(st.path, "tokenizer"))


def test_wordpiece_store_ends_documents_with_eos(corpus, tmp_path):
    st = build(corpus, tmp_path / "store", tokenizer="wordpiece", vocab_size=300)
    tokens = st.split("train").read(0, len(st.split("train")))
    assert int((tokens == st.end_of_document).sum()) == st.split("train").num_documents
    assert st.index["splits"]["train"]["documents_holding_end_id"] == 0


def test_documents_whose_text_holds_the_end_token_are_counted(tmp_path):
    (tmp_path / "a.txt").write_text("plain text " * 50)
    (tmp_path / "b.txt").write_text("a literal [EOS] inside " * 50)
    st = build(str(tmp_path / "*.txt"), tmp_path / "store", tokenizer="bpe", eval_fraction=0.0)
    assert st.index["splits"]["train"]["documents"] == 2
    assert st.index["splits"]["train"]["documents_holding_end_id"] == 1


def test_hf_tokenizer_store_ends_documents_with_its_eos_token(corpus, tmp_path):
    texts = [t for _, t in sources.read_documents(sources.resolve_files(corpus))]
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    tokenizers.train_bpe(texts, 300).tokenizer.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": "[SEP]", "pad_token": "[PAD]"}))
    st = build(corpus, tmp_path / "store", tokenizer="hf", tokenizer_path=str(hf_dir))
    assert st.index["tokenizer"]["kind"] == "hf" and st.end_of_document == tokenizers.SPECIALS.index("[SEP]")
    tokenizer = st.tokenizer()
    first = next(t for n, t in sources.read_documents(sources.resolve_files(corpus))
                 if sources.split_of(n, 0.2) == "train")
    np.testing.assert_array_equal(st.documents("train", 1)[0], tokenizer.encode(first))


def test_tiktoken_gpt2_ids_equal_the_tokenizers_path(gpt2_dir):
    fast = store_encoding.gpt2_tiktoken(gpt2_dir)
    slow = tokenizers.gpt2_tokenizer(gpt2_dir)
    code = open(sources.stdlib_files()[100], encoding="utf-8").read()
    texts = [UNICODE, code, "  \n\n\t\t   x  y\u3000\u00a0z \r\n\r\n    ", "I'm you'll they've 'S 's",
             "1234567 3.14159 0xFF", "<|endoftext|> [EOS]", "🎉🎉 ñ\u0301 Ελληνικά русский العربية", "", " " * 50]
    for text in texts:
        assert fast.encode_ordinary(text) == slow.encode(text).tolist(), repr(text[:40])
    files = sources.stdlib_files()[::40]  # about 45 files of real code, every part of the stdlib
    code = [t for _, t in sources.read_documents(files)]
    assert fast.encode_ordinary_batch(code) == [e.ids for e in slow.tokenizer.encode_batch(code)]
    assert store_encoding.end_of_document_id(slow) == 50256


def test_gpt2_store(gpt2_dir, corpus, tmp_path):
    st = build(corpus, tmp_path / "store", tokenizer="gpt2", tokenizer_path=gpt2_dir)
    assert st.dtype == np.uint16 and st.end_of_document == 50256
    assert sorted(os.listdir(os.path.join(st.path, "tokenizer")))[:2] == ["encoder.json", "tokenizer.json"]
    slow = tokenizers.gpt2_tokenizer(gpt2_dir)
    first = next(t for n, t in sources.read_documents(sources.resolve_files(corpus))
                 if sources.split_of(n, 0.2) == "train")
    np.testing.assert_array_equal(st.documents("train", 1)[0], slow.encode(first))


def test_inspect_prints_the_index_and_decodes_documents(corpus, tmp_path):
    st = build(corpus, tmp_path / "store")
    result = cli("--inspect", st.path, "--show", "2")
    assert result.returncode == 0, result.stderr
    train = st.index["splits"]["train"]
    assert f"{train['tokens']:,} tokens, {train['documents']:,} documents" in result.stdout
    assert "uint8, end of document id 255" in result.stdout and st.fingerprint in result.stdout
    assert '"rule": "hash", "eval_fraction": 0.2' in result.stdout
    assert result.stdout.count("--- train document") == 2 and "document " in result.stdout.split("--- train")[1]


def test_incomplete_or_damaged_store_does_not_open(corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a token store"):
        token_store.Store.open(str(tmp_path))
    st = build(corpus, tmp_path / "store")
    with open(os.path.join(st.path, token_store.shard_name("train", 0)), "ab") as f:
        f.write(b"x")
    with pytest.raises(FileNotFoundError, match="damaged"):
        token_store.Store.open(st.path)
    result = cli("--inspect", str(tmp_path / "nothing"))
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "not a token store" in result.stderr


def test_storage_dtype_is_the_smallest_unsigned():
    assert [token_store.storage_dtype(v) for v in (256, 257, 65536, 65537, 50257)] == [
        np.uint8, np.uint16, np.uint16, np.uint32, np.uint16]


@pytest.mark.slow
def test_ray_backend_writes_the_same_shards(corpus, tmp_path):
    pytest.importorskip("ray")
    local = build(corpus, tmp_path / "local", workers=0)
    store_build.build(settings(corpus), str(tmp_path / "ray"), 2, backend="ray", progress=False)
    assert shard_bytes(str(tmp_path / "ray")) == shard_bytes(local.path)


def test_a_datasets_directory_with_a_bad_state_json_names_it(tmp_path):
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"state\.json: malformed JSON"):
        sources.resolve_files(str(tmp_path))
    (tmp_path / "state.json").write_text('{"_data_files": []}')
    with pytest.raises(ValueError, match="lists no data files"):
        sources.resolve_files(str(tmp_path))


def test_a_script_without_a_main_guard_builds_with_worker_processes(tmp_path):
    """The spawned tokenizer pool must not re-run the parent script (transformer/data/spawn.py)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    script = tmp_path / "build.py"
    script.write_text(
        f"import sys, types\nsys.path.insert(0, {REPO!r})\nfrom transformer.data.text import store_build, token_store\n"
        f"print('script ran', flush=True)\n"
        f"fields = dict(source={str(corpus)!r}, eval_source='', text_field='text', tokenizer='byte', tokenizer_path='',"
        f" vocab_size=300, sample_mb=1.0, eval_fraction=0.2, shard_mb=0.004)\n"
        f"store_build.build(store_build.settings_of(types.SimpleNamespace(**fields)), {str(tmp_path / 'store')!r}, 2,"
        f" progress=False)\n"
        f"print(token_store.Store.open({str(tmp_path / 'store')!r}).index['splits']['train']['tokens'])\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("script ran") == 1 and int(out.stdout.split()[-1]) > 0


FULL_DISK = """import builtins, errno, runpy, sys
from transformer.data.text import token_store
written = [0]
class Full:  # a shard on a disk that fills after 3,000 bytes
    def __init__(self, file):
        self.file = file
    def write(self, data):
        written[0] += len(data)
        if written[0] > 3000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data)
    def __getattr__(self, name):
        return getattr(self.file, name)
def full_open(path, mode="r", *args, **kwargs):
    if ".bin." not in path or "w" not in mode:
        return builtins.open(path, mode, *args, **kwargs)
    builtins.open(path.replace(".bin.", "_other.bin."), "wb").write(b"x")  # another worker's, cut short
    return Full(builtins.open(path, mode, *args, **kwargs))
token_store.open = full_open
sys.argv = ["tokenize", *sys.argv[1:]]
runpy.run_module("transformer.data.tokenize", run_name="__main__")
"""


def test_a_full_disk_names_the_path_and_the_space_and_leaves_no_partial_shards(corpus, tmp_path):
    out = tmp_path / "store"
    result = subprocess.run([sys.executable, "-c", FULL_DISK, f"--source={corpus}", f"--out={out}", "--workers=0",
                             "--shard_mb=0.004"], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 2, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: No space left on device (") and " GB free of " in error, error
    assert error.endswith(".bin") and str(out) in error and "the partial shards are removed" in error
    assert not glob.glob(str(out / "**" / "*.tmp"), recursive=True)
