"""Text through a tokenizer the user already has, tokenised once into token files.

Two kinds of tokenizer file, both read locally (nothing is downloaded):

- a SentencePiece model (``*.model``, the ``sentencepiece`` package: Llama-2, T5, Gemma ship one);
- a tiktoken BPE file (lines ``<base64 token> <rank>``, as ``cl100k_base.tiktoken``), split
  with GPT-2's pre-tokenisation pattern. tiktoken's *named* encodings fetch their files from
  the network, so they are not accepted by name: give the file.

``tokenize_corpus`` writes the train and validation tokens as flat ``.u16``/``.u32`` files
named by a digest of the tokenizer and the text, and reuses them on the next run.
"""

from __future__ import annotations

import base64
import hashlib
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .data import DataError

_CHUNK = 1 << 20  # characters encoded per call: bounded memory on large corpora


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer.

    Attributes:
        path: the file it was read from.
        kind: ``"sentencepiece"`` or ``"tiktoken"``.
        vocab: number of token ids (every id is below it).
        digest: SHA-256 of the file (names the token files it produced).
        encode: text → list of token ids.
    """

    path: str
    kind: str
    vocab: int
    digest: str
    encode: Callable[[str], list[int]]


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A SentencePiece model or a tiktoken BPE file, by content.

    Raises:
        DataError: the file is missing, or is neither a SentencePiece model nor a BPE file.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {str(path)!r} does not exist; give a SentencePiece .model "
                        "or a tiktoken BPE file (named encodings are downloaded, so they are not accepted)")
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    ranks = _bpe_ranks(raw)
    if ranks is not None:
        import tiktoken
        from tiktoken_ext.openai_public import r50k_pat_str

        enc = tiktoken.Encoding(f"file:{path.name}", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                special_tokens={})
        return Tokenizer(str(path), "tiktoken", enc.n_vocab, digest, enc.encode_ordinary)
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(raw)
    except (RuntimeError, OSError) as e:
        raise DataError(f"tokenizer file {str(path)!r} is neither a SentencePiece model nor a tiktoken "
                        f"BPE file (<base64 token> <rank> per line): {str(e).splitlines()[0]}") from None
    return Tokenizer(str(path), "sentencepiece", sp.GetPieceSize(), digest, sp.EncodeAsIds)


def _bpe_ranks(raw: bytes) -> dict[bytes, int] | None:
    """The ``token → rank`` table of a tiktoken BPE file, or None if ``raw`` is not one.
    Parsed here rather than with ``tiktoken.load``, whose cache is keyed by the path alone (an
    edited file at the same path would be read stale)."""
    ranks = {}
    try:
        for line in raw.splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, base64.binascii.Error):
        return None
    return ranks or None


def tokenize_corpus(train_text: bytes, val_text: bytes, tokenizer: Tokenizer, directory: str | os.PathLike,
                    name: str) -> tuple[np.ndarray, np.ndarray, list[pathlib.Path]]:
    """Tokenises train and validation text once into ``directory`` and memory-maps the result.

    The files are ``<name>-<digest>.{train,val}.u16`` (``.u32`` for vocabularies above 65,536),
    the digest covering the tokenizer file and the text; a second call with the same inputs
    reads them back without tokenising.

    Returns:
        ``(train tokens, validation tokens, the two files)``.

    Raises:
        DataError: the text gives fewer than 64 tokens of either split.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256(tokenizer.digest.encode())
    for part in (train_text, val_text):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    suffix = ".u16" if tokenizer.vocab <= 1 << 16 else ".u32"
    dtype = np.uint16 if suffix == ".u16" else np.uint32
    stem = f"{name}-{h.hexdigest()[:16]}"
    out = []
    for split, text in (("train", train_text), ("val", val_text)):
        file = directory / f"{stem}.{split}{suffix}"
        if not file.exists():
            ids = np.asarray(encode(tokenizer, text.decode("utf-8", errors="replace")), dtype)
            tmp = file.with_suffix(file.suffix + ".tmp")
            ids.tofile(tmp)
            os.replace(tmp, file)  # a killed run never leaves a truncated token file behind
        out.append(file)
    tokens = [np.memmap(f, dtype=dtype, mode="r") if f.stat().st_size else np.zeros(0, dtype) for f in out]
    for split, t in zip(("train", "validation"), tokens):
        if len(t) < 64:
            raise DataError(f"the {split} text gives only {len(t)} tokens with {tokenizer.path}")
    return tokens[0], tokens[1], out


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text``, encoded in chunks cut at line ends."""
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + _CHUNK)
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        ids.extend(tokenizer.encode(text[start:end]))
        start = end
    return ids
