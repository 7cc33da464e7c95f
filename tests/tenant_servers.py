"""A server with auth on and two tenants' keys (alice, bob) on the embedded model, under uvicorn in this process:
module-scoped fixtures (import them by name into a test module; one whose tenants talk through another client
than ``openai``'s defines its own ``alice`` and ``bob``)."""

from __future__ import annotations

import httpx
import pytest

from tests.live_servers import app_server, openai_client
from tests.server_helpers import make_keys


@pytest.fixture(scope="module")
def db_url(tmp_path_factory):
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('db') / 'server.db'}"


@pytest.fixture(scope="module")
def keys(db_url):
    return make_keys(db_url, "alice", "bob")


@pytest.fixture(scope="module")
def server(db_url, keys):
    with app_server(db_url, require_auth=True) as s:
        yield s


@pytest.fixture(scope="module")
def alice(server, keys):
    return openai_client(server.url).with_options(api_key=keys["alice"])


@pytest.fixture(scope="module")
def bob(server, keys):
    return openai_client(server.url).with_options(api_key=keys["bob"])


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokens():
    """The embedded model's tokenizer: a text's token ids, without special tokens."""
    from transformers import AutoTokenizer

    from engine.tiny_checkpoint import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    return lambda text: tokenizer.encode(text, add_special_tokens=False)
