"""PackedBatches: a batch is a function of its index; the iterator's state, saved with
``px.checkpoint``, resumes the stream exactly; one pass reads every token once."""

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.data import Corpus, PackedBatches

from .test_packing import random_corpus


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y) == ["positions", "segment_ids", "tokens"]
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_the_stream_is_the_same_whatever_the_threads_and_goes_on_past_a_pass():
    corpus = random_corpus(documents=12)
    plain = PackedBatches(corpus, seq_len=15, global_batch=4, seed=3, threads=0)
    threaded = PackedBatches(corpus, seq_len=15, global_batch=4, seed=3, threads=2,
                             prefetch=3)
    rows_per_pass = plain.plan(0).num_rows
    n = 2 * rows_per_pass // 4 + 2  # into the third pass
    first = take(iter(plain), n)
    assert_same(first, take(iter(threaded), n))
    it = iter(plain)
    take(it, n)
    assert it.epoch >= 2
    assert plain.plan(0).document.tolist() != plain.plan(1).document.tolist()  # reshuffled
    other = take(iter(PackedBatches(corpus, seq_len=15, global_batch=4, seed=4, threads=0)), 1)
    assert not np.array_equal(other[0]["tokens"], first[0]["tokens"])


def test_one_pass_reads_every_token_once_and_pads_the_last_batch():
    corpus = random_corpus(documents=15)
    batches = PackedBatches(corpus, seq_len=11, global_batch=3, epochs=1, threads=0)
    seen = list(batches)
    assert len(seen) == len(batches) == -(-batches.plan(0).num_rows // 3)
    tokens = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in seen])
    np.testing.assert_array_equal(np.sort(tokens), np.sort(corpus.tokens))
    assert all(b["tokens"].shape == (3, 12) for b in seen)


def test_the_state_saved_in_a_checkpoint_resumes_exactly(tmp_path):
    corpus = random_corpus(documents=20)
    mesh, strategy = px.make_mesh(data=4, fsdp=2), px.FSDP("fsdp")
    make = lambda: PackedBatches(corpus, seq_len=7, global_batch=8, mesh=mesh,  # noqa: E731
                                 strategy=strategy, seed=5)
    straight = take(iter(make()), 12)
    it = iter(make())
    take(it, 5)
    state = px.init(lambda: px.TrainState.create(px.models.MLP(2, [2], 2, rngs=nnx.Rngs(0)),
                                                 optax.sgd(0.1)), mesh, strategy)
    px.checkpoint.save(tmp_path, state, step=5, extra={"data": it.get_state()})
    restored = px.checkpoint.restore(tmp_path, like=state, mesh=mesh, strategy=strategy)
    resumed = iter(make())  # a new loader, as after a restart
    resumed.set_state(restored.extra["data"])
    assert restored.extra["data"]["next_batch"] == 5
    assert_same(take(resumed, 7), straight[5:])


def test_a_state_from_other_data_or_settings_is_refused():
    corpus = random_corpus(documents=6)
    state = iter(PackedBatches(corpus, seq_len=7, global_batch=2)).get_state()
    other = PackedBatches(Corpus.from_documents([[1, 2, 3]] * 6), seq_len=9, global_batch=2)
    with pytest.raises(ValueError, match=re.escape(
            "parallax.data.PackedBatches: the saved data state does not match this loader "
            f"(corpus: saved {corpus.fingerprint!r}, here {other.corpus.fingerprint!r}; "
            "seq_len: saved 7, here 9); resume with the same corpus and settings")):
        iter(other).set_state(state)
    with pytest.raises(ValueError, match=r"set_state takes what get_state returned"):
        iter(other).set_state({"batch": 3})


def test_bad_loader_settings_are_refused():
    corpus = random_corpus(documents=6)
    with pytest.raises(ValueError, match=r"PackedBatches: seq_len=0 must be an int >= 1"):
        PackedBatches(corpus, seq_len=0, global_batch=2)
    with pytest.raises(TypeError, match=r"corpus must be a parallax.data.Corpus"):
        PackedBatches([[1, 2]], seq_len=4, global_batch=2)
    with pytest.raises(ValueError, match=r"a global batch of 6 rows does not split over the 8 "
                                         r"batch shards"):
        PackedBatches(corpus, seq_len=4, global_batch=6, mesh=px.make_mesh(data=8),
                      strategy=px.DataParallel("data"))
    with pytest.raises(TypeError, match=r"endless \(epochs=None\) has no length"):
        len(PackedBatches(corpus, seq_len=4, global_batch=2))
    assert jax.process_count() == 1
