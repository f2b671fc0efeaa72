import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY = ["gpt2-tiny", "llama-tiny", "mixtral-tiny", "qwen2-tiny", "bert-tiny"]


@pytest.fixture(scope="session")
def tiny_names():
    return TINY
