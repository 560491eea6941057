import pytest

from moe_testing import BASE_SEED


def pytest_report_header(config):
    return f"megamoe test seed: {BASE_SEED} (set MEGAMOE_TEST_SEED={BASE_SEED} to replay)"


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank (CPU), for argument checks that need a group."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
