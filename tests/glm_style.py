"""A tiny GLM-4.7-Flash checkpoint that chats as GLM does, for the server's tests: its role, think and tool-call
tags are special tokens; a reply has no end-of-message token (the model stops on the next message's role tag,
``<|user|>`` or ``<|observation|>``); earlier replies' reasoning is written as an empty ``<think></think>``; calls
are ``<tool_call>NAME`` with ``<arg_key>`` / ``<arg_value>`` pairs, the template iterating the arguments. The
template is written here to those rules (a reduced form of GLM's), not copied."""

from __future__ import annotations

import json
from pathlib import Path

GLM_TAGS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>",
            "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
GLM_STOPS = ("<|endoftext|>", "<|user|>", "<|observation|>")
VOCAB = 544  # the tiny tokenizer's 512 tokens, the tags above, room to spare

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
    """``source`` (a tiny ``glm4_moe_lite`` checkpoint) made to chat as GLM: the tags added as special tokens,
    the embeddings grown to hold them (random rows), GLM's stop tokens, the template above."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    out = root / "glm-style"
    shutil.copytree(source, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": list(GLM_TAGS)})
    assert len(tokenizer) <= VOCAB
    tokenizer.chat_template = GLM_STYLE_TEMPLATE
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(GLM_STYLE_TEMPLATE)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in GLM_STOPS]
    for name in ("config.json", "generation_config.json"):
        config = json.loads((out / name).read_text())
        config["eos_token_id"] = stops
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
