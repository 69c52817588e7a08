"""Packing: every token of the corpus in exactly one row, documents kept apart by segment
ids, positions restarting per document; the plan needs only the lengths."""

import re

import numpy as np
import pytest

import parallax as px
from parallax.data import Corpus, materialize, pack


def random_corpus(seed=0, documents=40, longest=30):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, longest, documents)  # empty documents and ones over a row
    return Corpus.from_documents(rng.integers(1, 1000, n) for n in lengths)


def pieces_of(rows):
    """Each row's documents as lists of tokens, read back from the segment ids."""
    found = []
    for tokens, segments, positions in zip(rows["tokens"], rows["segment_ids"],
                                           rows["positions"]):
        for segment in range(1, segments.max() + 1):
            where = segments == segment
            assert (positions[where] == np.arange(where.sum())).all()  # restart at 0
            assert np.flatnonzero(where).tolist() == list(range(np.argmax(where),
                                                                np.argmax(where) + where.sum()))
            found.append(tokens[where].tolist())
        assert (positions[segments == 0] == 0).all()
        tail = np.flatnonzero(segments == 0)  # padding comes only at the end
        assert not len(tail) or tail[0] + len(tail) == len(segments)
    return found


@pytest.mark.parametrize("method", ["whole", "split"])
@pytest.mark.parametrize("row_length", [2, 9, 17])
def test_every_token_is_in_exactly_one_row(method, row_length):
    corpus = random_corpus()
    order = np.random.default_rng(1).permutation(corpus.num_documents)
    plan = pack(corpus.lengths, row_length, order=order, method=method, bins=4)
    rows = materialize(plan, np.arange(plan.num_rows), corpus.tokens, corpus.offsets)
    assert rows["tokens"].shape == (plan.num_rows, row_length)
    # every document is its pieces in order: nothing lost, nothing repeated
    by_document = {}
    for d, begin, n in zip(plan.document, plan.begin, plan.length):
        by_document.setdefault(int(d), []).append((int(begin), int(n)))
    for d in range(corpus.num_documents):
        spans = sorted(by_document.get(d, []))
        assert sum(n for _, n in spans) == corpus.lengths[d]
        assert [b for b, _ in spans] == list(np.cumsum([0] + [n for _, n in spans])[:-1])
    pieces = pieces_of(rows)
    assert sorted(map(tuple, pieces)) == sorted(
        tuple(corpus.document(int(d))[b:b + n].tolist())
        for d, b, n in zip(plan.document, plan.begin, plan.length))
    assert sum(map(len, pieces)) == corpus.num_tokens == (rows["segment_ids"] > 0).sum()
    assert 0 < plan.fill <= 1


def test_whole_keeps_documents_whole_and_split_never_pads():
    corpus = random_corpus(documents=30, longest=8)
    whole = pack(corpus.lengths, 10)
    assert (whole.begin == 0).all()  # no document is longer than a row: none is cut
    split = pack(corpus.lengths, 10, method="split")
    assert split.num_rows == -(-corpus.num_tokens // 10)
    assert (split.length[:-1].sum()) <= corpus.num_tokens
    assert whole.num_rows >= split.num_rows


def test_a_row_of_documents_reads_as_the_documents():
    corpus = Corpus.from_documents([[7, 8, 9], [5, 6], [1, 2, 3, 4, 5, 6, 7]])
    rows = materialize(pack(corpus.lengths, 6), [0, 1, -1], corpus.tokens, corpus.offsets,
                       pad_id=3)
    # the long document's first row-sized piece is a row of its own; its last token fills
    # the first row
    assert rows["tokens"].tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 5, 6, 7], [3] * 6]
    assert rows["segment_ids"].tolist() == [[1] * 6, [1, 1, 1, 2, 2, 3], [0] * 6]
    assert rows["positions"].tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 0], [0] * 6]
    corpus = Corpus.from_documents([[7, 8, 9], [5, 6, 4, 2]])
    rows = materialize(pack(corpus.lengths, 6), [0, 1], corpus.tokens, corpus.offsets)
    assert rows["tokens"].tolist() == [[7, 8, 9, 0, 0, 0], [5, 6, 4, 2, 0, 0]]
    assert rows["segment_ids"].tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match=re.escape(
            "parallax.data.pack: method='greedy'; use one of ('whole', 'split')")):
        pack([3], 4, method="greedy")
    with pytest.raises(ValueError, match=r"row_length=1 must be an int >= 2 \(T \+ 1"):
        pack([3], 1)
    with pytest.raises(ValueError, match=r"order must be a permutation of the 2 documents"):
        pack([3, 4], 4, order=[0, 0])
    with pytest.raises(ValueError, match=r"bins=0 must be an int >= 1"):
        pack([3], 4, bins=0)


def test_corpus_split_save_and_load(tmp_path):
    corpus = random_corpus(documents=10)
    train, held_out = corpus.split(0.3, seed=2)
    assert (train.num_documents, held_out.num_documents) == (7, 3)
    assert train.num_tokens + held_out.num_tokens == corpus.num_tokens
    loaded = Corpus.load(corpus.save(tmp_path / "c"))
    assert loaded.fingerprint == corpus.fingerprint
    assert isinstance(loaded.tokens, np.memmap)
    np.testing.assert_array_equal(loaded.tokens, corpus.tokens)
    with pytest.raises(ValueError, match=r"held_out=1.0 leaves 10 of the 10 documents"):
        corpus.split(1.0)
    with pytest.raises(FileNotFoundError, match=r"parallax.data.Corpus.load: no corpus.json"):
        Corpus.load(tmp_path / "missing")
    assert px.data.Corpus is Corpus
