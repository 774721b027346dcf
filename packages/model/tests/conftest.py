import pytest
import torch

from mmfsdp.model import get_model_entry


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_config():
    return get_model_entry("mistral3").testkit.tiny_config()
