import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One warm-started model cache for every end-to-end run of the session."""
    return str(tmp_path_factory.mktemp("model_cache"))
