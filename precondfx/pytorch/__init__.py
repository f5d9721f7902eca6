"""The PyTorch back end: capture, appliers, calibration, balancing, verification, folding."""
