"""Chain tiers through the server: under pressure idle chains move to host memory, their next turn reports
``loaded`` in the turn's ``resume_status`` (and not ``recomputed``), and /metrics exports the tokens moved per
tier and the loads."""

from litestar.testing import TestClient

from agentrt.app import create_app
from agentrt.config import ServerConfig
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import ENGINE_OPTIONS

SAMPLING = {"temperature": 0.0, "max_tokens": 4}


def metric(text: str, prefix: str) -> float:
    return float(next(x for x in text.splitlines() if x.startswith(prefix)).split()[-1])


def test_pressure_moves_idle_chains_to_host_and_their_turns_load(tmp_path):
    options = {**ENGINE_OPTIONS, "num_pages": 24, "page_size": 16, "chain_host_bytes": 256 * 2**20}
    app = create_app(ServerConfig(model=random_model_dir(), db_url=f"sqlite+aiosqlite:///{tmp_path / 'db'}",
                                  engine_options=options))
    with TestClient(base_url="http://127.0.0.1", app=app, timeout=120) as client:
        ids = [client.post("/v1/chains", json={"system_prompt": f"agent {i}"}).json()["id"] for i in range(4)]
        statuses = []
        for round_ in range(2):
            for i, cid in enumerate(ids):
                r = client.post(f"/v1/chains/{cid}/turns", json={
                    "messages": [{"role": "user", "content": f"turn {round_} of chain {i}: " + "words " * 12}],
                    "sampling": SAMPLING})
                assert r.status_code == 200, r.text
                statuses.append(r.json()["resume_status"])
        assert statuses[:4] == ["created"] * 4 and "recomputed" not in statuses and "loaded" in statuses
        text = client.get("/metrics").text
        assert metric(text, 'agentrt_chain_tier_tokens{move="offloaded"}') > 0
        assert metric(text, 'agentrt_chain_tier_loads{outcome="host"}') == statuses.count("loaded")
        assert metric(text, 'agentrt_chain_tier_loads{outcome="failed"}') == 0
        assert metric(text, 'agentrt_chain_tier_seconds{move="offload"}') > 0
        assert metric(text, 'agentrt_chain_tier_seconds{move="load_host"}') > 0
        # the replay reads these by name (agentrt.replay.replayer.COUNTERS): every move it names is exported
        from agentrt.replay.replayer import COUNTERS, TIER_MOVES, parse_metrics

        samples = parse_metrics(text)
        assert all(f"agentrt_chain_tier_seconds|move={m}" in samples for m in TIER_MOVES)
        assert samples["agentrt_chain_tier_seconds|move=load_host"] > 0 and set(COUNTERS) <= set(samples)
        # the rates a turn weighs to read a chain from disk or recompute it: prefill measured, no disk read yet
        assert metric(text, "agentrt_chain_tier_prefill_tokens_per_second") > 0
        assert metric(text, "agentrt_chain_tier_disk_read_bytes_per_second") == 0
        assert metric(text, 'agentrt_chain_tier_loads{outcome="recomputed_by_cost"}') == 0
        # turn-end host copies are a GPU's (engine.host_copies): none here
        assert metric(text, 'agentrt_chain_tier_host_copies{outcome="made"}') == 0
        assert metric(text, 'agentrt_chain_tier_host_copies{outcome="taken"}') == 0


