import numpy as np
import pytest

from h2jax.data import TokenDataset, decode, encode, stdlib_corpus, write_token_file


def test_byte_tokenizer_round_trip():
    text = "def f(x):\n    return x  # héllo"
    assert decode(encode(text)) == text
    assert encode("A").tolist() == [65]


def test_batches_are_deterministic_and_resumable(tmp_path):
    path = write_token_file(np.arange(1000) % 256, tmp_path / "t.u8")
    a, b = TokenDataset(path, 8, seed=3), TokenDataset(path, 8, seed=3)
    assert np.array_equal(a.batch(5, 4), b.batch(5, 4))  # any step, any process
    assert not np.array_equal(a.batch(5, 4), a.batch(6, 4))
    assert not np.array_equal(a.batch(5, 4), TokenDataset(path, 8, seed=4).batch(5, 4))
    batch = a.batch(0, 4)
    assert batch.shape == (4, 9) and batch.dtype == np.int32
    # windows are contiguous runs of the file: labels are the inputs shifted by one
    assert np.all((batch[:, 1:] - batch[:, :-1]) % 256 == 1)


def test_short_file_is_refused(tmp_path):
    path = write_token_file(np.zeros(5), tmp_path / "t.u8")
    with pytest.raises(ValueError, match="seq_len"):
        TokenDataset(path, 8)


def test_stdlib_corpus_is_real_python(tmp_path):
    path = stdlib_corpus(tmp_path / "corpus.u8", max_bytes=200_000)
    text = decode(np.fromfile(path, dtype=np.uint8))
    assert len(text) >= 190_000 and "def " in text and "import " in text
