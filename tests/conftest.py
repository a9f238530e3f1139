import os
import warnings

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
warnings.filterwarnings("ignore", category=UserWarning, module="peft")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def deterministic_threads():
    """One intra-op thread for tests that demand bit-identical results across runs.

    With several threads, some CPU kernels split their work according to which threads are free, so
    float sums — and hence parameters after a few steps — can differ in the last bit from one run
    to the next on a busy machine.  Reproducibility to the bit is a promise for one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
