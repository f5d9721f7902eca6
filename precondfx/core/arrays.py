"""Calibration arrays read from files (.npy, .npz): one reader, one wording of its errors,
for the PyTorch and ONNX command-line paths alike; nothing is unpickled."""
from __future__ import annotations

import os

import numpy as np

from precondfx.errors import PrecondError


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split()) or type(e).__name__}"


def _load(path: str, kind: str):
    """``np.load`` without pickles; a missing or unreadable file says which and why."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"calibration file not found: {path}")
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise PrecondError(f"cannot read calibration file {path} ({_why(e)})") from None
    if not head.startswith((b"\x93NUMPY", b"PK")):
        # np.load would take any other file for a pickle and suggest allow_pickle=True
        raise PrecondError(f"cannot read calibration file {path} as {kind}: it is not NumPy "
                           f"data (it starts with {head[:6]!r}, not .npy's or .npz's header); "
                           f"save the batch with np.save (one array) or np.savez (one array "
                           f"per input)")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as e:
        raise PrecondError(f"cannot read calibration file {path} as {kind} ({_why(e)})") from None


def read_npy(path: str) -> np.ndarray:
    """The one array a .npy file holds (an archive is refused: it needs an .npz reader)."""
    arr = _load(path, ".npy")
    if not isinstance(arr, np.ndarray):
        raise PrecondError(f"{path}: expected one array (.npy), got an archive; pass it as an "
                           f".npz calibration file (--calib FILE.npz)")
    return arr


def read_npz(path: str, hint: str = "") -> dict[str, np.ndarray]:
    """Every array of an .npz archive, by key, in the archive's order; an archive holding
    nothing is refused (``hint`` says what it should hold)."""
    z = _load(path, ".npz")
    if isinstance(z, np.ndarray):
        raise PrecondError(f"{path}: holds one array (.npy data), not an .npz archive; "
                           f"save the inputs with np.savez")
    with z:
        try:
            out = {k: np.array(z[k]) for k in z.keys()}
        except Exception as e:
            raise PrecondError(f"cannot read calibration file {path} as .npz "
                               f"({_why(e)})") from None
    if not out:
        raise PrecondError(f"{path}: the archive holds no arrays" + (f"; {hint}" if hint else ""))
    return out


def positional_keys(keys: list[str]) -> list[str] | None:
    """``arr_0, arr_1...`` in index order when every key is one (np.savez's positional
    names), else None."""
    if keys and all(k.startswith("arr_") and k[4:].isdigit() for k in keys):
        return sorted(keys, key=lambda k: int(k[4:]))
    return None
