"""Structured output inside the engine, on the tiny random model (random weights: nothing but the
grammar's masks can make its output valid): JSON schemas, regexes and Lark grammars constrain
sampled output exactly, a complete grammar ends the request, constrained and free requests share a
batch without touching each other, compiled grammars are cached, and a grammar that cannot compile
or reaches a dead end ends its request with an error while the engine goes on."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from engine_worker.engine import Engine
from engine_worker.grammar import Grammars
from engine_worker.loader import load_model
from engine_worker.scheduler import Scheduler, run_until_done
from engine_worker.sequence import Sequence
from protocol.constants import ERR_STRUCTURED_OUTPUT
from protocol.messages import SamplingParams
from zserve.catalog import resolve
from zserve.config import EngineConfig
from zserve.grammar import choice_grammar, every_byte_vocabulary

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer):
    loaded = load_model(resolve("tiny-random"), torch.float32, CPU)
    cfg = EngineConfig(max_num_seqs=8, max_model_len=512, block_size=16)
    built = Engine.generation(loaded, CPU, torch.float32, cfg,
                              num_blocks=512, tokenizer_json=smollm2_tokenizer.backend.to_str)
    yield built
    built.grammars.close()


@pytest.fixture(scope="module")
def runner(engine):
    return engine.runner


@pytest.fixture(scope="module")
def grammars(engine):
    return engine.grammars


@pytest.fixture
def prompt(smollm2_tokenizer):
    return smollm2_tokenizer.encode("<|im_start|>user\nAnswer in JSON.<|im_end|>\n<|im_start|>assistant\n")


def run(runner, grammars, requests: list[SamplingParams], prompt: list[int]) -> dict[str, list[int]]:
    sched = Scheduler(runner, 8, 256, grammars=grammars)
    for i, sp in enumerate(requests):
        assert sched.add(Sequence(f"r{i}", list(prompt), sp)) is None
    outs = run_until_done(sched)
    return {rid: [t for o in o_list for t in o.new_token_ids] for rid, o_list in outs.items()} | {
        f"{rid}:finish": o_list[-1].finish_reason for rid, o_list in outs.items()}


def text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
     "minItems": 1, "maxItems": 3}, "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
     "required": ["ok"], "additionalProperties": False}}, "required": ["tags", "inner"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 4},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "nested", "array"])
def test_sampled_output_follows_the_json_schema_and_ends_with_it(runner, grammars, prompt, smollm2_tokenizer, schema):
    sp = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured=("json", json.dumps(schema)))
          for s in range(4)]
    out = run(runner, grammars, sp, prompt)
    for i in range(4):
        assert out[f"r{i}:finish"] == "stop"
        value = json.loads(text(smollm2_tokenizer, out[f"r{i}"]))
        jsonschema.validate(value, schema)


def test_regex_and_choice_constrain_the_whole_output(runner, grammars, prompt, smollm2_tokenizer):
    regex = r"[A-Z][a-z]{2,6}-\d{3}"
    choices = ["positive", "negative", "it's \"neutral\""]
    sp = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured=("regex", regex)) for s in range(3)]
    sp += [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured=("lark", choice_grammar(choices)))
           for s in range(3)]
    out = run(runner, grammars, sp, prompt)
    for i in range(3):
        assert re.fullmatch(regex, text(smollm2_tokenizer, out[f"r{i}"])), text(smollm2_tokenizer, out[f"r{i}"])
        assert text(smollm2_tokenizer, out[f"r{i + 3}"]) in choices
        assert out[f"r{i}:finish"] == out[f"r{i + 3}:finish"] == "stop"


def test_a_constrained_request_leaves_its_batch_mates_alone(runner, grammars, prompt):
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    alone = run(runner, grammars, [free], prompt)["r0"]
    mixed = run(runner, grammars, [
        SamplingParams(temperature=1.0, seed=1, max_tokens=24, structured=("json", json.dumps(SCHEMAS[0]))),
        free,
        SamplingParams(temperature=0.0, max_tokens=24, structured=("regex", r"\d+")),
    ], prompt)
    assert mixed["r1"] == alone


def test_greedy_and_logprobs_see_only_the_allowed_tokens(runner, grammars, prompt, smollm2_tokenizer):
    sched = Scheduler(runner, 8, 256, grammars=grammars)
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, structured=("regex", "(yes|no)"))
    assert sched.add(Sequence("r", list(prompt), sp)) is None
    outs = run_until_done(sched)["r"]
    assert text(smollm2_tokenizer, [t for o in outs for t in o.new_token_ids]) in ("yes", "no")
    first = outs[0]
    allowed_first = {smollm2_tokenizer.decode([t]) for t in first.top_logprobs.token_ids
                     if first.top_logprobs.logprobs[first.top_logprobs.token_ids.index(t)] > float("-inf")}
    assert allowed_first and all("yes".startswith(s) or "no".startswith(s) for s in allowed_first)


def test_a_grammar_is_compiled_once_and_compiling_does_not_hold_back_other_requests(runner, grammars, prompt):
    schema = json.dumps({"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"],
                         "additionalProperties": False, "description": "unique to this test"})
    before = grammars.compiled
    out = run(runner, grammars, [SamplingParams(temperature=1.0, seed=s, max_tokens=30, structured=("json", schema))
                                 for s in range(4)], prompt)
    assert all(out[f"r{i}:finish"] == "stop" for i in range(4))
    assert grammars.compiled == before + 1

    # A compile that cannot finish yet: the free request runs to its end meanwhile.
    gate = threading.Event()
    slow = Grammars(lambda: (gate.wait(30), grammars._tokenizer_json())[1], runner.vocab_size, runner.eos_token_ids)
    try:
        sched = Scheduler(runner, 8, 256, grammars=slow)
        assert sched.add(Sequence("c", list(prompt), SamplingParams(max_tokens=20, structured=("regex", r"\d+")))) \
            is None
        assert sched.add(Sequence("f", list(prompt), SamplingParams(max_tokens=5, ignore_eos=True))) is None
        finished = set()
        for _ in range(20):
            finished |= {o.request_id for o in sched.step() if o.finish_reason}
        assert finished == {"f"} and [s.request_id for s in sched.waiting] == ["c"]
        gate.set()
        outs = run_until_done(sched)
        assert outs["c"][-1].finish_reason in ("stop", "length")
    finally:
        gate.set()
        slow.close()


def test_a_spec_that_does_not_compile_fails_its_request_not_the_engine(runner, grammars, prompt):
    sched = Scheduler(runner, 8, 256, grammars=grammars)
    assert sched.add(Sequence("bad", list(prompt), SamplingParams(structured=("regex", "(unclosed")))) is None
    assert sched.add(Sequence("ok", list(prompt), SamplingParams(max_tokens=3, ignore_eos=True))) is None
    sched.waiting[0].grammar.wait(30)
    outs = {}
    while sched.has_work:
        for o in sched.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["bad"][-1].finish_reason == "error" and "regex" in outs["bad"][-1].error
    assert outs["ok"][-1].finish_reason == "length" and len(outs["ok"]) == 3


def test_a_dead_end_ends_the_request_with_an_error(runner, grammars, prompt):
    """min_tokens cannot outlast a complete grammar: here the grammar wins and the request stops;
    a matcher fed a token it does not allow (a dead end) ends the request with an error."""
    sched = Scheduler(runner, 8, 256, grammars=grammars)
    sp = SamplingParams(temperature=1.0, max_tokens=10, min_tokens=5, structured=("regex", "ab"))
    assert sched.add(Sequence("r", list(prompt), sp)) is None
    outs = run_until_done(sched)["r"]
    assert outs[-1].finish_reason == "stop" and len(outs) <= 2

    handle = grammars.start(("regex", "ab"))
    assert handle.wait(30)
    assert handle.accept(runner.eos_token_ids[0]) == "error" and "does not continue" in handle.error


def test_engines_without_grammars_refuse_structured_requests(runner, prompt):
    sched = Scheduler(runner, 8, 256)
    err = sched.add(Sequence("r", list(prompt), SamplingParams(structured=("regex", "a"))))
    assert err is not None and "structured output" in err


# -- what the grammar engine is given of the vocabulary ---------------------------------------------

def test_the_grammar_engine_sees_every_token_as_the_tokenizer_decodes_it(grammars, smollm2_tokenizer):
    """Byte-level BPE spells raw bytes as Latin-1-looking characters (GPT-2's table); llguidance must map
    every token of the real SmolLM2 vocabulary to the very bytes the tokenizer decodes it to."""
    llt = grammars.prepare().result(60)
    tok = smollm2_tokenizer
    for i in range(tok.vocab_size):
        expected = tok.token_bytes(i)
        if i in tok.all_special_ids:  # llguidance marks special tokens with a leading 0xFF
            assert llt.decode_bytes([i]).removeprefix(b"\xff") == expected, i
        else:
            assert llt.decode_bytes([i]) == expected, (i, tok.convert_ids_to_tokens([i]))
    # Past the model's vocabulary: one placeholder per byte the vocabulary has no one-byte token for.
    own = {tok.token_bytes(i) for i in range(tok.vocab_size)}
    placeholders = [llt.decode_bytes([i]) for i in range(tok.vocab_size, grammars.mask_size)]
    # (0xFF, never in UTF-8, is llguidance's mark of a special token: no grammar can ask for it.)
    assert sorted(placeholders) == sorted(bytes([b]) for b in range(255) if bytes([b]) not in own)
    assert bytes([0xF1]) in placeholders and bytes([0xF0]) not in placeholders


def test_placeholders_shift_no_added_token_past_the_vocabulary(smollm2_tokenizer):
    """``tokenizers`` numbers an added token its model's vocabulary lacks from the vocabulary's size on: placeholders
    appended to the vocabulary shifted them (a forced call's closing text became another token)."""
    import llguidance
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(smollm2_tokenizer.backend.to_str())
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("\n</call>", "[story]", "It is.")])
    size = backend.get_vocab_size(with_added_tokens=True)
    plain = llguidance.LLTokenizer(backend.to_str(), n_vocab=size, eos_token=[2])
    tokenizer_json, grown = every_byte_vocabulary(backend.to_str(), size)
    spelled = llguidance.LLTokenizer(tokenizer_json, n_vocab=grown, eos_token=[2])
    assert grown > size and all(plain.decode_bytes([i]) == spelled.decode_bytes([i]) for i in range(size))
    for text in (b"\n</call>", b"a [story] It is.", "\U0006AA2B[story]".encode()):
        assert spelled.decode_bytes(spelled.tokenize_bytes(text)) == text
    assert spelled.tokenize_bytes(b"\n</call>") == [backend.token_to_id("\n</call>")]


