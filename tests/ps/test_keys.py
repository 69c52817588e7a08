import numpy as np
import pytest

from parallax.ps.keys import MAX_KEY, check_keys, server_key_ranges, slice_bounds, value_offsets


def test_ranges_follow_pslite_formula():
    ranges = server_key_ranges(3)
    width = MAX_KEY // 3
    assert [(r.begin, r.end) for r in ranges] == [
        (0, width), (width, 2 * width), (2 * width, 3 * width)]
    assert all(a.end == b.begin for a, b in zip(ranges, ranges[1:]))


def test_slicing_is_one_searchsorted_per_request():
    ranges = server_key_ranges(4, max_key=400)
    keys = np.array([0, 99, 100, 250, 399], np.uint64)
    assert slice_bounds("t", keys, ranges).tolist() == [0, 2, 3, 4, 5]
    assert slice_bounds("t", keys[:0], ranges).tolist() == [0, 0, 0, 0, 0]


def test_value_offsets_fixed_and_variable_lengths():
    keys = np.arange(3, dtype=np.uint64)
    assert value_offsets("t", keys, np.zeros(6), None).tolist() == [0, 2, 4, 6]
    assert value_offsets("t", keys, np.zeros(6), [1, 0, 5]).tolist() == [0, 1, 1, 6]


@pytest.mark.parametrize("keys, error, match", [
    ([3, 1], ValueError, r"sorted and unique .*keys\[0\] = 3 is followed by 1.*np.unique"),
    ([1, 1], ValueError, "sorted and unique"),
    ([-1, 2], ValueError, "non-negative"),
    ([0.5], TypeError, "integers"),
    ([[1, 2]], ValueError, r"1-D array, got shape \(1, 2\)"),
])
def test_bad_keys_are_named(keys, error, match):
    with pytest.raises(error, match=match):
        check_keys("KVWorker.push", keys)


def test_bad_values_and_lens_are_named():
    keys = np.arange(3, dtype=np.uint64)
    with pytest.raises(ValueError, match="7 values do not split evenly over 3 keys; pass lens="):
        value_offsets("KVWorker.push", keys, np.zeros(7), None)
    with pytest.raises(ValueError, match="lens add up to 4 values but 6 were given"):
        value_offsets("KVWorker.push", keys, np.zeros(6), [1, 1, 2])
    with pytest.raises(ValueError, match="one integer length per key: 3 keys"):
        value_offsets("KVWorker.push", keys, np.zeros(6), [3, 3])
    with pytest.raises(ValueError, match=r"key 400 is outside every server's range \[0, 400\)"):
        slice_bounds("KVWorker.push", np.array([1, 400], np.uint64), server_key_ranges(4, 400))
    with pytest.raises(ValueError, match="num_servers must be in"):
        server_key_ranges(0)
