"""`h2jax data prepare` and prepared-dataset loading: tokenizers, round trips, splits,
determinism across processes and shards, and each bad input's error."""

import json
import subprocess
import sys

import numpy as np
import pytest

from h2jax.data import DataError, PreparedDataset, check_compatible, open_dataset, prepare, read_manifest
from h2jax.data.tokenizers import tokenizer_from_file

DOCS = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n",
    "The quick brown fox jumps over the lazy dog. " * 40 + "Ünïcödé: naïve café, 日本語.\n",
    "import os\nimport sys\n\nfor name in sorted(os.listdir('.')):\n    print(name, file=sys.stderr)\n" * 12,
]
JSONL_DOCS = ["first line document", "second\nwith a newline and \"quotes\"", "third " * 30]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(DOCS):
        (root / f"doc{i}.txt").write_text(text, encoding="utf-8")
    with open(root / "more.jsonl", "w") as fh:
        for text in JSONL_DOCS:
            fh.write(json.dumps({"text": text, "id": 1}) + "\n")
        fh.write("\n")  # blank lines are skipped
    (root / ".hidden").write_text("never read")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "doc0.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\0\0binary")
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    # expand_inputs sorts a directory's files: doc0, doc1, doc2, more.jsonl
    return root, DOCS + JSONL_DOCS


def read_stream(directory):
    m = read_manifest(directory)
    return np.concatenate([np.fromfile(directory / s["file"], dtype=m.dtype) for s in m.shards]), m


def decode_documents(directory):
    tokens, m = read_stream(directory)
    tok = PreparedDataset(directory, seq_len=4).tokenizer()
    assert tokens[-1] == m.tokenizer["eot_id"]  # every document ends with end-of-text
    cuts = np.flatnonzero(tokens == m.tokenizer["eot_id"])
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [tok.decode(tokens[a:b]) for a, b in zip(starts, cuts)], tokens, m


@pytest.fixture(scope="module")
def bpe_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe") / "ds"
    prepare([str(corpus[0])], "train-bpe:400", out, val_fraction=0.05)
    return out


def test_bytes_round_trip(corpus, tmp_path):
    root, docs = corpus
    m = prepare([str(root)], "bytes", tmp_path / "ds", val_fraction=0.1)
    decoded, tokens, _ = decode_documents(tmp_path / "ds")
    assert decoded == docs
    assert m.dtype == "uint16" and m.vocab_size == 256 and m.documents == len(docs)
    assert m.n_tokens == sum(len(d.encode()) for d in docs) + len(docs)  # one end-of-text each
    assert m.val_tokens == round(0.1 * m.n_tokens) and m.train_tokens + m.val_tokens == len(tokens)
    assert m.input_bytes == sum(f.stat().st_size for f in root.iterdir()
                                if f.suffix in (".txt", ".jsonl"))  # not hidden, cache or binary files


def test_trained_bpe_round_trips_and_compresses(corpus, bpe_dir):
    _, docs = corpus
    decoded, tokens, m = decode_documents(bpe_dir)
    assert decoded == docs
    assert m.tokenizer["kind"] == "bpe" and m.vocab_size == 400 and m.dtype == "uint16"
    text_bytes = sum(len(d.encode()) for d in docs)
    assert len(tokens) - len(docs) < 0.6 * text_bytes  # merges learned on this corpus compress it
    assert (bpe_dir / "tokenizer.json").is_file()


def test_tokenizer_json_spec_gives_the_same_tokens(corpus, bpe_dir, tmp_path):
    root, docs = corpus
    prepare([str(root / "doc*.txt"), str(root / "more.jsonl")], str(bpe_dir / "tokenizer.json"),
            tmp_path / "ds", val_fraction=0.05)
    decoded, tokens, m = decode_documents(tmp_path / "ds")
    assert decoded == docs
    assert m.tokenizer["kind"] == "huggingface"
    assert m.tokenizer_sha256 == read_manifest(bpe_dir).tokenizer_sha256
    assert np.array_equal(tokens, read_stream(bpe_dir)[0])


