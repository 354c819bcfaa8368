"""The checksums verification compares (unicoll.checksums) and its settings (unicoll.verify):
what a checksum sees and what it does not, on numpy and torch, every kind of dtype."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from unicoll.checksums import block_checksums, row_magnitudes, row_values, weighted_blocks
from unicoll.verify import sampled, verify_setting

DTYPES = [np.float32, np.float64, np.float16, np.int8, np.int32, np.int64, np.uint8, np.bool_]


def _rows(dtype, shape=(6, 5), seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 50).astype(dtype)


def _sums(x, splits=(2, 4)) -> list[int]:
    result = block_checksums(x, list(splits))
    return [int(v) for v in (result.tolist() if hasattr(result, "tolist") else result)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_what_a_checksum_sees(dtype, library: str) -> None:
    def wrap(a):
        return torch.from_numpy(a) if library == "torch" else a

    x = _rows(dtype)
    before = _sums(wrap(x.copy()))
    assert before == _sums(wrap(x.copy()))  # the same bytes, the same sums

    flipped = x.copy()
    flipped.reshape(6, -1).view(np.uint8)[3, 1] ^= 0x01  # one bit of a row of block 1
    assert _sums(wrap(flipped))[1] != before[1] and _sums(wrap(flipped))[0] == before[0]

    swapped = x.copy()
    swapped[[2, 4]] = swapped[[4, 2]]  # two rows of block 1 change places
    if not np.array_equal(x[2], x[4]):
        assert _sums(wrap(swapped))[1] != before[1]

    zeros = x.copy()
    zeros[2:] = 0
    assert _sums(wrap(zeros))[1] != before[1] or not x[2:].any()

    other = x.copy()
    other[2:4] = x[0:2]  # another block's rows in the place of part of this one
    if not np.array_equal(x[2:4], x[0:2]):
        assert _sums(wrap(other))[1] != before[1]


def test_nan_payloads_are_seen() -> None:
    x = np.full((2, 3), np.nan, dtype=np.float32)
    y = x.copy()
    y.view(np.uint32)[1, 2] ^= 1  # another NaN, by its bits
    assert np.isnan(y).all()
    assert _sums(x, (1, 1)) != _sums(y, (1, 1))


def test_bfloat16_and_empty_blocks() -> None:
    x = torch.randn(5, 3).to(torch.bfloat16)
    assert _sums(x, (0, 2, 3, 0)) == _sums(x.clone(), (0, 2, 3, 0))
    assert _sums(x, (0, 2, 3, 0))[0] == 0 == _sums(x, (0, 2, 3, 0))[3]
    assert _sums(torch.zeros(0, 4), (0, 0)) == [0, 0]


def test_a_block_sums_the_same_wherever_it_sits() -> None:
    x = _rows(np.float32, (7, 3))
    alone = _sums(x[3:6], (3,))
    assert _sums(x, (3, 3, 1))[1] == alone[0]
    assert _sums(x[[6, 3, 4, 5, 0, 1, 2]], (1, 3, 3))[1] == alone[0]  # the rows in another order


def test_projections_are_linear() -> None:
    a, b = _rows(np.float64, (5, 4), 1), _rows(np.float64, (5, 4), 2)
    pa, pb, pab = (weighted_blocks(row_values(v), [2, 3]) for v in (a, b, a + b))
    assert np.allclose(pa + pb, pab, rtol=1e-12)
    ints = weighted_blocks(row_values(np.arange(6, dtype=np.int8).reshape(3, 2)), [3])
    assert ints.dtype == np.int64 and int(ints[0]) == 1 * 1 + 3 * 5 + 5 * 9


def test_the_setting() -> None:
    assert verify_setting(None) == 0.0
    assert verify_setting(True) == 1.0 and verify_setting(0.25) == 0.25
    with pytest.raises(ValueError, match=r"unicoll.init: verify: expected a share of calls from 0 to 1, got 2"):
        verify_setting(2)
    with pytest.raises(TypeError, match=r"unicoll.init: verify: expected True, False, None or a share"):
        verify_setting("often")


def test_the_setting_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, share in (("1", 1.0), ("0", 0.0), ("", 0.0), ("0.01", 0.01), ("true", 1.0)):
        monkeypatch.setenv("UNICOLL_VERIFY", raw)
        assert verify_setting(None) == share
    monkeypatch.setenv("UNICOLL_VERIFY", "sometimes")
    with pytest.raises(ValueError, match=r"\$UNICOLL_VERIFY: expected 0, 1 or the share of calls to verify"):
        verify_setting(None)


def test_the_sample_follows_the_call_number() -> None:
    assert [n for n in range(400) if sampled(n, 0.01)] == [0, 100, 200, 300]
    assert all(sampled(n, 1.0) for n in range(10))
    assert not any(sampled(n, 0.0) for n in range(10))
    assert [n for n in range(7) if sampled(n, 0.5)] == [0, 2, 4, 6]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.int64, np.bool_])
@pytest.mark.parametrize("shape", [(6, 5), (7,), (4, 40), (0, 3), (3, 0), (), (1024,), (1536, 2)])
def test_the_host_path_and_the_array_api_path_agree(dtype, shape, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the host the sums run in numpy over the same memory; elsewhere (a device) through
    the array API: the same values, for numpy and torch, every shape (no rows, empty rows, 0-d)."""
    from unicoll import checksums

    a = np.asarray((_rows(np.float64, shape, 3) // 8).astype(dtype))  # small integers: every sum is exact
    splits = [a.shape[0] // 2, a.shape[0] - a.shape[0] // 2] if a.ndim else [1]

    def computed(x) -> list:
        values = [checksums.row_values(x), checksums.weighted_blocks(checksums.row_values(x), splits)]
        if np.dtype(dtype).kind == "f":
            values.append(checksums.row_magnitudes(x))
        values.append(checksums.block_checksums(x, splits))
        values.append(checksums.block_checksums(x, [0, *splits, 0]))  # empty blocks: the running sums' path
        return [np.asarray(v).tolist() for v in values]

    host = [computed(x) for x in (a, torch.from_numpy(a.copy()))]
    monkeypatch.setattr(checksums, "host_numbers", lambda x: None)
    through_the_api = [computed(x) for x in (a, torch.from_numpy(a.copy()))]
    assert host[0] == host[1] == through_the_api[0] == through_the_api[1]


def test_magnitudes_bound_the_sums_of_magnitudes() -> None:
    x = _rows(np.float32, (5, 7), 4)
    bound = np.asarray(row_magnitudes(torch.from_numpy(x)))
    assert (bound >= np.abs(x).astype(np.float64).sum(axis=1)).all()
    assert np.array_equal(bound, 7 * np.abs(x).max(axis=1).astype(np.float64))
    bf16 = torch.from_numpy(x).to(torch.bfloat16)
    assert (np.asarray(row_magnitudes(bf16)) >= bf16.double().abs().sum(dim=1).numpy()).all()


def test_infinities_and_nans_raise_no_warning() -> None:
    x = np.array([[np.inf, -np.inf, 1.0], [np.nan, 2.0, 3.0]], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for a in (x, torch.from_numpy(x)):
            assert np.isnan(np.asarray(weighted_blocks(row_values(a), [2]))).all()
            weighted_blocks(row_magnitudes(a), [1, 1])
            block_checksums(a, [1, 1])


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_a_block_with_rows_more_or_fewer_differs(library: str) -> None:
    """Counts the ranks disagree on: rows of zeros left unwritten at a block's end, or its last
    row missing, change the block's checksum (every row counts, zeros too)."""
    x = _rows(np.float32, (3, 4))
    wrap = torch.from_numpy if library == "torch" else np.asarray
    sent = _sums(wrap(x), (3,))
    for more in (1, 2):
        assert _sums(wrap(np.concatenate([x, np.zeros((more, 4), np.float32)])), (3 + more,)) != sent
    assert _sums(wrap(x[:2].copy()), (2,)) != sent
    assert _sums(wrap(np.zeros((2, 4), np.float32)), (2,)) != [0]
