"""The incremental detokenizer against the tokenizer's own ``decode`` of the whole output, token by token, with
the direct Rust decode it takes for a fast tokenizer without a clean-up pass, and the HF call otherwise."""

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer, decoder_for
from engine.tiny_checkpoint import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_the_direct_decode_is_taken_only_where_it_equals_the_tokenizers(tokenizer):
    fast = decoder_for(tokenizer)
    assert fast.func == tokenizer.backend_tokenizer.decode  # the project tokenizer: no clean-up pass
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(0, 12))]
        assert fast(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert decoder_for(tokenizer).func == tokenizer.decode  # a clean-up pass: HF's own call
    finally:
        tokenizer.clean_up_tokenization_spaces = False


@pytest.mark.parametrize("direct", [True, False])
def test_incremental_text_equals_decoding_the_whole_output(tokenizer, direct):
    rng = random.Random(1)
    decode = None if direct else (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    for _ in range(20):
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(5)]
        detok = IncrementalDetokenizer(tokenizer, len(prompt), decode=decode)
        ids = list(prompt)
        for _ in range(40):
            ids.append(rng.randrange(tokenizer.vocab_size))
            detok.update(ids)
        whole = tokenizer.decode(ids[len(prompt):], skip_special_tokens=True)
        assert whole.startswith(detok.text) and len(whole) - len(detok.text) <= 4  # held back: an open UTF-8 tail


def test_kept_special_tokens_stay_in_the_text_but_the_stop_token_does_not():
    """``SamplingParams.skip_special_tokens`` False (a chat format whose tags are special tokens): the text is
    the tokenizer's decode of the output with its special tokens, less the stop token that ended it; True (the
    default): without any special token."""
    from engine import LLM, SamplingParams
    from engine.tiny_checkpoint import random_model_dir

    llm = LLM(random_model_dir(), device="cpu", num_pages=64)
    tok = llm.tokenizer
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    forced = tok.encode("ab", add_special_tokens=False) + [start] + tok.encode("cd", add_special_tokens=False) + [end]
    outs = llm.generate(["x", "x"], [SamplingParams(max_tokens=20, forced_token_ids=forced, skip_special_tokens=skip)
                                     for skip in (False, True)])
    assert [o.token_ids for o in outs] == [forced, forced] and all(o.finish_reason == "stop" for o in outs)
    assert outs[0].text == tok.decode(forced[:-1], skip_special_tokens=False) == "ab<|im_start|>cd"
    assert outs[1].text == tok.decode(forced, skip_special_tokens=True) == "abcd"
