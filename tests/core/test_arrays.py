"""Calibration files: one reader for both command-line paths (precondfx.core.arrays)."""
from __future__ import annotations

import numpy as np
import pytest

from precondfx.core.arrays import positional_keys, read_npy, read_npz
from precondfx.errors import PrecondError


def test_positional_keys_sort_by_index_not_text():
    keys = [f"arr_{i}" for i in (10, 2, 0, 1)]
    assert positional_keys(keys) == ["arr_0", "arr_1", "arr_2", "arr_10"]
    assert positional_keys(["arr_0", "mask"]) is None and positional_keys([]) is None


def test_npz_round_trip_keeps_values_and_order(tmp_path):
    a, b = np.arange(6.0).reshape(2, 3), np.array([[1, 0, 1]], dtype=np.int64)
    np.savez(tmp_path / "c.npz", input_ids=b, pixel=a)
    z = read_npz(str(tmp_path / "c.npz"))
    assert list(z) == ["input_ids", "pixel"]
    assert np.array_equal(z["pixel"], a) and z["input_ids"].dtype == np.int64


def test_wrong_kind_of_file_says_which(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros(3))
    np.savez(tmp_path / "x.npz", np.zeros(3))
    (tmp_path / "t.npz").write_bytes(b"not a zip")
    with pytest.raises(PrecondError, match="not an .npz archive"):
        read_npz(str(tmp_path / "x.npy"))
    with pytest.raises(PrecondError, match="got an archive"):
        read_npy(str(tmp_path / "x.npz"))
    with pytest.raises(PrecondError, match="as .npz"):
        read_npz(str(tmp_path / "t.npz"))
    with pytest.raises(FileNotFoundError, match="not found"):
        read_npy(str(tmp_path / "missing.npy"))
