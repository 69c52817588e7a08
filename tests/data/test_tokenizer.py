"""Tokenizers: a BPE trained here (no network), saved and read back as a checkpoint's
``tokenizer.json``; bytes; tokenizing a folder with a progress bar."""

import re

import numpy as np
import pytest

from parallax.data import ByteTokenizer, load_tokenizer, tokenize, tokenize_folder, train_bpe

TEXTS = ["the quick brown fox jumps over the lazy dog"] * 30 + ["a stitch in time"] * 30


def test_a_bpe_trained_here_round_trips_through_a_checkpoint_folder(tmp_path):
    tok = train_bpe(TEXTS, vocab_size=300)
    assert 257 < tok.vocab_size <= 300
    ids = tok.encode("the lazy fox")
    assert len(ids) < len("the lazy fox")  # merges learned
    assert tok.decode(ids) == "the lazy fox"
    path = tok.save(tmp_path / "checkpoint")
    assert path.name == "tokenizer.json"
    for where in (tmp_path / "checkpoint", path):  # the folder or the file
        loaded = load_tokenizer(where)
        assert (loaded.encode("the lazy fox") == ids).all()
        assert loaded.eos_id == tok.eos_id == tok.token_id("<|endoftext|>")
    assert load_tokenizer(path, eos_token=None, bos_token="<|endoftext|>").bos_id == 0
    batch = loaded.encode_batch(["the", "lazy dog"])
    assert [b.tolist() for b in batch] == [loaded.encode("the").tolist(),
                                           loaded.encode("lazy dog").tolist()]


@pytest.mark.slow  # imports transformers
def test_transformers_reads_the_saved_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = train_bpe(TEXTS, vocab_size=300)
    tok.save(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert theirs("the lazy fox")["input_ids"] == tok.encode("the lazy fox").tolist()
    assert theirs.eos_token_id == tok.eos_id


def test_bytes_and_tokenizing_a_folder_with_a_bar(tmp_path, capsys):
    tok = ByteTokenizer()
    assert tok.encode("hé").tolist() == [104, 195, 169] and tok.decode([104, 195, 169]) == "hé"
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("one\n\ntwo")
    (tmp_path / "sub" / "b.txt").write_text("three")
    corpus = tokenize_folder(tmp_path, tok, separator="\n\n", progress=True)
    assert [bytes(corpus.document(i).astype(np.uint8)).decode() for i in range(3)] == [
        "one", "two", "three"]
    err = capsys.readouterr().err
    assert "tokenizing" in err and "3/3" in err and "tokens=11" in err
    with_eos = tokenize(["ab"], train_bpe(TEXTS, vocab_size=280), append_eos=True,
                        progress=False)
    assert with_eos.document(0)[-1] == 0  # <|endoftext|>, the first special token


def test_bad_tokenizer_input_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"parallax.data.load_tokenizer: no tokenizer.json at {tmp_path / 'tokenizer.json'}."
            " Pass the file or the checkpoint folder holding it; offline, train one with")):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"vocab_size=100 must be an int >= 257"):
        train_bpe(TEXTS, vocab_size=100)
    with pytest.raises(ValueError, match=r"eos_token='</s>' is not among special_tokens"):
        train_bpe(TEXTS, vocab_size=300, eos_token="</s>")
    with pytest.raises(ValueError, match=r"append_eos=True, but ByteTokenizer\(vocab_size=256\) "
                                         r"has no end-of-text token"):
        tokenize(["a"], ByteTokenizer(), append_eos=True)
    with pytest.raises(FileNotFoundError, match=r"no files match '\*\*/\*.txt' under"):
        tokenize_folder(tmp_path / "none", ByteTokenizer())
