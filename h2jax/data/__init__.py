"""Data: tokenizers, dataset preparation (`h2jax data prepare`), deterministic loading.

- `tokenizers`: bytes, a Hugging Face tokenizer.json, or a byte-level BPE trained on the input.
- `prepare`: text / .jsonl files -> token shards and a manifest.
- `manifest`: the prepared dataset's manifest format.
- `loading`: batches by (seed, step) from a prepared dataset or a raw byte token file.
- `corpus`: raw byte token files, the stdlib demo corpus, synthetic data for tests.
"""

from h2jax.data.corpus import (VOCAB_SIZE, decode, default_cache_dir, encode, stdlib_corpus,
                               synthetic_dataset, write_token_file)
from h2jax.data.loading import PreparedDataset, TokenDataset, check_compatible, open_dataset
from h2jax.data.manifest import DataError, Manifest, read_manifest
from h2jax.data.prepare import prepare

__all__ = [
    "VOCAB_SIZE", "DataError", "Manifest", "PreparedDataset", "TokenDataset", "check_compatible",
    "decode", "default_cache_dir", "encode", "open_dataset", "prepare", "read_manifest",
    "stdlib_corpus", "synthetic_dataset", "write_token_file",
]
