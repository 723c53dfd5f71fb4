"""zeroshard._core.SameBytes: the same-bytes pass benchmarks compare optimizer steps against.

It must really move the streams it is given: every write stream ends up holding the xor of the
read streams of its element width, in-place streams included, and bad streams are refused."""
import numpy as np
import pytest

from zeroshard import _core


def test_writes_hold_the_xor_of_the_reads_of_their_width():
    n = 3 * 65536 + 10  # several chunks and a ragged end
    rng = np.random.default_rng(7)
    a = rng.integers(0, 2**32, n, dtype=np.uint32)
    b = rng.integers(0, 2**32, n, dtype=np.uint32)
    inplace = b.copy()
    g16 = rng.integers(0, 2**16, n, dtype=np.uint16)
    out16 = np.zeros(n, dtype=np.uint16)
    out32 = np.zeros(n, dtype=np.uint32)
    k = _core.SameBytes(2)
    assert k.threads == 2 and k.isa in ("scalar", "avx2", "avx512")
    seconds = k.run([a, inplace, g16], [inplace, out32, out16])
    assert seconds > 0
    np.testing.assert_array_equal(out32, a ^ b)
    np.testing.assert_array_equal(inplace, a ^ b)
    np.testing.assert_array_equal(out16, g16)  # n is even: every 16-bit element moves


def test_bad_streams_are_refused():
    a = np.zeros(8, dtype=np.float32)
    with pytest.raises(_core.InvalidArgumentError, match="elements"):
        _core.same_bytes([a], [np.zeros(9, dtype=np.float32)], 1)
    with pytest.raises(_core.InvalidArgumentError, match="at most 8"):
        _core.same_bytes([a] * 9, [np.zeros(8, dtype=np.float32)], 1)
    with pytest.raises(_core.InvalidArgumentError, match="no streams"):
        _core.same_bytes([], [], 1)
    # A bf16 gradient read with no bf16 stream written would be optimised away, not timed.
    with pytest.raises(_core.InvalidArgumentError, match="no write stream of that width"):
        _core.same_bytes([a, np.zeros(8, dtype=np.uint16)], [a], 1)
    with pytest.raises(_core.InvalidArgumentError, match="elements"):
        _core.same_bytes([np.zeros(8, dtype=np.uint8)], [np.zeros(8, dtype=np.uint8)], 1)
