"""Test-session settings: one intra-op thread; the objects alive once collection is done are
exempt from the garbage collector's full passes.

CI and development machines have 2 cores shared with other work; the per-sample loops of the
conditioning measurements ran 3-10x slower with 2 contending threads than with one.

After collection every test module is imported (torch, transformers, onnx, their module-level
models and tables): millions of objects that live until the interpreter exits.  Each full
(generation-2) collection walked all of them: the 40 full collections of tests/integrations,
tests/onnx and tests/batteries/test_core_zoo.py took 12.1 s of a 97.8 s run (6.6 s with them
frozen, 90.6 s in all, back to back on an otherwise quiet machine).  ``gc.freeze()`` moves them
to the permanent generation (after a ``gc.collect()``, so no garbage is frozen): collections
still run as before on everything the tests create, the frozen objects are only not walked
again."""
import gc

import pytest
import torch
import torch.utils.checkpoint

torch.set_num_threads(1)


def pytest_collection_finish(session) -> None:
    gc.collect()
    gc.freeze()


def _process_switches() -> tuple:
    """Process-wide torch state that precondfx switches while it measures (reentrant
    checkpoints as plain calls, attention on its math kernel)."""
    b = torch.backends.cuda
    return (torch.utils.checkpoint.CheckpointFunction, b.flash_sdp_enabled(),
            b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())


_SWITCHES = _process_switches()


@pytest.fixture(autouse=True)
def _switches_put_back(request):
    """A test that leaves a switch on fails where it leaves it, not in a later test that meets
    it (the checkpoint tests failed after the thread tests, in some orders only)."""
    yield
    now = _process_switches()
    if now != _SWITCHES:
        torch.utils.checkpoint.CheckpointFunction = _SWITCHES[0]
        torch.backends.cuda.enable_flash_sdp(_SWITCHES[1])
        torch.backends.cuda.enable_mem_efficient_sdp(_SWITCHES[2])
        torch.backends.cuda.enable_math_sdp(_SWITCHES[3])
        pytest.fail(f"{request.node.nodeid} left torch's process-wide state switched: {now} "
                    f"(was {_SWITCHES})")