def test_large_vocabulary_uses_uint32(corpus, bpe_dir, tmp_path):
    tok = tokenizer_from_file(bpe_dir / "tokenizer.json").tok
    tok.add_tokens([f"<extra{i}>" for i in range(70_000)])
    tok.save(str(tmp_path / "big.json"))
    m = prepare([str(corpus[0] / "doc0.txt")], str(tmp_path / "big.json"), tmp_path / "ds", val_fraction=0.1)
    assert m.dtype == "uint32" and m.vocab_size > 1 << 16
    assert decode_documents(tmp_path / "ds")[0] == [DOCS[0]]


def test_long_documents_are_encoded_in_pieces_with_the_same_ids(bpe_dir):
    from h2jax.data.tokenizers import split_for_encoding

    tok = tokenizer_from_file(bpe_dir / "tokenizer.json")
    text = "".join(DOCS) * 50 + "tail  \n  spaces\n\nx"
    pieces = list(split_for_encoding(text, max_chars=500))
    assert len(pieces) > 10 and "".join(pieces) == text
    whole = tok.encode_batch([text])[0]
    assert np.array_equal(np.concatenate(tok.encode_batch(pieces)), whole)


def test_batches_span_shards_and_do_not_depend_on_sharding(corpus, tmp_path):
    root, _ = corpus
    prepare([str(root)], "bytes", tmp_path / "one", val_fraction=0.1)
    prepare([str(root)], "bytes", tmp_path / "many", val_fraction=0.1, shard_tokens=97)
    assert len(read_manifest(tmp_path / "many").shards) > 10
    one, many = PreparedDataset(tmp_path / "one", 32, seed=5), PreparedDataset(tmp_path / "many", 32, seed=5)
    tokens = read_stream(tmp_path / "one")[0]
    for step in range(20):
        a = many.batch(step, 8)
        assert np.array_equal(a, one.batch(step, 8))
        assert a.shape == (8, 33) and a.dtype == np.int32
        for row in a:  # each row is a window of the stream, inside the training split
            starts = np.flatnonzero(tokens[: one.manifest.train_tokens - 32] == row[0])
            assert any(np.array_equal(tokens[s:s + 33], row) for s in starts)
    assert np.array_equal(many.val_batch(0, 4), one.val_batch(0, 4))
    assert not np.array_equal(one.batch(0, 8), one.batch(1, 8))
    assert not np.array_equal(one.batch(0, 8), PreparedDataset(tmp_path / "one", 32, seed=6).batch(0, 8))


def test_validation_batches_come_from_the_tail(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 900)
    (tmp_path / "b.txt").write_text("b" * 200)
    prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], "bytes", tmp_path / "ds", val_fraction=0.1)
    ds = PreparedDataset(tmp_path / "ds", 16)
    assert set(np.unique(ds.val_batch(3, 16))) == {ord("b")}
    assert np.array_equal(ds.val_batch(3, 16), PreparedDataset(tmp_path / "ds", 16).val_batch(3, 16))
    assert ord("a") in np.unique(ds.batch(0, 64))


_BATCH_IN_ANOTHER_PROCESS = """
import hashlib, sys
from h2jax.data import open_dataset
ds = open_dataset(sys.argv[1], 16, seed=3)
print(hashlib.sha256(ds.batch(int(sys.argv[2]), 8).tobytes()).hexdigest())
"""


def test_same_seed_and_step_give_the_same_batch_in_another_process(bpe_dir):
    import hashlib

    here = open_dataset(bpe_dir, 16, seed=3)
    for step in (0, 7):
        out = subprocess.run([sys.executable, "-c", _BATCH_IN_ANOTHER_PROCESS, str(bpe_dir), str(step)],
                             capture_output=True, text=True, timeout=120, check=True)
        assert out.stdout.strip() == hashlib.sha256(here.batch(step, 8).tobytes()).hexdigest()


