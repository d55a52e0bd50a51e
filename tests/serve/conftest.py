"""Fixtures: two real `vllm serve` processes on 127.0.0.1 over the tiny pair (see pair.py), one with DDTree and
one without speculation.

Both servers are session-scoped and started together: on a 2-core machine one start takes minutes, and the API
tests and the soak share the DDTree server. They are always stopped (process group SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import pytest

from tests.serve.pair import SERVER_ARGS, SPECULATIVE_CONFIG, TARGET
from tests.serve.server import Server, start_server


@pytest.fixture(scope="session")
def servers(tmp_path_factory) -> dict[str, Server]:
    log_dir = tmp_path_factory.mktemp("serve_logs")
    started: dict[str, Server] = {}
    try:
        started["ddtree"] = start_server("ddtree", TARGET, log_dir, SPECULATIVE_CONFIG, SERVER_ARGS)
        started["plain"] = start_server("plain", TARGET, log_dir, None, SERVER_ARGS)
        for server in started.values():
            server.wait_healthy()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="session")
def ddtree_server(servers) -> Server:
    return servers["ddtree"]


@pytest.fixture(scope="session")
def plain_server(servers) -> Server:
    return servers["plain"]


def _client(server: Server, asynchronous: bool = False):
    import openai

    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=server.url, api_key="EMPTY", max_retries=0, timeout=300.0)


@pytest.fixture
def client(ddtree_server):
    with _client(ddtree_server) as c:
        yield c


@pytest.fixture
def plain_client(plain_server):
    with _client(plain_server) as c:
        yield c


@pytest.fixture
def make_async_client():
    return lambda server: _client(server, asynchronous=True)