@pytest.mark.parametrize("text", [bytes([b]) for b in range(255)] + [
    "\U0006AA2B".encode(), "x\U0006AA2By".encode(), "caf\u00e9 \u4e2d \U0001F600".encode(), b"\x04\x06\x13"])
def test_the_grammar_engine_tokenizes_every_byte_without_dropping_one(grammars, text):
    """The bytes a grammar forces are tokenized by llguidance with the model's tokenizer, which dropped the
    bytes it has no token for (F1 of U+6AA2B: the forced token then did not continue the grammar)."""
    llt = grammars.prepare().result(60)
    assert llt.decode_bytes(llt.tokenize_bytes(text)) == text


@pytest.mark.parametrize("regex", ["\U0006AA2B", "(a|b)\U0006AA2B", "[\U00040000-\U000BFFFF]", "\x04"])
def test_a_grammar_needing_a_byte_no_token_holds_ends_with_a_structured_output_error(runner, grammars, prompt,
                                                                                      smollm2_tokenizer, regex):
    """Never a wrong token and never a silent empty "stop": the request ends at the dead end with an error the
    gateway answers as the request's fault (400), and the engine goes on."""
    sched = Scheduler(runner, 8, 256, grammars=grammars)
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=20, structured=("regex", regex))
    assert sched.add(Sequence("r", list(prompt), sp)) is None
    assert sched.add(Sequence("ok", list(prompt), SamplingParams(max_tokens=3, ignore_eos=True))) is None
    outs: dict[str, list] = {}
    while sched.has_work:
        for o in sched.step():
            outs.setdefault(o.request_id, []).append(o)
    last = outs["r"][-1]
    assert last.finish_reason == "error" and last.error_code == ERR_STRUCTURED_OUTPUT
    assert "no token that continues the grammar" in last.error
    written = [t for o in outs["r"][:-1] for t in o.new_token_ids]
    assert text(smollm2_tokenizer, written) in ("", "a", "b")
    assert outs["ok"][-1].finish_reason == "length"


