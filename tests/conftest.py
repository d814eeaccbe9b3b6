import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter; Triton reads this when a
# kernel is defined, so set it before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_failed_worker_left_over():
    """A test whose worker failed leaves rank 0's record of it (`peer_failed`) until a new
    group forms; the next test starts without it, as a fresh process would."""
    from bcg.distributed import parallel_state

    yield
    parallel_state._peer_failed = False
