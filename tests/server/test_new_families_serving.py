"""The server on a latent-attention (GLM-4.7-Flash) and a hybrid linear-attention (Qwen3.5) checkpoint, through
the official ``openai`` and ``anthropic`` clients as stateless agent clients use them: a conversation re-sent in
full resumes one implicit chain whose later turns prefill only their new tokens (exact counters from the chain's
turn records), and every turn's tokens equal a from-scratch greedy run of the engine on the same token history.
(A random model's replies hold invalid UTF-8, so re-sent text does not round-trip to the tokens it generated: the
reference is the chain's own token record, not a re-tokenized conversation.) With SnapKV the chains stay compacted
to the budget in every paged layer from turn to turn."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from engine import LLM, SamplingParams
from tests.live_servers import app_server, openai_client

GREEDY = {"temperature": 0, "max_tokens": 5}
SYSTEM = {"role": "system", "content": "You are a coding agent. Answer tersely."}


@pytest.fixture(scope="module", params=["glm4_moe_lite", "qwen3_5"])
def served(request, mla_dirs, hybrid_dirs, tmp_path_factory):
    """(server, openai client, model name, checkpoint) on one architecture's tiny checkpoint, dense chains."""
    arch = request.param
    model_dir = (mla_dirs | hybrid_dirs)[arch]
    db = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp(arch) / 'server.db'}"
    with app_server(db, model=model_dir, model_name=arch) as server:
        yield server, openai_client(server.url), arch, model_dir


def _chain(url: str, chain_id: str) -> dict:
    r = httpx.get(f"{url}/v1/chains/{chain_id}?include_tokens=true", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_resent_conversation_resumes_its_chain_and_matches_a_fresh_prefill(served):
    server, client, model, model_dir = served
    history: list = [SYSTEM, {"role": "user", "content": "The test in utils.py fails. Fix it."}]
    chain_ids, replies = [], []
    for step in range(4):
        r = client.chat.completions.create(model=model, messages=history, **GREEDY)
        chain_ids.append(r.model_extra["chain"]["id"])
        replies.append(r)
        history += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                    {"role": "user", "content": f"Tool output {step}: 3 passed, 1 failed."}]
    assert len(set(chain_ids)) == 1
    turns = _chain(server.url, chain_ids[0])["turns"]
    assert len(turns) == 4 and replies[0].usage.prompt_tokens_details.cached_tokens == 0
    for r, turn in zip(replies[1:], turns[1:]):
        assert turn["resume_status"] == "resumed"
        # the new messages and the previous turn's last generated token (which its KV lacks), nothing else
        assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1
        assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - turn["usage"]["prefilled_tokens"]
    # each turn's prompt is the whole token history before its reply; a fresh engine prefills it from scratch
    prompts, history_ids = [], []
    for turn in turns:
        history_ids += turn["appended_token_ids"]
        prompts.append(list(history_ids))
        history_ids += turn["generated_token_ids"]
    fresh = LLM(model_dir, device="cpu").generate(
        prompts, [SamplingParams(temperature=0.0, max_tokens=len(t["generated_token_ids"]), ignore_eos=True)
                  for t in turns])
    assert [o.token_ids for o in fresh] == [t["generated_token_ids"] for t in turns]


def test_the_anthropic_client_reads_the_chain_as_cache(served):
    server, _, model, _ = served
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    messages: list = [{"role": "user", "content": "List the files."}]
    usages = []
    for step in range(3):
        m = client.messages.create(model=model, max_tokens=4, system="Be brief.", messages=messages)
        usages.append(m.usage)
        messages += [{"role": "assistant", "content": m.content[0].text if m.content else "."},
                     {"role": "user", "content": f"Now step {step}."}]
    assert usages[0].cache_read_input_tokens == 0
    for before, after in zip(usages, usages[1:]):
        # a resumed turn reads everything the previous one held (its prompt and output) from the chain
        assert after.cache_read_input_tokens >= before.input_tokens + before.cache_read_input_tokens
        assert 0 < after.input_tokens < after.cache_read_input_tokens


BUDGET = 64  # SnapKV's kept slots per layer and KV head (its window of 32 included)


@pytest.mark.parametrize("arch", ["glm4_moe_lite", "qwen3_5"])
def test_snapkv_chains_stay_compacted_across_resent_turns(arch, mla_dirs, hybrid_dirs, tmp_path):
    """A server whose chains use SnapKV: each turn's prompt is compacted to the budget in every paged layer (the
    latent rows of the MLA model, the full-attention layers of the hybrid), the chain keeps only that plus the
    turn's generated tokens, and the next re-sent turn still resumes it."""
    db = f"sqlite+aiosqlite:///{tmp_path / 'server.db'}"
    with app_server(db, model=(mla_dirs | hybrid_dirs)[arch], model_name=arch, method="snapkv",
                    method_config={"budget": BUDGET}) as server:
        client = openai_client(server.url)
        history: list = [SYSTEM, {"role": "user", "content": "Read every file and report. " * 12}]
        chain_ids = []
        for step in range(3):
            r = client.chat.completions.create(model=arch, messages=history, **GREEDY)
            chain_ids.append(r.model_extra["chain"]["id"])
            chain = _chain(server.url, chain_ids[0])
            kv, turn = chain["kv"], chain["turns"][-1]
            assert kv["compacted"] and kv["logical_tokens"] > BUDGET + GREEDY["max_tokens"]
            # the compacted prompt plus the decoded tokens (the last sampled one has no KV yet)
            assert kv["physical_tokens_per_layer"] == [BUDGET + len(turn["generated_token_ids"]) - 1] * \
                len(kv["physical_tokens_per_layer"])
            if step:
                assert turn["resume_status"] == "resumed"
            history += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                        {"role": "user", "content": f"Tool output {step}: " + "line of output " * 10}]
        assert len(set(chain_ids)) == 1