def test_a_restarted_server_loads_the_chains_it_wrote_at_shutdown(tmp_path):
    options = {**ENGINE_OPTIONS, "chain_host_bytes": 256 * 2**20, "chain_disk_dir": str(tmp_path / "chains"),
               "chain_disk_bytes": 256 * 2**20}
    config = ServerConfig(model=random_model_dir(), db_url=f"sqlite+aiosqlite:///{tmp_path / 'db'}",
                          engine_options=options)
    turn = {"messages": [{"role": "user", "content": "remember the word tangerine"}], "sampling": SAMPLING}
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=120) as client:
        cid = client.post("/v1/chains", json={"system_prompt": "an agent"}).json()["id"]
        assert client.post(f"/v1/chains/{cid}/turns", json=turn).json()["resume_status"] == "created"
    assert len(list((tmp_path / "chains").glob("*.safetensors"))) == 1  # written at shutdown
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=120) as client:
        r = client.post(f"/v1/chains/{cid}/turns", json={**turn, "messages": [{"role": "user", "content": "and?"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["resume_status"] == "loaded"
        assert body["usage"]["prefilled_tokens"] < body["usage"]["prompt_tokens"] // 2
        assert metric(client.get("/metrics").text, "agentrt_chain_tier_disk_read_bytes_per_second") > 0


def test_session_hints_through_the_chain_route(tmp_path):
    options = {**ENGINE_OPTIONS, "chain_host_bytes": 256 * 2**20}
    config = ServerConfig(model=random_model_dir(), db_url=f"sqlite+aiosqlite:///{tmp_path / 'db'}",
                          engine_options=options)
    turn = {"messages": [{"role": "user", "content": "hello there"}], "sampling": SAMPLING}
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=120) as client:
        cid = client.post("/v1/chains", json={}).json()["id"]
        client.post(f"/v1/chains/{cid}/turns", json=turn)
        released = client.post(f"/v1/chains/{cid}/hints", json={"release": True, "priority": 3, "ttl_seconds": 600})
        assert released.status_code == 200 and released.json()["kv"]["engine_status"] == "host"
        r = client.post(f"/v1/chains/{cid}/hints", json={"prefetch": True, "pin": True})
        assert r.json()["kv"]["engine_status"] == "idle" and r.json()["kv"]["pinned"] is True
        refused = client.post(f"/v1/chains/{cid}/hints", json={"release": True, "priority": 5})
        assert refused.status_code == 400 and "pinned" in refused.text and refused.json()["extra"][0]["key"] == "release"
        assert client.get(f"/v1/chains/{cid}").json()["kv"]["engine_status"] == "idle"  # nothing applied
        pin_and_release = client.post(f"/v1/chains/{cid}/hints", json={"release": True, "pin": True})
        assert pin_and_release.status_code == 400 and pin_and_release.json()["extra"][0]["key"] == "release"
        both = client.post(f"/v1/chains/{cid}/hints", json={"release": True, "prefetch": True})
        assert both.status_code == 400 and "release" in both.text
        assert client.post(f"/v1/chains/{cid}/hints", json={"ttl_seconds": 0}).status_code == 400
        second = client.post(f"/v1/chains/{cid}/turns", json={**turn, "messages": [{"role": "user", "content": "x"}]})
        assert second.json()["resume_status"] == "resumed"
        assert client.post("/v1/chains/chain_unknown/hints", json={}).status_code == 404


def test_a_turn_carries_session_hints_on_every_route(tmp_path):
    """``hints`` on a chain turn, ``session_hints`` on chat completions and Responses (agentrt extensions):
    applied when the turn has ended -- pinned, or released to the host tier at once for a long tool call."""
    from openai import OpenAI

    options = {**ENGINE_OPTIONS, "chain_host_bytes": 256 * 2**20}
    config = ServerConfig(model=random_model_dir(), db_url=f"sqlite+aiosqlite:///{tmp_path / 'db'}",
                          engine_options=options)
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=120) as client:
        cid = client.post("/v1/chains", json={}).json()["id"]
        r = client.post(f"/v1/chains/{cid}/turns", json={
            "messages": [{"role": "user", "content": "hi"}], "sampling": SAMPLING,
            "hints": {"pin": True, "priority": 7, "ttl_seconds": 3600}})
        assert r.status_code == 200
        assert client.get(f"/v1/chains/{cid}").json()["kv"]["pinned"] is True
        r = client.post(f"/v1/chains/{cid}/turns", json={
            "messages": [{"role": "user", "content": "a long tool call follows"}], "sampling": SAMPLING,
            "hints": {"pin": False, "release_after": True}})
        kv = client.get(f"/v1/chains/{cid}").json()["kv"]
        assert kv["pinned"] is False and kv["engine_status"] == "host"
        bad = client.post(f"/v1/chains/{cid}/turns", json={
            "messages": [{"role": "user", "content": "x"}], "hints": {"ttl_seconds": -1}})
        assert bad.status_code == 400 and "ttl_seconds" in bad.text

        openai = OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=client)
        model = client.get("/v1/models").json()["data"][0]["id"]
        response = openai.responses.create(model=model, input="hello",
                                           max_output_tokens=4, extra_body={"session_hints": {"release_after": True}})
        chain = client.get("/v1/chains", params={"limit": 100}).json()["data"]
        assert response.status in ("completed", "incomplete") and chain  # 4 tokens may cut the reply
        chat = openai.chat.completions.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": "hey"}],
            extra_body={"session_hints": {"release_after": True}, "prompt_cache_key": "s1"})
        assert chat.choices[0].message is not None
        statuses = [client.get(f"/v1/chains/{c['id']}").json()["kv"]["engine_status"]
                    for c in client.get("/v1/chains", params={"limit": 100}).json()["data"]]
        assert statuses.count("host") >= 3, statuses  # the chain turn's, the response's, the chat's