@pytest.mark.parametrize("cut", [1, 5, 12])
def test_a_migrated_request_replays_its_tokens_and_goes_on_under_its_grammar(runner, grammars, prompt,
                                                                             smollm2_tokenizer, cut):
    """The tokens a request generated on an engine it lost come with it (``Sequence.output_ids``): a fresh matcher
    takes them, and the seeded draws after them are the ones the uninterrupted run made."""
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=200, structured=("json", json.dumps(SCHEMAS[1])))
    whole = run(runner, grammars, [sp], prompt)["r0"]
    assert len(whole) > cut
    sched = Scheduler(runner, 8, 256, grammars=grammars)
    assert sched.add(Sequence("moved", list(prompt), sp, output_ids=whole[:cut])) is None
    outs = run_until_done(sched)["moved"]
    assert whole[:cut] + [t for o in outs for t in o.new_token_ids] == whole
    assert outs[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(text(smollm2_tokenizer, whole)), SCHEMAS[1])


def test_generated_tokens_the_grammar_refuses_fail_the_migrated_request_not_the_engine(runner, grammars, prompt,
                                                                                       smollm2_tokenizer):
    sp = SamplingParams(temperature=0.0, max_tokens=50, structured=("regex", r"\d+"))
    sched = Scheduler(runner, 8, 256, grammars=grammars)
    assert sched.add(Sequence("bad", list(prompt), sp, output_ids=smollm2_tokenizer.encode("abc"))) is None
    assert sched.add(Sequence("good", list(prompt), sp, output_ids=smollm2_tokenizer.encode("12"))) is None
    done: dict = {}
    while sched.has_work:
        for o in sched.step():
            done.setdefault(o.request_id, []).append(o)
    assert done["bad"][-1].finish_reason == "error" and done["bad"][-1].error_code == ERR_STRUCTURED_OUTPUT
    assert "does not continue the grammar" in done["bad"][-1].error
    assert re.fullmatch(r"\d+", "12" + text(smollm2_tokenizer, [t for o in done["good"] for t in o.new_token_ids]))
