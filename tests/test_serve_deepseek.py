"""`platform serve` on tiny DeepSeek-V3 folders (random weights, float32,
torch backend), one with a DeepSeek-style fast tokenizer and chat template and
one with Kimi K2's tiktoken tokenizer and template, asked by the official
``openai`` and ``anthropic`` clients over HTTP: the server renders the
model's template, and its greedy text is transformers' greedy continuation
of the same prompt tokens."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "plugins/models/deepseek/tests"))

from kv_servers import serve  # noqa: E402
from tiny_deepseek import reference, saved_model  # noqa: E402

NEW = 6
REPLACEMENT = "\ufffd"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, Kimi. 你好世界"}]

pytestmark = pytest.mark.slow  # two server start-ups (model load, transformers reference)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("serve_deepseek"))


def expected(path: str):
    """plinth's tokenizer of the folder, the chat prompt's tokens as it
    renders them, and transformers' NEW greedy tokens after them."""
    from plinth.api import Tokenizer

    tok = Tokenizer.from_hf_dir(path)
    prompt = tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = reference(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return tok, prompt, out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name,marker", [("q_lora", "<｜User｜>"), ("kimi", "<|im_user|>")])
def test_serve_to_the_official_clients(root, tmp_path, name, marker):
    import anthropic
    import httpx
    import openai

    path = saved_model(name, root)
    tok, prompt, greedy = expected(path)
    assert tok.token_to_id(marker) in prompt  # the model's own chat format
    server = serve(path, str(tmp_path / "serve.log"), wait_s=240)
    try:
        rendered = httpx.post(server.url + "/tokenize", json={"model": "tiny", "messages": MESSAGES}, timeout=30).json()
        assert rendered["tokens"] == prompt, rendered

        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
        r = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=NEW, temperature=0, logprobs=True,
                                        extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == NEW
        # the tokens' bytes, exactly (random weights: the text may end inside a UTF-8 character)
        got = b"".join(bytes(t.bytes or b"") for t in r.choices[0].logprobs.content)
        assert got.decode("utf-8", errors="replace") == tok.decode(greedy, skip_special_tokens=False)
        assert tok.decode(greedy).startswith(r.choices[0].message.content)

        # the Messages API has no ignore_eos: the text ends where an end token comes
        stops = [i for i, t in enumerate(greedy) if t in tok.eos_token_ids]
        until_eos = greedy[: stops[0]] if stops else greedy
        a = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
        # temperature through extra_body: this anthropic client version dropped the argument
        m = a.messages.create(model="tiny", system="Be brief.", messages=MESSAGES[1:], max_tokens=NEW, extra_body={"temperature": 0})
        assert m.usage.input_tokens == len(prompt)
        text, want = "".join(b.text for b in m.content if b.type == "text"), tok.decode(until_eos)
        assert text == want if REPLACEMENT not in want else want.startswith(text)
        assert m.stop_reason == ("end_turn" if stops else "max_tokens")
    except Exception:
        print(server.log())
        raise
    finally:
        server.stop()
