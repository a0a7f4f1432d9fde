"""Raw byte token files: the byte codec, the stdlib demo corpus, synthetic data for tests.

A raw token file is a flat uint8 file of bytes (vocab 256), read by `TokenDataset`. Datasets of
real text with a tokenizer are built by `h2jax.data.prepare` instead.
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


def synthetic_dataset(path: str | Path, seq_len: int, n_tokens: int = 1 << 16, seed: int = 0) -> "TokenDataset":
    """Random bytes in a token file: for tests that need data but not language."""
    from h2jax.data.loading import TokenDataset

    tokens = np.random.default_rng(seed).integers(0, VOCAB_SIZE, n_tokens, dtype=np.uint8)
    return TokenDataset(write_token_file(tokens, path), seq_len, seed)
