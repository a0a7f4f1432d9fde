"""`h2jax data prepare`: text files -> token shards + manifest.

Inputs are files, directories (every text file below, sorted; hidden files, `__pycache__`
and binary files are skipped) or globs. A `.jsonl` file
holds one document per line (its `text` field); any other file is one UTF-8 document. Every
document is followed by the tokenizer's end-of-text id, so the shards decode back to the
input documents exactly.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from h2jax.data.manifest import DataError, Manifest, write_manifest
from h2jax.data.tokenizers import make_tokenizer, split_for_encoding

SHARD_TOKENS = 1 << 28  # 256 Mi tokens: 512 MiB of uint16 per shard
ENCODE_BATCH_CHARS = 4 << 20  # text handed to the tokenizer per call (it encodes a batch in parallel)
PROGRESS_MIN_BYTES = 4 << 20  # smaller inputs finish before a bar would help


def expand_inputs(specs: Sequence[str]) -> list[Path]:
    """Files named by `specs` (files, directories, globs), sorted within each spec, no repeats."""
    if not specs:
        raise DataError("--input is empty; name text files, .jsonl files, directories or globs")
    files: list[Path] = []
    for spec in specs:
        p = Path(spec)
        if p.is_dir():
            found = [f for f in sorted(p.rglob("*")) if f.is_file() and not _skipped(f.relative_to(p), f)]
        elif p.is_file():
            found = [p]
        else:
            found = [Path(f) for f in sorted(glob.glob(spec, recursive=True)) if Path(f).is_file()]
        if not found:
            raise DataError(f"--input {spec}: no such file, directory or glob match; check the path")
        files.extend(found)
    seen: set[Path] = set()
    return [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]


def _skipped(relative: Path, f: Path) -> bool:
    """Inside a directory: hidden files and folders, `__pycache__`, and binary files (a NUL
    byte in the first 8 KiB) are not text to train on. A file named explicitly is never skipped."""
    if any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
        return True
    with open(f, "rb") as fh:
        return b"\0" in fh.read(8192)


def iter_documents(files: Iterable[Path], text_field: str = "text") -> Iterator[tuple[str, int]]:
    """(document text, input bytes it came from) for every document of every file, in order."""
    for f in files:
        if f.suffix == ".jsonl":
            with open(f, "rb") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{f}:{lineno} is not a JSON object: {e}") from None
                    if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                        raise DataError(
                            f"{f}:{lineno} has no string field {text_field!r}; give each line "
                            f"{{\"{text_field}\": \"...\"}} or choose the field with --text-field"
                        )
                    yield obj[text_field], len(line)
        else:
            raw = f.read_bytes()
            try:
                yield raw.decode("utf-8"), len(raw)
            except UnicodeDecodeError as e:
                raise DataError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start}); convert or leave it out") from None


class _ShardWriter:
    """Appends token arrays to `tokens-NNNNN.bin` files of at most `shard_tokens` tokens."""

    def __init__(self, directory: Path, dtype, shard_tokens: int):
        self.directory, self.dtype, self.shard_tokens = directory, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self.fh = None

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self.fh is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._next_shard()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            part.tofile(self.fh)
            self.shards[-1]["tokens"] += len(part)

    def _next_shard(self) -> None:
        if self.fh is not None:
            self.fh.close()
        name = f"tokens-{len(self.shards):05d}.bin"
        self.fh = open(self.directory / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> list[dict]:
        if self.fh is not None:
            self.fh.close()
        return self.shards


@contextlib.contextmanager
def _progress(total_bytes: int, enabled: bool):
    if not enabled or total_bytes < PROGRESS_MIN_BYTES:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    progress = Progress(TextColumn("[bold]tokenize"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=Console(stderr=True))
    task = progress.add_task("tokenize", total=total_bytes)
    with progress:
        yield lambda n: progress.advance(task, n)


def prepare(
    inputs: Sequence[str], tokenizer: str, out: str | Path, *, val_fraction: float = 0.01,
    text_field: str = "text", shard_tokens: int = SHARD_TOKENS, progress: bool = False,
) -> Manifest:
    """Tokenize `inputs` with `tokenizer` (`bytes`, `train-bpe:VOCAB` or a tokenizer.json) into
    shards under `out`; returns the manifest it wrote."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} exists and is not an empty directory; choose a new one or remove it")
    files = expand_inputs(inputs)
    total_bytes = sum(f.stat().st_size for f in files)
    if total_bytes == 0:
        raise DataError(f"the input ({len(files)} file(s)) is empty: there is no text to tokenize")
    tok = make_tokenizer(tokenizer, lambda: (text for text, _ in iter_documents(files, text_field)))
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    out.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out, dtype, shard_tokens)
    eot = np.array([tok.eot_id], dtype=dtype)
    n_docs, n_chars = 0, 0
    pieces: list[str] = []
    ends: list[bool] = []  # whether each piece ends its document

    def flush() -> None:
        for ids, end in zip(tok.encode_batch(pieces), ends):
            writer.write(ids)
            if end:
                writer.write(eot)
        pieces.clear()
        ends.clear()

    with _progress(total_bytes, progress) as advance:
        batch_chars = 0
        for text, nbytes in iter_documents(files, text_field):
            parts = list(split_for_encoding(text))
            pieces.extend(parts)
            ends.extend([False] * (len(parts) - 1) + [True])
            n_docs += 1
            n_chars += len(text)
            batch_chars += len(text)
            if batch_chars >= ENCODE_BATCH_CHARS:
                flush()
                batch_chars = 0
            advance(nbytes)
        flush()
    shards = writer.close()
    if n_chars == 0:
        raise DataError(f"the input ({len(files)} file(s), {n_docs} document(s)) holds no text; "
                        "give non-empty documents")
    n_tokens = sum(s["tokens"] for s in shards)
    val_tokens = int(round(val_fraction * n_tokens))
    if val_fraction > 0 and val_tokens < 2:
        raise DataError(
            f"--val-fraction {val_fraction} of {n_tokens} tokens leaves {val_tokens} validation "
            "token(s); give more text or a larger fraction (or 0 for no validation split)"
        )
    info = {"spec": tok.spec, "kind": tok.kind, "file": tok.save(out), "sha256": tok.sha256,
            "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}
    manifest = Manifest(
        tokenizer=info, dtype=np.dtype(dtype).name, shards=tuple(shards),
        train_tokens=n_tokens - val_tokens, val_tokens=val_tokens, documents=n_docs,
        input_bytes=total_bytes, val_fraction=val_fraction,
        inputs=tuple(os.path.relpath(f) if not f.is_absolute() else str(f) for f in files),
    )
    write_manifest(manifest, out)
    return manifest
