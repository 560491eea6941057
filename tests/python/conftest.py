from moe_testing import BASE_SEED


def pytest_report_header(config):
    return f"megamoe test seed: {BASE_SEED} (set MEGAMOE_TEST_SEED={BASE_SEED} to replay)"
