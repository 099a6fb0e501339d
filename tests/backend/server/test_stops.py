"""The stop policy (backend/server/stops.py) on a real tokenizer: a request's stop strings cut the text right before
the earliest one, whatever token boundaries it spans, and a tail that may still become one is held back until it
cannot (so a streamed reply equals the unstreamed one)."""
from transformers import AutoTokenizer

from backend.server.stops import StopPolicy, StopText


def stream(policy, tokenizer, ids):
    """Push ids one token at a time as the worker does; the deltas, stopping at a match, then the flush."""
    text, deltas = StopText(policy, tokenizer), []
    for token in ids:
        deltas.append(text.push([token]))
        if text.matched is not None:
            break
    deltas.append(text.flush())
    return text, deltas


def test_the_policy_takes_a_string_a_list_or_nothing_and_drops_empty_strings():
    assert StopPolicy.of([2, 3], "END") == StopPolicy((2, 3), ("END",))
    assert StopPolicy.of((2,), ["a", "", "b"]) == StopPolicy((2,), ("a", "b"))
    assert StopPolicy.of((), None) == StopPolicy()


def test_text_is_cut_before_the_earliest_stop_string_and_a_partial_one_is_held_back(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    ids = tokenizer("the quick brown fox jumps over the lazy dog")["input_ids"]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop = full[full.index("fox") + 1:full.index("fox") + 6]  # "ox ju": spans a word boundary
    text, deltas = stream(StopPolicy.of((), [stop, "lazy"]), tokenizer, ids)
    assert "".join(deltas) == full[:full.index(stop)] and text.matched == stop
    # held back: the tokens of "ox ju" came one at a time, and had any of their text been sent before the match was
    # known, the joined deltas would go past the cut
    assert len(tokenizer(stop, add_special_tokens=False)["input_ids"]) > 1
    # with no stop string the whole text comes through, none held back at the end
    text, deltas = stream(StopPolicy(), tokenizer, ids)
    assert "".join(deltas) == full and text.matched is None
