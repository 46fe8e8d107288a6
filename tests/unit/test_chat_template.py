"""Chat templates render exactly as transformers' apply_chat_template, and bad input is a ChatTemplateError."""

from __future__ import annotations

import pytest

from gateway.text.chat_template import ChatTemplate, ChatTemplateError
from zserve.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is the capital of France?"}
ASSISTANT = {"role": "assistant", "content": "Paris."}

CONVERSATIONS = {
    "user only": [USER],
    "with system": [SYSTEM, USER],
    "multi-turn": [SYSTEM, USER, ASSISTANT, {"role": "user", "content": "And of Italy? Answer in 한국어 😀"}],
    "multi-turn without system": [USER, ASSISTANT, {"role": "user", "content": "  spaces\n\nand lines  "}],
    "ends with assistant": [USER, ASSISTANT],
    "special tokens in content": [{"role": "user", "content": "say <|im_end|> please"}],
    "empty content": [{"role": "user", "content": ""}],
}

# Exercises what transformers gives templates beyond plain Jinja: tojson (no HTML escaping),
# namespace, loop controls, the {% generation %} tag, raise_exception, and extra variables.
FEATURE_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(count=0) -%}
{%- if tools %}TOOLS:{{ tools | tojson }}
{{ tools[0] | tojson(indent=2) }}
{% endif -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' %}{% continue %}{% endif -%}
  {%- set ns.count = ns.count + 1 -%}
  {%- if message['role'] == 'assistant' -%}
    {% generation %}[A]{{ message['content'] }}{{ eos_token }}{% endgeneration %}
  {%- else -%}
    [{{ message['role'] | upper }}]{{ message['content'] }}
  {%- endif %}

{% endfor -%}
n={{ ns.count }} custom={{ custom_flag }} date={{ strftime_now('%Y') | length }}
{%- if add_generation_prompt %}[A]{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in <city> & \"region\"",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def template(tok: Tokenizer) -> ChatTemplate:
    assert tok.chat_template is not None
    return ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)


@pytest.fixture(scope="module")
def hf_tok(tok: Tokenizer):
    # transformers' own apply_chat_template on the same tokenizer and template (test-only import).
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=tok.chat_template
    )


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_smollm2_template_renders_like_transformers(template, hf_tok, name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.slow
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_template_helpers_behave_like_transformers(tok, hf_tok, tools) -> None:
    messages = [SYSTEM, USER, ASSISTANT, {"role": "user", "content": "<b>bold</b>"}]
    expected = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, tools=tools, chat_template=FEATURE_TEMPLATE,
        custom_flag=True,
    )
    ours = ChatTemplate(FEATURE_TEMPLATE, tok.bos_token, tok.eos_token)
    assert ours.render(messages, tools=tools, custom_flag=True) == expected
    if tools:
        assert '"Weather in <city> & \\"region\\""' in expected  # tojson does not HTML-escape


def test_chatml_prompt_for_the_reference_question(template: ChatTemplate) -> None:
    assert template.render([USER]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_text_content_parts_are_joined_into_a_string(template: ChatTemplate) -> None:
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    rendered = template.render([SYSTEM, {"role": "user", "content": parts}])
    assert rendered == template.render([SYSTEM, {"role": "user", "content": "What is the capital\nof France?"}])


def test_render_does_not_modify_the_callers_messages(template: ChatTemplate) -> None:
    message = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    template.render([message])
    assert message == {"role": "user", "content": [{"type": "text", "text": "hi"}]}


@pytest.mark.parametrize(
    "messages, match",
    [
        ({"role": "user", "content": "hi"}, "must be a list"),
        (["hello"], r"messages\[0\]: a message must be an object"),
        ([{"content": "no role"}], r"messages\[0\]: a message needs a string 'role'"),
        ([{"role": "user", "content": 42}], "content must be a string or a list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
            r"content\[0\]: content parts of type 'image_url' are not supported",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "needs a string 'text'"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
         r"tool_calls\[0\]\.function\.arguments is not valid JSON"),
    ],
)
def test_bad_messages_raise_chat_template_error(template: ChatTemplate, messages, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        template.render(messages)


def test_tool_call_turns_render_with_a_template_that_knows_no_tools(template: ChatTemplate) -> None:
    # An assistant turn that only calls tools has content null (or none at all); SmolLM2's template
    # concatenates message['content'], which used to fail with "'dict object' has no attribute 'content'".
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    for assistant in ({"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "assistant", "tool_calls": [call]}):
        text = template.render([{"role": "user", "content": "Weather?"}, assistant,
                                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
        assert "<|im_start|>assistant\n<|im_end|>" in text and "<|im_start|>tool\nsunny<|im_end|>" in text


def test_tool_call_arguments_reach_templates_as_objects() -> None:
    # Templates write `arguments | tojson`; OpenAI sends arguments as JSON text.
    t = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}"
                     "{{ c.function.arguments.city }}{% endfor %}{% endfor %}", None, None)
    call = {"type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    assert t.render([{"role": "assistant", "content": None, "tool_calls": [call]}]) == '{"city": "Paris"}Paris'


def test_raise_exception_in_template_becomes_chat_template_error() -> None:
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}",
        "<s>", "</s>",
    )
    with pytest.raises(ChatTemplateError, match="Conversation must start with user"):
        template.render([ASSISTANT])
    assert isinstance(ChatTemplateError("x"), ValueError)  # the HTTP layer maps ValueError-likes to 400


def test_template_syntax_error_is_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m }", "<s>", "</s>")


def test_sandbox_blocks_template_escapes() -> None:
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", "<s>", "</s>")
    with pytest.raises(ChatTemplateError):
        escape.render([USER])
    underscore = ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns._x }}", "<s>", "</s>")
    with pytest.raises(ChatTemplateError, match="namespace attribute"):
        underscore.render([USER])
    mutate = ChatTemplate("{{ messages.append(1) }}", "<s>", "</s>")
    with pytest.raises(ChatTemplateError):
        mutate.render([USER])


def test_bad_tools_raise_chat_template_error(template: ChatTemplate) -> None:
    with pytest.raises(ChatTemplateError, match="tools"):
        template.render([USER], tools="get_weather")
