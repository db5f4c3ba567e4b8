"""Shared pytest configuration."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU and a compiled variant (build/, or $GEGLU_BUILD_DIR); skipped without CUDA"
    )