def test_resumed_dataset_gives_the_batches_of_an_uninterrupted_run(bpe_dir):
    first = open_dataset(bpe_dir, 16, seed=1)
    uninterrupted = [first.batch(n, 4) for n in range(6)]
    resumed = open_dataset(bpe_dir, 16, seed=1)  # a new process after step 3
    assert all(np.array_equal(resumed.batch(n, 4), uninterrupted[n]) for n in range(3, 6))


# ----------------------------------------------------------------------------- bad input


def test_unknown_input_file(tmp_path):
    with pytest.raises(DataError, match="--input .*nope.txt: no such file"):
        prepare([str(tmp_path / "nope.txt")], "bytes", tmp_path / "ds")


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        prepare([str(tmp_path / "empty.txt")], "bytes", tmp_path / "ds")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="holds no text"):
        prepare([str(tmp_path / "blank.jsonl")], "bytes", tmp_path / "ds2")


def test_vocabulary_too_large_for_the_model(bpe_dir):
    ds = open_dataset(bpe_dir, 16)
    with pytest.raises(DataError, match=r"vocabulary \(400 tokens\) is larger than the model's vocab_size "
                                        r"\(256\).*--tokenizer bytes"):
        check_compatible(ds, 256)
    with pytest.raises(DataError, match=r"--tokenizer train-bpe:300"):
        check_compatible(ds, 300)
    check_compatible(ds, 400)


def test_tokenizer_differs_from_the_checkpoints(bpe_dir, corpus, tmp_path):
    prepare([str(corpus[0])], "bytes", tmp_path / "bytes", val_fraction=0.1)
    ds = open_dataset(tmp_path / "bytes", 16)
    with pytest.raises(DataError, match="tokenizer .* differs from the checkpoint's"):
        check_compatible(ds, 512, tokenizer_sha256=read_manifest(bpe_dir).tokenizer_sha256)
    check_compatible(ds, 512, tokenizer_sha256=ds.tokenizer_sha256)


def test_other_bad_inputs(corpus, tmp_path):
    root, _ = corpus
    with pytest.raises(DataError, match="train-bpe:257 or more"):
        prepare([str(root)], "train-bpe:100", tmp_path / "a")
    with pytest.raises(DataError, match="train-bpe:VOCAB with an integer"):
        prepare([str(root)], "train-bpe:lots", tmp_path / "b")
    with pytest.raises(DataError, match="tokenizer file .*missing.json does not exist"):
        prepare([str(root)], str(tmp_path / "missing.json"), tmp_path / "c")
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1 has no string field 'text'.*--text-field"):
        prepare([str(tmp_path / "bad.jsonl")], "bytes", tmp_path / "d")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt is not UTF-8"):
        prepare([str(tmp_path / "latin1.txt")], "bytes", tmp_path / "e")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    with pytest.raises(DataError, match="--out .*used exists"):
        prepare([str(root)], "bytes", tmp_path / "used")
    with pytest.raises(DataError, match="--val-fraction"):
        prepare([str(root)], "bytes", tmp_path / "f", val_fraction=1.0)
    with pytest.raises(DataError, match="not a prepared dataset"):
        open_dataset(tmp_path / "used", 16)
    with pytest.raises(DataError, match="does not exist"):
        open_dataset(tmp_path / "nowhere", 16)


def test_tokenizer_without_end_of_text_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "no_eot.json"))
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(DataError, match="no end-of-text token"):
        prepare([str(tmp_path / "t.txt")], str(tmp_path / "no_eot.json"), tmp_path / "ds")


def test_cli_prepare_prints_one_manifest_line(corpus, tmp_path, capsys):
    from h2jax.cli import main

    assert main(["data", "prepare", "--input", str(corpus[0]), "--tokenizer", "bytes",
                 "--out", str(tmp_path / "ds"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == read_manifest(tmp_path / "ds").n_tokens
    assert main(["data", "prepare", "--input", str(tmp_path / "none*"), "--tokenizer", "bytes",
                 "--out", str(tmp_path / "x")]) == 2
    assert "no such file" in capsys.readouterr().err
