"""Tiny checkpoints that chat as other families do, for the server's tests; each template is written here to the
family's rules (a reduced form of its own), not copied.

GLM (4.5 to 4.7): role, think and tool-call tags are special tokens; a reply has no end-of-message token (the model
stops on the next message's role tag, ``<|user|>`` or ``<|observation|>``); earlier replies' reasoning is written
as an empty ``<think></think>``; calls are ``<tool_call>NAME`` with ``<arg_key>`` / ``<arg_value>`` pairs, the
template iterating the arguments.

DeepSeek-V3.1: a reply ends with ``<｜end▁of▁sentence｜>``; the generation prompt is ``<｜Assistant｜></think>``
after a user message and nothing after tool output (the model goes on right after it); calls are a
``<｜tool▁calls▁begin｜>`` section, the template concatenating the arguments' JSON text."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

# --- GLM ---------------------------------------------------------------------------------------------------
VOCAB = 544  # the tiny tokenizer's 512 tokens, a family's tags, room to spare
GLM_TAGS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>",
            "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
GLM_STOPS = ("<|endoftext|>", "<|user|>", "<|observation|>")

GLM_STYLE_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call a tool as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>.
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>{{ '\\n' + m.content }}
{%- elif m.role == 'user' -%}
<|user|>{{ '\\n' + m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set content = m.content or '' -%}
{%- set thought = '' -%}
{%- if '</think>' in content -%}
{%- set thought = content.split('</think>')[0].split('<think>')[-1].strip() -%}
{%- set content = content.split('</think>')[-1] -%}
{%- endif -%}
{%- if loop.index0 > ns.last_user and thought -%}
{{ '\\n<think>' + thought + '</think>' }}
{%- else -%}
{{ '\\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}{{ '\\n' + content.strip() }}{%- endif -%}
{%- for tc in m.tool_calls or [] -%}
{{ '\\n<tool_call>' + tc.function.name + '\\n' }}
{%- for k, v in tc.function.arguments.items() -%}
{{ '<arg_key>' + k + '</arg_key>\\n<arg_value>' + (v if v is string else v | tojson) + '</arg_value>\\n' }}
{%- endfor -%}
{{ '</tool_call>' }}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}
{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"""


def make_glm_style_checkpoint(root: Path, source: Path) -> Path:
    """``source`` (a tiny checkpoint) made to chat as GLM."""
    return make_styled_checkpoint(root / "glm-style", source, GLM_TAGS, GLM_STOPS, GLM_STYLE_TEMPLATE)


# --- DeepSeek-V3.1 ------------------------------------------------------------------------------------------
DEEPSEEK_TAGS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
                 "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
DEEPSEEK_STOPS = ("<｜end▁of▁sentence｜>",)

DEEPSEEK_STYLE_TEMPLATE = """{{- '<｜begin▁of▁sentence｜>' -}}
{%- for m in messages if m.role == 'system' -%}{{ m.content }}{%- endfor -%}
{%- set ns = namespace(after_user=false, after_tool=false) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
{{ '<｜User｜>' + m.content }}{%- set ns.after_user = true -%}{%- set ns.after_tool = false -%}
{%- elif m.role == 'assistant' -%}
{%- if ns.after_user -%}{{ '<｜Assistant｜></think>' }}{%- endif -%}
{%- set ns.after_user = false -%}{%- set ns.after_tool = false -%}
{%- set content = m.content or '' -%}
{%- if '</think>' in content -%}{%- set content = content.split('</think>', 1)[1] -%}{%- endif -%}
{{ content }}
{%- for tc in m.tool_calls or [] -%}
{%- if loop.first -%}{{ '<｜tool▁calls▁begin｜>' }}{%- endif -%}
{{ '<｜tool▁call▁begin｜>' + tc.function.name + '<｜tool▁sep｜>' + tc.function.arguments + '<｜tool▁call▁end｜>' }}
{%- if loop.last -%}{{ '<｜tool▁calls▁end｜>' }}{%- endif -%}
{%- endfor -%}
{{ '<｜end▁of▁sentence｜>' }}
{%- elif m.role == 'tool' -%}
{{ '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}{%- set ns.after_tool = true -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.after_user -%}{{ '<｜Assistant｜></think>' }}{%- endif -%}"""


def make_deepseek_style_checkpoint(root: Path, source: Path) -> Path:
    """``source`` (a tiny checkpoint) made to chat as DeepSeek-V3.1."""
    return make_styled_checkpoint(root / "deepseek-style", source, DEEPSEEK_TAGS, DEEPSEEK_STOPS,
                                  DEEPSEEK_STYLE_TEMPLATE)


def make_styled_checkpoint(out: Path, source: Path, tags: tuple[str, ...], stops: tuple[str, ...],
                           template: str) -> Path:
    """A copy of ``source`` at ``out`` with ``tags`` added as special tokens, the embeddings grown to hold them
    (random rows), ``stops`` as its stop tokens and ``template`` as its chat template."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    shutil.copytree(source, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": list(tags)})
    assert len(tokenizer) <= VOCAB
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(template)
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in stops]
    for name in ("config.json", "generation_config.json"):
        config = json.loads((out / name).read_text())
        config["eos_token_id"] = stop_ids
        if name == "config.json":
            old_vocab, config["vocab_size"] = config["vocab_size"], VOCAB
        (out / name).write_text(json.dumps(config))
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for key, w in weights.items():
        if w.shape[0] == old_vocab and ("embed_tokens" in key or "lm_head" in key):
            grown = torch.randn(VOCAB - old_vocab, *w.shape[1:], generator=generator).to(w.dtype) * 0.1
            weights[key] = torch.cat([w, grown])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


# --- what the styled chats' tests share -------------------------------------------------------------------
def forced_reply(tokenizer, text: str, stop: str) -> list[int]:
    """The tokens of ``text`` as the model's reply, then the stop token ``stop`` that ends it."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(stop)]


def chain_record(url: str, chain_id: str) -> dict:
    """A chain as GET /v1/chains/{id} returns it, with its token ids."""
    import httpx

    r = httpx.get(f"{url}/v1/chains/{chain_id}?include_tokens=true", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def prompt_log(chain: dict) -> list[int]:
    """The chain's token log up to its last turn's reply (what that turn's prompt was)."""
    turns = chain["turns"]
    log = [t for turn in turns for t in turn["appended_token_ids"] + turn["generated_token_ids"]]
    return log[:len(log) - len(turns[-1]["generated_token_ids"])]


@contextlib.contextmanager
def styled_server(root: Path, model_dir: Path, model_name: str):
    """(server, openai client, tokenizer) serving a styled checkpoint over SQLite under ``root``."""
    from transformers import AutoTokenizer

    from tests.live_servers import app_server, openai_client

    with app_server(f"sqlite+aiosqlite:///{root / 'server.db'}", model=model_dir, model_name=model_name) as server:
        yield server, openai_client(server.url), AutoTokenizer.from_pretrained(model_dir)
