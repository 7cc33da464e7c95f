"""Agent clients ask for tens of thousands of output tokens on every request (Claude Code's ``max_tokens``, the
OpenAI Agents SDK's ``max_output_tokens``). That works whenever the model's context allows it: the foreign APIs
lower a larger value to the server's ``max_tokens_per_turn`` and the engine lowers it to what the context and the
KV pool hold for the prompt (``SamplingParams.fit_max_tokens``), ending the reply with ``length`` there instead of
refusing the request. Our own chain route stays strict unless ``sampling.fit_max_tokens`` asks for the same.

References: the pool's and the context's sizes (pages x page size, ``max_model_len``) less the prompt."""

import anthropic
import httpx
import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.tiny_checkpoint import random_model_dir
from agentrt.app import create_app
from agentrt.config import ServerConfig
from agentrt.local_server import LocalServer
from tests.live_servers import openai_client

PAGE, PAGES = 4, 24  # a pool of 96 tokens


def test_the_engine_fits_max_tokens_to_the_pool_and_the_context():
    llm = LLM(random_model_dir(), device="cpu", page_size=PAGE, num_pages=PAGES)
    prompt = list(range(5, 15))
    out = llm.generate([prompt], SamplingParams(max_tokens=10**6, ignore_eos=True, fit_max_tokens=True))[0]
    assert len(out.token_ids) == PAGES * PAGE - len(prompt) and out.finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="KV pages"):
        llm.generate([prompt], SamplingParams(max_tokens=10**6, ignore_eos=True))
    short = LLM(random_model_dir(), device="cpu", page_size=PAGE, num_pages=PAGES * 4, max_model_len=40)
    out = short.generate([prompt], SamplingParams(max_tokens=10**6, ignore_eos=True, fit_max_tokens=True))[0]
    assert len(out.token_ids) == 40 - len(prompt) and out.finish_reason == "length"
    small = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True, fit_max_tokens=True))[0]
    assert len(small.token_ids) == 3  # a ceiling that fits is kept


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("db") / "server.db"
    app = create_app(ServerConfig(db_url=f"sqlite+aiosqlite:///{db}", model=random_model_dir(),
                                  max_tokens_per_turn=100_000,
                                  engine_options={"device": "cpu", "num_pages": PAGES, "page_size": PAGE}))
    with LocalServer(app) as s:
        yield s


def test_every_agent_api_takes_a_huge_max_tokens(server):
    client = openai_client(server.url)
    model = client.models.list().data[0].id
    capacity = PAGES * PAGE
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=64_000)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens <= capacity
    response = client.responses.create(model=model, input="Hi", max_output_tokens=64_000, store=False)
    assert response.status in ("completed", "incomplete")
    assert response.usage.input_tokens + response.usage.output_tokens <= capacity
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with claude.messages.stream(model=model, max_tokens=64_000,  # the package streams a request this large
                                messages=[{"role": "user", "content": "Hi"}]) as stream:
        message = stream.get_final_message()
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.input_tokens + message.usage.output_tokens <= capacity
    with httpx.Client(base_url=server.url, timeout=120) as http:  # ignore_eos: the reply runs to the pool's end
        r = http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 64_000,
                                               "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == capacity


def test_the_chain_route_is_strict_unless_asked_to_fit(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        chain = http.post("/v1/chains", json={}).json()["id"]
        turn = {"messages": [{"role": "user", "content": "Hi"}], "sampling": {"max_tokens": 200_000}}
        r = http.post(f"/v1/chains/{chain}/turns", json=turn)
        assert r.status_code == 400 and r.json()["extra"][0]["key"] == "sampling.max_tokens"
        turn["sampling"] = {"max_tokens": 64_000, "ignore_eos": True}  # within the limit, beyond the pool
        assert http.post(f"/v1/chains/{chain}/turns", json=turn).status_code == 422  # the engine: KV pages
        turn["sampling"]["fit_max_tokens"] = True
        r = http.post(f"/v1/chains/{chain}/turns", json=turn)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert r.json()["finish_reason"] == "length"
        # a chain turn keeps a page free for a fork's tail copy
        assert usage["prompt_tokens"] + usage["completion_tokens"] == PAGES * PAGE - PAGE
