"""The scale-out triad: render → ``/inference/v1/generate`` → derender answers exactly what the direct route answers.

Each composition sends one greedy request the direct way (``/v1/chat/completions``, ``/v1/completions``) and the
triad's way: the render's ``token_ids`` and ``sampling_params`` go to the generate route as they are, and its answer
(whole, or its streamed events) with the original request to the derender route. Both answers must be equal but for
ids and timestamps — whole bodies, and streams chunk by chunk — on the scripted model (a tool call, reasoning, a
stop string the generate route knows nothing of, a forced call whose grammar travels in ``sampling_params``) and on
the real SmolLM2 (a forced call). Also: derender's 400s, and the Anthropic Messages and Responses render routes,
whose ids are the ones their direct routes count as input.
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from zserve.catalog import DEFAULT_CHAT_MODEL

from . import scripted_model as sm

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def ok(r: httpx.Response) -> dict | list:
    assert r.status_code == 200, r.text
    return r.json() if r.headers["Content-Type"].startswith("application/json") else events(r)


def events(r: httpx.Response) -> list[dict]:
    """A stream's events' data, in order, up to ``[DONE]`` (which must end it)."""
    datas = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]", r.text[-500:]
    return [orjson.loads(d) for d in datas[:-1]]


def anonymous(answer):
    """An answer without what differs between two answers to the same request: ids (the response's, tool
    calls'), ``created``, and the prefix-cache hits (the direct route's engine may have the prompt cached)."""
    if isinstance(answer, list):
        return [anonymous(a) for a in answer]
    if not isinstance(answer, dict):
        return answer
    return {k: anonymous(v) for k, v in answer.items() if k not in ("id", "created", "prompt_tokens_details")}


def triad(url: str, route: str, body: dict, stream_generate: bool) -> httpx.Response:
    """``body`` rendered, generated (streamed or not) and derendered on ``route``."""
    rendered = ok(post(url, route + "/render", body))
    answers = []
    for r in rendered if isinstance(rendered, list) else [rendered]:
        gen = {"model": r["model"], "token_ids": r["token_ids"], "stream": stream_generate,
               "sampling_params": {**r["sampling_params"], "n": r["n"]}}
        answers.append(ok(post(url, "/inference/v1/generate", gen)))
    key = "chat_request" if route == "/v1/chat/completions" else "completion_request"
    generate = answers[0] if key == "chat_request" else answers
    return post(url, route + "/derender", {key: body, "generate": generate})


def check_composes(url: str, route: str, body: dict) -> dict | list:
    """The direct answer, after checking that the triad gives it with a whole and with a streamed generate."""
    direct = ok(post(url, route, body))
    for stream_generate in (False, True):
        assert anonymous(ok(triad(url, route, body, stream_generate))) == anonymous(direct), stream_generate
    return direct


@pytest.fixture(scope="module")
def scripted(scripted_server, scripted_model) -> tuple[str, str]:
    return scripted_server.url, scripted_model.name


CASES = {
    "tool-call": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather? " + sm.WEATHER_TRIGGER}],
                                           "tools": [sm.WEATHER_TOOL]}),
    "forced-call": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                             "tools": [sm.WEATHER_TOOL], "tool_choice": NAMED}),
    "reasoning": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Capital? " + sm.THINK_TRIGGER}],
                                           "logprobs": True, "top_logprobs": 2}),
    "stop-string": ("/v1/completions", {"prompt": "Tell me a story " + sm.STORY_TRIGGER, "stop": [" time"],
                                        "max_tokens": 32, "logprobs": 1}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(CASES))
def test_render_generate_derender_is_the_direct_answer(scripted, case, stream):
    url, model = scripted
    route, body = CASES[case]
    body = {**body, "model": model, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    direct = check_composes(url, route, body)
    if stream:  # what the stream says, to be sure the comparison compares something
        deltas = [c["choices"][0] for c in direct if c["choices"]]
        said = {k for d in deltas for k, v in d.get("delta", d).items() if v}
        finish = deltas[-1]["finish_reason"]
    else:
        choice = direct["choices"][0]
        said = {k for k, v in choice.get("message", choice).items() if v}
        finish = choice["finish_reason"]
    want = {"tool-call": ("tool_calls", "tool_calls"), "forced-call": ("tool_calls", "tool_calls"),
            "reasoning": ("reasoning_content", "stop"), "stop-string": ("text", "stop")}[case]
    assert want[0] in said and finish == want[1], direct
    if case == "stop-string":
        text = "".join(c["choices"][0]["text"] for c in direct if c["choices"]) if stream \
            else direct["choices"][0]["text"]
        assert text == " Once upon a"


@pytest.mark.slow
def test_smollm2_forced_call_through_the_triad_is_the_direct_answer(smollm_server):
    body = {"model": DEFAULT_CHAT_MODEL, "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
            "tools": [{"type": "function", "function": {
                "name": "get_weather", "description": "Get the current weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
            "tool_choice": "required", "temperature": 0, "max_tokens": 64}
    direct = check_composes(smollm_server.url, "/v1/chat/completions", body)
    calls = direct["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather", direct


def test_derender_refuses_what_is_not_a_whole_generate_answer(scripted):
    url, model = scripted
    chat = {"model": model, "messages": [{"role": "user", "content": "Capital? " + sm.THINK_TRIGGER}],
            "temperature": 0}
    rendered = ok(post(url, "/v1/chat/completions/render", chat))
    gen = {"model": model, "token_ids": rendered["token_ids"], "sampling_params": rendered["sampling_params"]}
    whole = ok(post(url, "/inference/v1/generate", gen))
    streamed = ok(post(url, "/inference/v1/generate", {**gen, "stream": True}))
    choice = whole["choices"][0]

    def refused(path: str, body: dict, param: str, words: str) -> None:
        r = post(url, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"]) == ("invalid_request_error", param) and words in err["message"], err

    derender = "/v1/chat/completions/derender"
    refused(derender, {"chat_request": chat}, "generate", "Field required")
    refused(derender, {"chat_request": {**chat, "messages": []}, "generate": whole}, "chat_request.messages", "")
    refused(derender, {"chat_request": chat, "generate": streamed[:-1]}, "generate", "incomplete")
    refused(derender, {"chat_request": chat, "generate": {"choices": [{**choice, "index": 1}]}}, "generate",
            "out of range")
    refused(derender, {"chat_request": chat, "generate": {"choices": [{**choice, "token_ids": [1 << 30]}]}},
            "generate", "out of range")
    refused(derender, {"chat_request": chat, "generate": [*streamed, {"error": {"message": "engine lost"}}]},
            "generate", "engine lost")
    refused(derender, {"chat_request": {**chat, "logprobs": True}, "generate": whole}, "generate", "logprobs")
    refused(derender, {"chat_request": {**chat, "prompt_logprobs": 1}, "generate": whole},
            "chat_request.prompt_logprobs", "cannot be derendered")
    refused("/v1/completions/derender", {"completion_request": {"model": model, "prompt": ["a", "b"]},
                                         "generate": [whole]}, "generate", "one per rendered prompt")


def test_messages_and_responses_render_the_ids_their_routes_count(scripted):
    """Anthropic Messages and Responses bodies render to the ids their direct routes feed the engine: as many as
    the direct answer's usage counts as input; a forced call's opening (the hermes prefill) ends the prompt, and
    its grammar travels in ``sampling_params``. Rendering a Responses turn reads the chained conversation."""
    url, model = scripted
    weather = sm.WEATHER_TOOL["function"]
    tool = {"name": weather["name"], "description": weather["description"], "input_schema": weather["parameters"]}
    messages = {"model": model, "max_tokens": 32, "temperature": 0, "system": "Be brief.", "tools": [tool],
                "messages": [{"role": "user", "content": "Weather? " + sm.WEATHER_TRIGGER}]}
    for body in (messages, {**messages, "tool_choice": {"type": "tool", "name": weather["name"]}}):
        rendered = ok(post(url, "/v1/messages/render", body))
        usage = ok(post(url, "/v1/messages", body))["usage"]
        assert len(rendered["token_ids"]) == usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
        assert rendered["request_id"].startswith("msg_") and rendered["sampling_params"]["max_tokens"] == 32
        forced = "tool_choice" in body
        assert rendered["prompt"].endswith(sm.NAMED_PREFILL) == forced
        assert (rendered["sampling_params"]["structured"] is not None) == forced

    first = {"model": model, "input": "Capital? " + sm.THINK_TRIGGER, "instructions": "Be brief.",
             "temperature": 0}
    done = ok(post(url, "/v1/responses", first))
    chained = {"model": model, "input": "And Germany?", "previous_response_id": done["id"], "temperature": 0}
    for body in (first, chained):
        rendered = ok(post(url, "/v1/responses/render", body))
        assert rendered["request_id"].startswith("resp_")
        assert len(rendered["token_ids"]) == ok(post(url, "/v1/responses", body))["usage"]["input_tokens"]
    assert sm.ANSWER in rendered["prompt"]  # the chained turn carries the first one's answer

    for path, body, param in (("/v1/messages/render", {**messages, "max_tokens": 0}, "max_tokens"),
                              ("/v1/responses/render", {**first, "previous_response_id": "resp_nope"},
                               "previous_response_id")):
        r = post(url, path, body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
