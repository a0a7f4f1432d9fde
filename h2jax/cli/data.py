"""`h2jax data prepare --input FILES --tokenizer SPEC --out DIR`: tokenize text into a dataset."""

from __future__ import annotations

import argparse
import json
import time


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare tokenized datasets", description=__doc__)
    dsub = p.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser(
        "prepare", help="tokenize text / .jsonl files into token shards with a manifest",
        description="Tokenize text into token shards (uint16 when the vocabulary fits, else uint32) "
                    "and a manifest.json; documents are separated by the end-of-text token.",
    )
    prep.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_GLOB",
                      help="text files, .jsonl files (one document per line), directories or globs")
    prep.add_argument("--tokenizer", required=True, metavar="SPEC",
                      help="`bytes`, a Hugging Face tokenizer.json, or `train-bpe:VOCAB` "
                           "(a byte-level BPE trained on the input, offline)")
    prep.add_argument("--out", required=True, help="output directory (new or empty)")
    prep.add_argument("--val-fraction", type=float, default=0.01,
                      help="tail of the token stream kept for validation (default 0.01)")
    prep.add_argument("--text-field", default="text", help="the .jsonl field holding the text (default text)")
    prep.add_argument("--json", action="store_true", help="print the manifest as one JSON line")
    prep.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from h2jax.data.prepare import prepare

    t0 = time.perf_counter()
    m = prepare(args.input, args.tokenizer, args.out, val_fraction=args.val_fraction,
                text_field=args.text_field, progress=not args.json)
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps(m.to_dict()))
        return 0
    print(
        f"{args.out}: {m.documents:,} documents, {m.input_bytes:,} bytes -> {m.n_tokens:,} tokens "
        f"({m.dtype}, {m.input_bytes / max(m.n_tokens, 1):.2f} bytes/token), train {m.train_tokens:,} / "
        f"val {m.val_tokens:,}; tokenizer {m.tokenizer['spec']} (vocab {m.vocab_size:,}, "
        f"sha256 {m.tokenizer_sha256[:12]}); {m.input_bytes / 2**20 / seconds:.1f} MB/s"
    )
    return 0
