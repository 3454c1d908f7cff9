"""Tokenizers a user already has: a SentencePiece model trained here on the bundled text and a
tiktoken BPE file written here, both read locally; text tokenised once into token files. A recipe
run from SentencePiece tokens is in tests/test_recipe_config.py."""

import base64
import collections
import re

import numpy as np
import pytest

from models.transformer import data as data_lib
from models.transformer.tokens import encode, load_tokenizer, tokenize_corpus

sentencepiece = pytest.importorskip("sentencepiece")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """~200 KB of the standard library's text (the recipe's bundled corpus)."""
    train, _ = data_lib.stdlib_corpus(max_bytes=1 << 20)
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_bytes(bytes(train[:200_000]))
    return path


@pytest.fixture(scope="module")
def sp_model(text):
    prefix = text.parent / "sp"
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(prefix), vocab_size=500,
                                             model_type="bpe", character_coverage=1.0, byte_fallback=True,
                                             remove_extra_whitespaces=False, normalization_rule_name="identity",
                                             allow_whitespace_only_pieces=True, minloglevel=2)
    return prefix.with_suffix(".model")


@pytest.fixture(scope="module")
def bpe_file(text):
    """A tiktoken BPE file: the 256 bytes, then the 100 commonest byte pairs inside words."""
    words = re.findall(rb"\w+| ?[^\w\s]+|\s+", text.read_bytes())
    pairs = collections.Counter(w[i:i + 2] for w in words for i in range(len(w) - 1))
    tokens = [bytes([b]) for b in range(256)] + [p for p, _ in pairs.most_common(100)]
    path = text.parent / "tiny.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    return path


def test_sentencepiece_and_tiktoken_files(sp_model, bpe_file, text, tmp_path, monkeypatch):
    sp = load_tokenizer(sp_model)
    assert (sp.kind, sp.vocab) == ("sentencepiece", 500)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    line = "def tokenize(self, text):  # a line of Python"
    assert processor.DecodeIds(sp.encode(line)) == line
    bpe = load_tokenizer(bpe_file)
    assert (bpe.kind, bpe.vocab) == ("tiktoken", 356)
    ids = bpe.encode(line)
    assert max(ids) >= 256 and len(ids) < len(line.encode())  # pairs were merged
    assert encode(bpe, line * 3) == bpe.encode(line * 3)

    raw = text.read_bytes()
    train, val, files = tokenize_corpus(raw[:150_000], raw[150_000:], sp, tmp_path, "corpus")
    assert [f.name.split(".", 1)[1] for f in files] == ["train.u16", "val.u16"]
    assert train.dtype == np.uint16 and int(train.max()) < 500 and len(train) < 150_000 * 0.6
    assert raw.decode().startswith(processor.DecodeIds(train[:50].tolist()).lstrip())
    # Tokenised once: the second call reads the files back without encoding anything.
    monkeypatch.setattr("models.transformer.tokens.encode", lambda *a: pytest.fail("tokenised again"))
    again, _, _ = tokenize_corpus(raw[:150_000], raw[150_000:], sp, tmp_path, "corpus")
    np.testing.assert_array_equal(again, train)


def test_bad_tokenizer_files(tmp_path, capsys):
    with pytest.raises(data_lib.DataError, match="does not exist"):
        load_tokenizer(tmp_path / "cl100k_base")
    (tmp_path / "junk.model").write_bytes(b"\x00not a model")
    with pytest.raises(data_lib.DataError, match="neither a SentencePiece model nor a tiktoken BPE file"):
        load_tokenizer(tmp_path / "junk.model")
    from models.transformer.train import main

    assert main(["--tokenizer", str(tmp_path / "junk.model"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --tokenizer:"), err
