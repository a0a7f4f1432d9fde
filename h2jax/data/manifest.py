"""The manifest of a prepared dataset: what `h2jax data prepare` wrote and how to read it.

A prepared dataset is a directory of token shards (`tokens-00000.bin`, ...: little-endian
uint16 when the vocabulary fits, else uint32) that together hold one token stream, documents
separated by the tokenizer's end-of-text id, plus `manifest.json` (written last: a directory
without it is not a dataset) and, for a `tokenizers` tokenizer, `tokenizer.json`. The
validation split is the tail of the stream: tokens `[train_tokens, train_tokens + val_tokens)`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from h2jax.config import ConfigError

FORMAT = "h2jax-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class DataError(ConfigError):
    """A dataset input or file is wrong; the message names it and says how to fix it."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    tokenizer: dict[str, Any]  # spec, kind, file, sha256, vocab_size, eot_id
    dtype: str
    shards: tuple[dict[str, Any], ...]  # {"file", "tokens"} in stream order
    train_tokens: int
    val_tokens: int
    documents: int
    input_bytes: int
    val_fraction: float
    inputs: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    @property
    def tokenizer_sha256(self) -> str:
        return str(self.tokenizer["sha256"])

    @property
    def n_tokens(self) -> int:
        return self.train_tokens + self.val_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "tokenizer": dict(self.tokenizer),
            "dtype": self.dtype,
            "tokens": self.n_tokens,
            "documents": self.documents,
            "input_bytes": self.input_bytes,
            "val_fraction": self.val_fraction,
            "splits": {
                "train": {"start": 0, "tokens": self.train_tokens},
                "val": {"start": self.train_tokens, "tokens": self.val_tokens},
            },
            "shards": [dict(s) for s in self.shards],
            "inputs": list(self.inputs),
        }


def write_manifest(manifest: Manifest, directory: Path) -> Path:
    path = Path(directory) / MANIFEST
    tmp = path.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    tmp.replace(path)  # atomic: the dataset appears complete or not at all
    return path


def read_manifest(directory: str | Path) -> Manifest:
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise DataError(f"dataset {directory} does not exist; create it with `h2jax data prepare --out {directory}`")
    if not path.is_file():
        raise DataError(
            f"{directory} holds no {MANIFEST}: it is not a prepared dataset (or its preparation did "
            f"not finish); run `h2jax data prepare --out {directory}`"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: format {raw.get('format')!r} version {raw.get('format_version')!r}, but this "
            f"h2jax reads {FORMAT!r} version {FORMAT_VERSION}; prepare the dataset again"
        )
    splits = raw["splits"]
    manifest = Manifest(
        tokenizer=raw["tokenizer"], dtype=raw["dtype"], shards=tuple(raw["shards"]),
        train_tokens=int(splits["train"]["tokens"]), val_tokens=int(splits["val"]["tokens"]),
        documents=int(raw["documents"]), input_bytes=int(raw["input_bytes"]),
        val_fraction=float(raw["val_fraction"]), inputs=tuple(raw["inputs"]),
    )
    for shard in manifest.shards:
        f = directory / shard["file"]
        itemsize = 2 if manifest.dtype == "uint16" else 4
        if not f.is_file() or f.stat().st_size != shard["tokens"] * itemsize:
            raise DataError(f"shard {f} is missing or not {shard['tokens']} tokens long; prepare the dataset again")
    return manifest
