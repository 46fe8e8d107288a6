"""The scripted test model (tests/e2e/scripted_model.py) without a server: its tokenizer, chat
template and weights do what the end-to-end tests rely on."""

from __future__ import annotations

import json
import re

import pytest

from gateway.text.chat_template import ChatTemplate
from gateway.text.detokenizer import IncrementalDetokenizer
from tests.e2e import scripted_model as sm
from zserve.catalog import ModelNotFound, smollm2_gguf_path
from zserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("torch")
    try:
        smollm2_gguf_path()
    except ModelNotFound as e:
        pytest.skip(str(e))
    return sm.build_scripted_model(tmp_path_factory.mktemp("scripted-model"))


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def one_id(tok: Tokenizer, s: str) -> int:
    ids = tok.encode(s)
    assert len(ids) == 1, (s, ids)
    return ids[0]


def script_ids(tok: Tokenizer, start: str) -> list[int]:
    """The ids the model writes after ``start``, EOS included."""
    return [one_id(tok, s) for s in sm.SCRIPTS[start]] + [tok.eos_token_id]


def test_directory_files(model_dir, tok: Tokenizer) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == tok.vocab_size == 49152 + len(sm.added_tokens())
    assert config["eos_token_id"] == tok.eos_token_id == 2 and tok.eos_token == sm.EOS_TOKEN
    assert tok.bos_token_id == 1 and tok.bos_token == sm.BOS_TOKEN
    assert tok.chat_template == sm.CHAT_TEMPLATE
    assert {p.name for p in model_dir.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"}


@pytest.mark.parametrize("start", list(sm.SCRIPTS))
def test_prompt_ending_in_a_script_start_ends_in_its_token(tok: Tokenizer, start: str) -> None:
    # Added tokens are matched leftmost-longest in raw text, whatever precedes them.
    for prefix in ("", "x", "Tell me: ", "<|im_start|>user\nhi "):
        assert tok.encode(prefix + start)[-1] == one_id(tok, start)


def test_prefills_stay_single_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("weather? " + sm.NAMED_PREFILL)
    assert ids[-1] == one_id(tok, sm.NAMED_PREFILL) and one_id(tok, sm.REQUIRED_PREFILL) not in ids
    assert tok.encode("weather? " + sm.REQUIRED_PREFILL)[-1] == one_id(tok, sm.REQUIRED_PREFILL)
    # The model's own text re-encodes to the same text and the same last token; to the very ids
    # it wrote except where the named prefill (longest match) swallows the start of the Berlin call.
    for start in sm.SCRIPTS:
        ids, wrote = tok.encode(sm.EXPECTED[start]), script_ids(tok, start)[:-1]
        assert tok.decode(ids) == sm.EXPECTED[start] and ids[-1] == wrote[-1]
        assert (ids == wrote) is (sm.REQUIRED_PREFILL + sm.BERLIN_CALL not in sm.EXPECTED[start])


@pytest.mark.parametrize("start", list(sm.SCRIPTS))
def test_decode_and_streamed_detokenization_give_the_script_text(tok: Tokenizer, start: str) -> None:
    ids = script_ids(tok, start)
    assert tok.decode(ids) == sm.EXPECTED[start]
    assert tok.decode(ids, skip_special_tokens=False) == sm.EXPECTED[start] + sm.EOS_TOKEN
    for size in (1, 2, 3):
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.push(ids[i:i + size]) for i in range(0, len(ids), size)] + [detok.flush()]
        assert "".join(pieces) == sm.EXPECTED[start]
        if size == 1:  # every token shows up as soon as it is pushed
            assert pieces[:-2] == [tok.decode([i]) for i in ids[:-1]]


def test_expected_calls_match_the_script_text() -> None:
    # A plain hermes reading (prefill + output; JSON between the tags) gives EXPECTED_CALLS.
    for start, calls in sm.EXPECTED_CALLS.items():
        text = (start if start in (sm.REQUIRED_PREFILL, sm.NAMED_PREFILL) else "") + sm.EXPECTED[start]
        bodies = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S)
        assert [json.loads(b) for b in bodies] == calls, start
    outside = re.sub(r"<tool_call>.*?</tool_call>", "", sm.EXPECTED_TWO_CALLS, flags=re.S)
    assert outside.strip() == sm.TWO_CALLS_CONTENT
    assert sm.EXPECTED_THINK == "<think>" + sm.REASONING + "</think>" + sm.ANSWER


def test_chat_template_ends_the_prompt_with_the_last_message(tok: Tokenizer) -> None:
    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": sm.PARIS_ARGUMENTS}}
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris? " + sm.WEATHER_TRIGGER},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C " + sm.TOOL_RESULT_TRIGGER},
    ]
    for add_generation_prompt in (True, False):
        text = template.render(history, add_generation_prompt=add_generation_prompt, tools=[sm.WEATHER_TOOL])
        assert text.startswith("<|im_start|>system\n<tools>\n" + json.dumps(sm.WEATHER_TOOL) + "\n</tools><|im_end|>\n")
        assert "<|im_start|>assistant\n" + "<tool_call>" + sm.PARIS_CALL + "</tool_call><|im_end|>\n" in text
        assert text.endswith("<|im_start|>tool\n22 C " + sm.TOOL_RESULT_TRIGGER)
        ids = tok.encode(text)
        assert ids[-1] == one_id(tok, sm.TOOL_RESULT_TRIGGER)
        # The rendered call is the very tokens the weather script writes.
        call_ids = script_ids(tok, sm.WEATHER_TRIGGER)[:-1]
        assert any(ids[i:i + len(call_ids)] == call_ids for i in range(len(ids)))
    # Dict arguments (transformers' convention) render the same; content and calls may mix.
    dict_call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    text = template.render([{"role": "assistant", "content": "Sure.", "tool_calls": [dict_call]},
                            {"role": "user", "content": sm.STORY_TRIGGER}])
    assert text == ("<|im_start|>assistant\nSure.<tool_call>" + sm.PARIS_CALL + "</tool_call><|im_end|>\n"
                    "<|im_start|>user\n" + sm.STORY_TRIGGER)
    # continue_final_message: the final assistant message's last token is the prompt's last token,
    # whether the text is used as rendered or cut after the message's content (transformers' way).
    content = "Let me think. <think>"
    text = template.render([{"role": "user", "content": "Capital of France?"},
                            {"role": "assistant", "content": content}], add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\n" + content)
    assert text[: text.rindex(content) + len(content)] == text
    assert tok.encode(text)[-1] == one_id(tok, "<think>")


@pytest.mark.slow
def test_transformers_greedy_and_margins_follow_the_scripts(model_dir, tok: Tokenizer) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for start in sm.SCRIPTS:
            ids = tok.encode("Tell me something " + start)
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=20, pad_token_id=tok.eos_token_id)
            new = out[0, len(ids):].tolist()
            assert new == script_ids(tok, start), start
            assert tok.decode(new) == sm.EXPECTED[start]
            # Every position, prompt included, picks its token by > 60 nats: sampling at
            # temperature 1.0 is as certain as greedy.
            top2 = model(out).logits[0].topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min().item() > 60
        # Text outside the scripts ends at once.
        ids = tok.encode("The quick brown fox")
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=5, pad_token_id=tok.eos_token_id)
        assert out[0, len(ids):].tolist() == [tok.eos_token_id]
