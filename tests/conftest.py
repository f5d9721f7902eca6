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


#: the files that take longest, summed per file from ``python -m pytest -n 2 --dist loadfile
#: --no-loadscope-reorder --durations=0`` (2026-11-27: 1076 s of tests in 571 s on 2
#: workers), longest first.  ``pytest_collection_modifyitems`` hands them out first: under
#: ``--dist loadfile --no-loadscope-reorder`` the scheduler sends files in collection order,
#: so no long file starts last while the other worker idles (xdist's own order, by number of
#: tests, sent the 47-s single tests of test_fuzz.py and test_scheme_tat.py among the last).
#: A file missing here keeps its place after these.
LONGEST_FIRST = ("tests/batteries/test_hf_zoo.py", "tests/batteries/test_core_zoo.py",
                 "tests/batteries/test_models_pytorch.py", "tests/pytorch/test_meta_tied.py",
                 "tests/schemes/test_scheme_tat.py", "tests/batteries/test_fuzz.py",
                 "tests/pytorch/test_large_flows.py", "tests/pytorch/test_weight_side.py",
                 "tests/batteries/test_bench_smoke.py", "tests/pytorch/test_defects21.py",
                 "tests/integrations/test_hf.py", "tests/onnx/test_onnx_exporters.py",
                 "tests/pytorch/test_exports.py", "tests/docs/test_docs.py",
                 "tests/pytorch/test_distributed.py", "tests/pytorch/test_lr_target.py")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))


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
