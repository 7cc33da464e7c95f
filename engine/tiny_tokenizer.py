"""The tokenizer of the tiny checkpoints (``engine.tiny_checkpoint``): a byte-level BPE trained on an embedded
corpus of prose, code and ChatML chats, with the ChatML special tokens and a Qwen2.5-style chat template with tool
calling. The same vocabulary size gives the same tokenizer in every process, so every random checkpoint and the
trained default model (``quality/model.py``) render chats alike.
"""

from __future__ import annotations

import functools

from engine.errors import ConfigError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
EXTRA_ADDED_TOKENS = (TOOL_CALL_START, TOOL_CALL_END)

CHAT_TEMPLATE = """\
{%- set default_system = 'You are a helpful assistant.' -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- default_system }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_PROSE = """\
The quick brown fox jumps over the lazy dog. A language model reads text as a sequence of tokens and
predicts the next one, one step at a time. When the request arrives, the scheduler decides which
sequences run in the next batch, how many pages of the key and value cache each one needs, and when a
finished sequence gives its memory back to the pool.
It was a bright cold day in April, and the clocks were striking thirteen. The river ran fast under the
old stone bridge, and the children counted the boats as they passed: one, two, three, four, five.
In the morning the baker opened the shop at six o'clock; by noon the bread was gone and the shelves
were empty again. People said the weather would change before the weekend, but nobody knew for sure.
Science is a way of thinking much more than it is a body of knowledge. Good inquiries matter as much as
good answers, and a careful experiment is worth more than a thousand confident opinions.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 2048 4096 3.14159 2.71828 -1 1e-6 50% $19.99 #1 @home
Punctuation and symbols: ( ) [ ] { } < > ! ? , . ; : ' " ` ~ + - * / = % & | ^ _ \\ @ # $
Unicode: café naïve résumé façade über straße 東京 北京 こんにちは 안녕하세요 Привет мир γειά σου 🙂 🚀 ✓ → ∑ π
"""

_CODE = '''\
import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    output_token_ids: list[int] = field(default_factory=list)

    def is_finished(self, eos_token_id: int) -> bool:
        if len(self.output_token_ids) >= self.max_tokens:
            return True
        return bool(self.output_token_ids) and self.output_token_ids[-1] == eos_token_id


def softmax(values: Iterable[float]) -> list[float]:
    values = list(values)
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_pages = list(range(num_pages))

    def allocate(self, count: int) -> Optional[list[int]]:
        if count > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:count], self.free_pages[count:]
        return pages

    def release(self, pages: list[int]) -> None:
        self.free_pages.extend(pages)


def main() -> None:
    pool = PagePool(num_pages=128, page_size=16)
    for index in range(10):
        pages = pool.allocate(index + 1)
        print(f"request {index}: pages={pages}")
    print(json.dumps({"status": "ok", "free": len(pool.free_pages)}, indent=2))


if __name__ == "__main__":
    main()
'''

_CHAT = """\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
<|im_start|>user
What's the weather like in Tokyo today?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temperature": 21, "condition": "sunny", "humidity": 0.4}
</tool_response><|im_end|>
<|im_start|>assistant
It is sunny in Tokyo, about 21 degrees Celsius with low humidity.<|im_end|>
<|im_start|>user
Can you write a function that reverses a string in Python?<|im_end|>
<|im_start|>assistant
Sure! Here is a simple version:

```python
def reverse(text: str) -> str:
    return text[::-1]
```

You can call it like `reverse("hello")`, which returns `"olleh"`.<|im_end|>
<|im_start|>user
Search the web for the latest release notes, please.<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "web_search", "arguments": {"query": "latest release notes", "max_results": 3}}
</tool_call><|im_end|>
<|im_start|>user
Thanks, that's all for now.<|im_end|>
<|im_start|>assistant
You're welcome! Let me know if you need anything else.<|im_end|>
<|endoftext|>
"""

TRAINING_CORPUS = "\n".join([_PROSE, _CODE, _CHAT])


def _training_lines() -> list[str]:
    return [line + "\n" for line in TRAINING_CORPUS.splitlines()]


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    added_count = len(SPECIAL_TOKENS) + len(EXTRA_ADDED_TOKENS)
    base_alphabet = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < base_alphabet + added_count:
        raise ConfigError(f"vocab_size must be at least {base_alphabet + added_count}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - added_count,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_lines(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_ADDED_TOKENS])
    return tokenizer.to_str()


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with ChatML special tokens; identical for the same vocab_size.

    Training is memoized per process; every call returns a fresh object, so callers may mutate it.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
    )
