"""Stop strings are caught wherever the deltas split them, and no piece of one is ever emitted."""

from __future__ import annotations

import random

import pytest

from gateway.text.stop import StopChecker


def run(stop: list[str], deltas: list[str], include: bool = False) -> tuple[str, bool, StopChecker]:
    """Feed deltas until a stop; return (all emitted text, stopped, checker)."""
    checker = StopChecker(stop, include_stop_str_in_output=include)
    out = []
    for delta in deltas:
        text, stopped = checker.push(delta)
        out.append(text)
        if stopped:
            return "".join(out), True, checker
    out.append(checker.flush())
    return "".join(out), False, checker


def test_stop_inside_one_delta() -> None:
    assert run(["STOP"], ["Hello STOP world"])[:2] == ("Hello ", True)


def test_stop_split_across_deltas_is_caught_and_never_emitted() -> None:
    checker = StopChecker(["</answer>"])
    assert checker.push("The answer is 42</") == ("The answer is 42", False)  # "</" held back
    assert checker.push("ans") == ("", False)
    assert checker.push("wer> trailing") == ("", True)
    assert checker.matched == "</answer>"


def test_stop_split_one_character_per_delta() -> None:
    text, stopped, checker = run(["\n\nUser:"], list("Sure.\n\nUser: hi"))
    assert (text, stopped, checker.matched) == ("Sure.", True, "\n\nUser:")


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop() -> None:
    checker = StopChecker(["STOP"])
    assert checker.push("ST") == ("", False)
    assert checker.push("ART now") == ("START now", False)


def test_several_stop_strings_first_in_text_wins() -> None:
    text, stopped, checker = run(["world", "lo"], ["Hello world"])
    assert (text, stopped, checker.matched) == ("Hel", True, "lo")


def test_overlapping_prefixes_pick_the_earliest_ending_match() -> None:
    # "abd" is never completed but shares the prefix "ab" with the stop "abc"; "bx" ends first here.
    text, _, checker = run(["abc", "abd", "bx"], ["xxab", "x tail"])
    assert (text, checker.matched) == ("xxa", "bx")
    # Two stops ending at the same place: the longer (earlier starting) one is cut.
    text, _, checker = run(["bc", "abc"], ["zab", "c"])
    assert (text, checker.matched) == ("z", "abc")


def test_stop_string_that_overlaps_itself() -> None:
    # "aab" inside "aaab": the held-back tail must be the longest suffix that is a stop prefix.
    text, stopped, _ = run(["aab"], ["xa", "a", "a", "b"])
    assert (text, stopped) == ("xa", True)


def test_include_stop_str_in_output() -> None:
    text, stopped, checker = run(["END"], ["result: 7 E", "ND and more"], include=True)
    assert (text, stopped, checker.matched) == ("result: 7 END", True, "END")


def test_no_match_flush_returns_the_held_back_tail() -> None:
    checker = StopChecker(["<|stop|>"])
    assert checker.push("almost <|st") == ("almost ", False)
    assert checker.flush() == "<|st"
    assert checker.matched is None
    assert checker.flush() == ""


def test_after_a_stop_nothing_more_is_emitted() -> None:
    checker = StopChecker(["."])
    assert checker.push("One. Two.") == ("One", True)
    assert checker.push(" Three") == ("", True)
    assert checker.flush() == ""


def test_no_stop_strings_passes_text_through() -> None:
    checker = StopChecker([])
    assert checker.push("anything") == ("anything", False)
    assert StopChecker([""]).push("empty stops are ignored") == ("empty stops are ignored", False)


@pytest.mark.parametrize("seed", range(30))
def test_result_does_not_depend_on_how_text_is_split(seed: int) -> None:
    rng = random.Random(seed)
    stops = ["\n\n", "Observation:", "ion", "<|im_end|>"]
    alphabet = ["a", "b", "\n", "Obs", "ervation", ":", "i", "o", "n", "<|im", "_end|>", " "]
    full = "".join(rng.choice(alphabet) for _ in range(40))
    cuts = sorted(rng.sample(range(1, len(full)), k=min(8, len(full) - 1)))
    deltas = [full[i:j] for i, j in zip([0, *cuts], [*cuts, len(full)])]
    for include in (False, True):
        whole = run(stops, [full], include)
        split = run(stops, deltas, include)
        chars = run(stops, list(full), include)
        assert whole[:2] == split[:2] == chars[:2]
        assert whole[2].matched == split[2].matched == chars[2].matched
        if not whole[1]:
            assert whole[0] == full


# -- min_tokens: no stop string ends in the text of the first min_tokens tokens (vLLM's rule) ------------

def run_protected(stop: list[str], deltas: list[str], protected: int) -> tuple[str, bool, str | None]:
    """Feed deltas whose first ``protected`` characters (over all of them) are the first tokens' text."""
    checker = StopChecker(stop)
    out, at = [], 0
    for delta in deltas:
        text, stopped = checker.push(delta, max(0, min(len(delta), protected - at)))
        at += len(delta)
        out.append(text)
        if stopped:
            return "".join(out), True, checker.matched
    out.append(checker.flush())
    return "".join(out), False, None


def test_a_stop_string_in_the_first_tokens_text_does_not_stop() -> None:
    checker = StopChecker(["STOP"])
    assert checker.push("Hello STOP", protected=10) == ("Hello STOP", False)
    assert checker.push(" then STOP here") == (" then ", True)


def test_a_stop_string_that_begins_in_the_first_tokens_and_ends_after_them_stops() -> None:
    assert run_protected(["STOP"], ["xxST", "OP tail"], protected=4) == ("xx", True, "STOP")
    assert run_protected(["STOP"], ["xxSTOP tail"], protected=5) == ("xx", True, "STOP")


def test_a_protected_stop_string_held_back_as_a_prefix_of_a_longer_one_never_matches_later() -> None:
    # "ab" ends in protected text and is held (it begins "abc"): a later push must not match it.
    assert run_protected(["ab", "abc"], ["xab", "d"], protected=3) == ("xabd", False, None)
    assert run_protected(["ab", "abc"], ["xab", "c"], protected=3) == ("x", True, "abc")
    assert run_protected(["ab", "abc"], ["xa", "b", "cd"], protected=3) == ("x", True, "abc")


@pytest.mark.parametrize("seed", range(30))
def test_protected_result_does_not_depend_on_how_text_is_split(seed: int) -> None:
    rng = random.Random(seed)
    stops = ["\n\n", "Observation:", "ion", "ab", "abc"]
    alphabet = ["a", "b", "c", "\n", "Obs", "ervation", ":", "i", "o", "n", " "]
    full = "".join(rng.choice(alphabet) for _ in range(40))
    protected = rng.randrange(len(full) + 1)
    cuts = sorted(rng.sample(range(1, len(full)), k=min(8, len(full) - 1)))
    deltas = [full[i:j] for i, j in zip([0, *cuts], [*cuts, len(full)])]
    whole = run_protected(stops, [full], protected)
    assert whole == run_protected(stops, deltas, protected) == run_protected(stops, list(full), protected)
    # The reference: the earliest-ending occurrence (then earliest-starting) that ends past the protected text.
    found = sorted((i + len(s), i, s) for s in stops for i in range(len(full)) if full.startswith(s, i)
                   and i + len(s) > protected)
    assert whole == ((full[: found[0][1]], True, found[0][2]) if found else (full, False, None))
