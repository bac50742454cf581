"""Every command-line test runs on one torch thread, restored afterwards: the commands time and generate on the
CPU, and threads fighting over a shared machine's cores make them many times slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
