import pytest
import torch.distributed as dist


@pytest.fixture
def group_of_one():
    """A real gloo process group of one rank (in-process: no worker starts), for layers that ask for a group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
