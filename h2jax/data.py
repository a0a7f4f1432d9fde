"""Byte-level tokenizer and a token-file dataset.

Tokens are bytes (vocab 256), stored as a flat uint8 file read through `np.memmap`. Batch `n`
is a pure function of (seed, n): every process of an MPI job builds the same batch without
communicating, and a run resumes from any step by asking for that step's batch.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

VOCAB_SIZE = 256


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode(tokens: np.ndarray) -> str:
    return np.asarray(tokens, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


def write_token_file(tokens: np.ndarray, path: str | Path) -> Path:
    """Atomic write: a crash never leaves a truncated token file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    np.asarray(tokens, dtype=np.uint8).tofile(tmp)
    tmp.replace(path)
    return path


def default_cache_dir() -> Path:
    return Path(os.environ.get("H2JAX_CACHE", Path.home() / ".cache" / "h2jax"))


def stdlib_corpus(path: str | Path | None = None, max_bytes: int = 8 << 20) -> Path:
    """A token file of the Python standard library's own source: real text every machine
    has, no download. Built once (sorted file order, so identical everywhere) and cached."""
    path = Path(path) if path else default_cache_dir() / f"stdlib-{max_bytes}.u8"
    if path.is_file() and path.stat().st_size > 0:
        return path
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if "test" in f.parts or "site-packages" in f.parts:
            continue
        try:
            data = f.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no Python sources found under {root} to build the demo corpus")
    return write_token_file(np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8), path)


class TokenDataset:
    """Random windows of `seq_len + 1` tokens from a token file (inputs and shifted labels)."""

    def __init__(self, path: str | Path, seq_len: int, seed: int = 0):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"token file {self.path} does not exist")
        self.tokens = np.memmap(self.path, dtype=np.uint8, mode="r")
        if len(self.tokens) < seq_len + 2:
            raise ValueError(
                f"token file {self.path} holds {len(self.tokens)} tokens, fewer than seq_len + 2 = "
                f"{seq_len + 2}; use a larger file or a shorter seq_len"
            )
        self.seq_len, self.seed = seq_len, seed

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        """Batch number `step`: int32 [batch_size, seq_len + 1]."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=batch_size)
        window = np.arange(self.seq_len + 1)
        return np.asarray(self.tokens[starts[:, None] + window[None, :]], dtype=np.int32)


def synthetic_dataset(path: str | Path, seq_len: int, n_tokens: int = 1 << 16, seed: int = 0) -> TokenDataset:
    """Random bytes in a token file: for tests that need data but not language."""
    tokens = np.random.default_rng(seed).integers(0, VOCAB_SIZE, n_tokens, dtype=np.uint8)
    return TokenDataset(write_token_file(tokens, path), seq_len, seed)
