"""Test setup: CPU only, four simulated devices for tensor-parallel tests, shared engine helpers."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import pytest  # noqa: E402

API_KEY = "test-key"


@pytest.fixture(scope="session")
def openai_server():
    """A real uvicorn server on the bundled model (small buckets), shared by the server tests.

    Yields (base URL, the LLMEngine behind it). Every /v1 route needs `Bearer test-key`.
    """
    from helpers import running_server, small_engine_args

    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.config import ServerConfig

    options = small_engine_args()
    options.pop("show_progress")
    engine = LLMEngine(EngineConfig.for_model(None, **options), show_progress=False)
    config = ServerConfig(api_key=API_KEY, max_n=4, max_body_bytes=64 * 1024, max_prompts=4)
    with running_server(build_app(engine, config)) as url:
        yield url, engine
