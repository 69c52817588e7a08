"""Auto-sharding policies: which elements each of W simulated workers gets, as in TensorFlow."""

import numpy as np
import pytest

import parallax as px
from parallax.tf.input import auto_shard, workers
from parallax.tf.input.distributed import global_batch_rows

API = "api"


def rows_of(element, index):
    return global_batch_rows(API, element, index)


def files_dataset(files, per_file):
    return px.tf.Dataset.from_files(
        files, lambda f: [np.array([f"{f}{i}"]) for i in range(per_file)])


def worker_steps(dataset, num_workers, worker, replicas_per_worker):
    """FILE/OFF/HINT: a worker's mini-batches, grouped R per step (labels as strings)."""
    elements = dataset.elements_for_worker(API, num_workers, worker)
    stream = [mb[:, 0].tolist() for mb in workers.worker_minibatches(
        elements, rows_of, dataset.batch_size, num_workers, replicas_per_worker, worker)]
    return [stream[i:i + replicas_per_worker] for i in range(0, len(stream), replicas_per_worker)]


def test_file_policy_matches_tensorflows_batch_sizes_for_worker_example():
    # TF's docstring: G = 7, 2 workers x 2 replicas, files a and b of 7 elements each.
    dataset = files_dataset(["a", "b"], 7).batch(7).with_options(
        px.tf.DatasetOptions(px.tf.AutoShardPolicy.FILE))
    assert worker_steps(dataset, 2, 0, 2) == [[["a0", "a1"], ["a2", "a3"]],
                                              [["a4", "a5"], ["a6"]]]
    assert worker_steps(dataset, 2, 1, 2) == [[["b0", "b1"], ["b2"]],
                                              [["b3", "b4"], ["b5", "b6"]]]


def test_auto_is_file_for_files_and_data_otherwise():
    by_files = files_dataset(["a", "b", "c"], 1)
    assert by_files.policy is px.tf.AutoShardPolicy.FILE
    assert [e.tolist() for e in by_files.elements_for_worker(API, 2, 1)] == [["b0"]]
    assert px.tf.Dataset.from_iterable([1, 2]).policy is px.tf.AutoShardPolicy.DATA
    assert [e.tolist() for e in by_files.elements_for_worker(API, 1, 0)] == [["a0"], ["b0"],
                                                                           ["c0"]]


def test_file_policy_reads_files_k_k_plus_w():
    dataset = files_dataset([f"f{i}" for i in range(5)], 1)
    got = [[e[0] for e in dataset.elements_for_worker(API, 3, k)] for k in range(3)]
    assert got == [["f00", "f30"], ["f10", "f40"], ["f20"]]


def test_data_policy_shards_the_rebatched_minibatches():
    # Every worker reads every global batch; TF's legacy rebatch cuts each into N = W * R
    # mini-batches and worker k keeps those with i % W == k: replica (k, r) <- k + r * W.
    num_workers, per_worker = 2, 3
    n = num_workers * per_worker
    stream = []  # TF, written out: legacy rebatch of each global batch, then shard
    for rows in (12, 12, 5):
        batch = np.arange(rows)
        sizes = auto_shard.legacy_rebatch_sizes(rows, n)
        starts = np.cumsum((0,) + sizes)
        stream += [batch[starts[i]:starts[i + 1]].tolist() for i in range(n)]
    for k in range(num_workers):
        tf_worker = [mb for i, mb in enumerate(stream) if i % num_workers == k]
        order = auto_shard.data_shard_minibatches(num_workers, per_worker)
        mine = order[k * per_worker:(k + 1) * per_worker]
        for step, rows in enumerate((12, 12, 5)):
            sizes = auto_shard.legacy_rebatch_sizes(rows, n)
            starts = np.cumsum((0,) + sizes)
            got = [np.arange(rows)[starts[m]:starts[m + 1]].tolist() for m in mine]
            assert got == tf_worker[step * per_worker:(step + 1) * per_worker]
    assert auto_shard.legacy_rebatch_sizes(5, 6) == (1, 1, 1, 1, 1, 0)


def test_off_gives_every_worker_everything_and_hint_replaces_the_placeholder():
    elements = [np.array([i]) for i in range(6)]
    off = px.tf.Dataset.from_iterable(elements).with_options(
        px.tf.DatasetOptions(px.tf.AutoShardPolicy.OFF))
    for k in range(3):
        assert [int(e[0]) for e in off.elements_for_worker(API, 3, k)] == list(range(6))
    hint = px.tf.Dataset.from_iterable(elements).shard(px.tf.SHARD_HINT, px.tf.SHARD_HINT)
    hint = hint.with_options(px.tf.DatasetOptions("hint"))
    assert [int(e[0]) for e in hint.elements_for_worker(API, 3, 1)] == [1, 4]
    assert [int(e[0]) for e in hint] == list(range(6))  # one worker: shard(1, 0)


def test_partial_last_batch_is_rebatched_in_turn():
    assert auto_shard.rebatch(5, (2, 2, 2, 2)) == [2, 2, 1]
    assert auto_shard.worker_batch_sizes(12, 2, 4, 1) == (2, 2, 2, 2, 1, 1, 1, 1)[4:] + (
        2, 2, 2, 2)


def test_bad_sharding_is_refused_with_tensorflows_advice():
    few = files_dataset(["only"], 3).with_options(px.tf.DatasetOptions("file"))
    with pytest.raises(ValueError, match=r"api: could not apply FILE based sharding: the "
                       r"dataset only has 1 file\(s\), which is not enough for the required 2 "
                       r"shards/workers\. Set the auto-sharding policy to DATA or OFF"):
        list(few.elements_for_worker(API, 2, 0))
    placeholder = px.tf.Dataset.from_iterable([1]).shard(px.tf.SHARD_HINT, px.tf.SHARD_HINT)
    with pytest.raises(ValueError, match=r"shard\(SHARD_HINT, SHARD_HINT\) but its auto-shard "
                       r"policy is DATA; the placeholder is only replaced under "
                       r"px.tf.AutoShardPolicy.HINT"):
        list(placeholder.elements_for_worker(API, 2, 0))
    with pytest.raises(ValueError, match=r"auto_shard_policy='rows' must be one of \['OFF', "
                       r"'AUTO', 'FILE', 'DATA', 'HINT'\]"):
        px.tf.DatasetOptions("rows")
    with pytest.raises(ValueError, match=r"num_shards=2, index=2 must be ints with 0 <= index"):
        px.tf.Dataset.from_iterable([1]).shard(2, 2)
    with pytest.raises(TypeError, match=r"elements must be re-iterable"):
        px.tf.Dataset.from_iterable(iter([1]))


def test_a_sharded_dataset_on_one_worker_is_split_as_a_plain_iterable():
    strategy = px.tf.MirroredStrategy()
    examples = [np.float32(i) for i in range(20)]
    dataset = px.tf.Dataset.from_files([examples[:10], examples[10:]], list).batch(16)
    plain = [np.asarray(examples[:16]), np.asarray(examples[16:])]
    for got, want in zip(strategy.experimental_distribute_dataset(dataset),
                         strategy.experimental_distribute_dataset(plain), strict=True):
        assert got.rows == want.rows
        for a, b in zip(got.values, want.values):
            np.testing.assert_array_equal(a, b)
