"""Deterministic batches from token files.

Batch `n` is a pure function of (seed, n): every process of an MPI job builds the same batch
without communicating, and a resumed run asks for step n's batch and gets the one it would
have had. A batch is `batch_size` windows of `seq_len + 1` consecutive tokens (inputs and the
labels shifted by one) whose starts are drawn uniformly over the split; a window may span two
shards. Files are memory-mapped, so a process reads only the windows it asks for: a process
whose stages need no tokens (no first or last stage) never touches the data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from h2jax.data.manifest import DataError, Manifest, read_manifest

SPLITS = ("train", "val")
_VAL_STREAM = 1  # a third seed word keeps validation draws apart from training draws


class _Stream:
    """Tokens `[lo, hi)` of a stream stored as consecutive memory-mapped shards."""

    def __init__(self, shards: list[np.ndarray], lo: int, hi: int):
        self.shards = shards
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in shards])]).astype(np.int64)
        self.lo, self.hi = lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int32 [len(starts), length]: tokens starts[i] + lo ... + length - 1."""
        out = np.empty((len(starts), length), dtype=np.int32)
        for row, start in enumerate(starts + self.lo):
            pos, filled = int(start), 0
            while filled < length:
                k = int(np.searchsorted(self.offsets, pos, side="right")) - 1
                shard, off = self.shards[k], pos - int(self.offsets[k])
                take = min(length - filled, len(shard) - off)
                out[row, filled:filled + take] = shard[off:off + take]
                filled, pos = filled + take, pos + take
        return out


def _draw(stream: _Stream, seq_len: int, seed_words: list[int], batch_size: int) -> np.ndarray:
    rng = np.random.default_rng(seed_words)
    # (The last possible start, len - seq_len - 1, is never drawn: kept so that batches of raw
    # token files stay what they were before prepared datasets existed.)
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    return stream.windows(starts, seq_len + 1)


def _check_length(n: int, seq_len: int, what: str) -> None:
    if n < seq_len + 2:
        raise DataError(
            f"{what} holds {n} tokens, fewer than seq_len + 2 = {seq_len + 2}; "
            "use more text or a shorter seq_len"
        )


class TokenDataset:
    """A raw uint8 token file (bytes, vocabulary 256); no validation split."""

    vocab_size = 256
    has_val = False

    @property
    def tokenizer_sha256(self) -> str:
        """The bytes tokenizer's: a raw byte file holds the ids `--tokenizer bytes` gives."""
        from h2jax.data.tokenizers import ByteTokenizer

        return ByteTokenizer().sha256

    def __init__(self, path: str | Path, seq_len: int, seed: int = 0):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(
                f"--data {self.path} does not exist; give a token file or a directory from "
                "`h2jax data prepare`, or leave --data out to train on the Python standard library's source"
            )
        # Checked before mapping: numpy cannot map an empty file.
        _check_length(self.path.stat().st_size, seq_len, f"--data token file {self.path}")
        self.tokens = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.seq_len, self.seed = seq_len, seed
        self._stream = _Stream([self.tokens], 0, len(self.tokens))

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        """Batch number `step`: int32 [batch_size, seq_len + 1]."""
        return _draw(self._stream, self.seq_len, [self.seed, step], batch_size)


class PreparedDataset:
    """A directory written by `h2jax data prepare`: training batches by (seed, step) and
    validation batches by (seed, index) from the validation split."""

    def __init__(self, directory: str | Path, seq_len: int, seed: int = 0):
        self.directory = Path(directory)
        self.manifest: Manifest = read_manifest(self.directory)
        self.seq_len, self.seed = seq_len, seed
        dtype = np.dtype(self.manifest.dtype)
        shards = [np.memmap(self.directory / s["file"], dtype=dtype, mode="r") for s in self.manifest.shards]
        m = self.manifest
        self._train = _Stream(shards, 0, m.train_tokens)
        self._val = _Stream(shards, m.train_tokens, m.n_tokens)
        _check_length(m.train_tokens, seq_len, f"the training split of {self.directory}")

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def tokenizer_sha256(self) -> str:
        return self.manifest.tokenizer_sha256

    @property
    def has_val(self) -> bool:
        return len(self._val) >= self.seq_len + 2

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        """Training batch number `step`: int32 [batch_size, seq_len + 1]."""
        return _draw(self._train, self.seq_len, [self.seed, step], batch_size)

    def val_batch(self, index: int, batch_size: int) -> np.ndarray:
        """Validation batch number `index` (the same windows at every evaluation)."""
        _check_length(len(self._val), self.seq_len, f"the validation split of {self.directory}")
        return _draw(self._val, self.seq_len, [self.seed, index, _VAL_STREAM], batch_size)

    def tokenizer(self):
        from h2jax.data.tokenizers import load_saved_tokenizer

        return load_saved_tokenizer(self.directory, self.manifest.tokenizer)


def open_dataset(path: str | Path, seq_len: int, seed: int = 0) -> TokenDataset | PreparedDataset:
    """A prepared dataset directory, or a raw uint8 token file."""
    path = Path(path)
    if path.is_dir():
        return PreparedDataset(path, seq_len, seed)
    if path.is_file():
        return TokenDataset(path, seq_len, seed)
    raise DataError(f"--data {path} does not exist; give a directory from `h2jax data prepare` or a token file")


def check_compatible(dataset, vocab_size: int, tokenizer_sha256: str | None = None, *, where: str = "the model") -> None:
    """Refuse a dataset whose ids do not fit the model's vocabulary, or whose tokenizer differs
    from the one a checkpoint was trained with (`tokenizer_sha256`; None: not recorded)."""
    if dataset.vocab_size > vocab_size:
        from h2jax.data.tokenizers import MIN_BPE_VOCAB

        smaller = f"train-bpe:{vocab_size}" if vocab_size >= MIN_BPE_VOCAB else "bytes"
        raise DataError(
            f"the dataset's vocabulary ({dataset.vocab_size} tokens) is larger than {where}'s "
            f"vocab_size ({vocab_size}); use a model with vocab_size >= {dataset.vocab_size}, or "
            f"prepare the data with a smaller tokenizer (--tokenizer {smaller})"
        )
    if tokenizer_sha256 is not None and dataset.tokenizer_sha256 != tokenizer_sha256:
        raise DataError(
            f"the dataset's tokenizer (sha256 {str(dataset.tokenizer_sha256)[:12]}...) differs from the "
            f"checkpoint's (sha256 {tokenizer_sha256[:12]}...); prepare the data with the checkpoint's "
            "tokenizer (pass its tokenizer.json to `h2jax data prepare --tokenizer`)"
        )
