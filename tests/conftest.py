"""Test-session settings: one intra-op thread.

CI and development machines have 2 cores shared with other work; the per-sample loops of the
conditioning measurements ran 3-10x slower with 2 contending threads than with one."""
import torch

torch.set_num_threads(1)
