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
