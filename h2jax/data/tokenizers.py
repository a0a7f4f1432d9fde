"""Tokenizers for `h2jax data prepare`: bytes, a Hugging Face `tokenizer.json`, or a byte-level
BPE trained offline on the input itself.

A tokenizer here is what a dataset needs from one: its vocabulary size, its end-of-text id
(documents are separated by it), batch encoding to numpy ids, decoding, and a stable
serialized form whose SHA-256 names it in the dataset manifest and in checkpoints (two
datasets, or a dataset and a checkpoint, use the same tokenizer exactly when the hashes match).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from h2jax.data.manifest import DataError

EOT_TEXT = "<|endoftext|>"
# Special tokens that other tokenizer.json files use to end a document, in order of preference.
EOT_CANDIDATES = (EOT_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
BYTES_EOT = 0  # NUL: text files do not contain it, so it can end a document in byte vocab 256
BPE_SPEC = re.compile(r"^train-bpe:(\d+)$")
MIN_BPE_VOCAB = 256 + 1  # every byte (so any text encodes) plus the end-of-text token
_CUT = re.compile(r"(?<=\S)\n(?=\S)")


class ByteTokenizer:
    """UTF-8 bytes (vocabulary 256, the `tiny`/`small` models' size); byte 0 ends a document."""

    kind = "bytes"
    vocab_size = 256
    eot_id = BYTES_EOT

    def __init__(self):
        self.spec = "bytes"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        out = []
        for text in texts:
            ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            if (ids == BYTES_EOT).any():
                raise DataError(
                    "a document contains a NUL byte, which the bytes tokenizer uses as end-of-text; "
                    "strip NUL bytes from the input or use --tokenizer train-bpe:VOCAB"
                )
            out.append(ids)
        return out

    def decode(self, ids) -> str:
        return np.asarray(ids, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")

    def serialized(self) -> bytes:
        return b"h2jax bytes tokenizer v1: utf-8 bytes, vocab 256, end-of-text byte 0"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.serialized()).hexdigest()

    def save(self, directory: Path) -> str | None:
        return None  # nothing to store: the spec is the tokenizer


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (loaded from tokenizer.json, or trained here)."""

    def __init__(self, tok, spec: str, kind: str):
        self.tok, self.spec, self.kind = tok, spec, kind
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        vocab = tok.get_vocab(with_added_tokens=True)
        eot = next((t for t in EOT_CANDIDATES if t in vocab), None)
        if eot is None:
            raise DataError(
                f"tokenizer {spec} has no end-of-text token (looked for {', '.join(EOT_CANDIDATES)}); "
                f"add one as a special token, e.g. tokenizer.add_special_tokens([{EOT_TEXT!r}])"
            )
        self.eot_text, self.eot_id = eot, vocab[eot]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets: ~20 % less time.
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        encs = encode(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def serialized(self) -> bytes:
        return self.tok.to_str().encode("utf-8")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.serialized()).hexdigest()

    def save(self, directory: Path) -> str | None:
        (Path(directory) / "tokenizer.json").write_bytes(self.serialized())
        return "tokenizer.json"


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None) -> HFTokenizer:
    """A byte-level BPE (GPT-2 style: every byte in the alphabet, no unknown token) trained on
    `texts`, with `<|endoftext|>` as id 0. Offline: nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise DataError(
            f"train-bpe:{vocab_size}: the vocabulary must hold every byte and the end-of-text token; "
            f"use train-bpe:{MIN_BPE_VOCAB} or more"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer, length=length)
    return HFTokenizer(tok, f"train-bpe:{vocab_size}", "bpe")


def tokenizer_from_file(path: str | Path) -> HFTokenizer:
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist; give a tokenizer.json, `bytes` or `train-bpe:VOCAB`")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception on a malformed file
        raise DataError(f"tokenizer file {path} is not a Hugging Face tokenizer.json: {e}") from None
    return HFTokenizer(tok, str(path), "huggingface")


def make_tokenizer(spec: str, training_texts=None):
    """`bytes`, `train-bpe:VOCAB` (trained on `training_texts()`, an iterator factory), or a
    tokenizer.json path."""
    if spec == "bytes":
        return ByteTokenizer()
    m = BPE_SPEC.match(spec)
    if m:
        if training_texts is None:
            raise DataError(f"{spec} trains on the input; give the input documents")
        return train_bpe(training_texts(), int(m.group(1)))
    if spec.startswith("train-bpe"):
        raise DataError(f"--tokenizer {spec!r}: write train-bpe:VOCAB with an integer VOCAB, e.g. train-bpe:4096")
    return tokenizer_from_file(spec)


def load_saved_tokenizer(directory: Path, info: dict):
    """The tokenizer a prepared dataset was made with (from its manifest entry)."""
    if info["kind"] == "bytes":
        return ByteTokenizer()
    tok = tokenizer_from_file(Path(directory) / info["file"])
    if tok.sha256 != info["sha256"]:
        raise DataError(
            f"{directory}/{info['file']} does not match the manifest's tokenizer hash; "
            "the dataset was modified after `h2jax data prepare`: prepare it again"
        )
    return tok


def split_for_encoding(text: str, max_chars: int = 1 << 20) -> Iterator[str]:
    """Cut a long document into pieces of about `max_chars` after a newline between two
    non-space characters: byte-level (GPT-2) pre-tokenization makes that newline a piece of its
    own, so the pieces encode to the same ids as the whole (and encode in parallel)."""
    start = 0
    while len(text) - start > max_chars:
        m = _CUT.search(text, start + max_chars)
        if m is None:
            break
        yield text[start:m.end()]
        start = m.end()
    yield text[start:]
