from pdserve.frontend.textstream import TextStream


class CharDetok:
    """One character per token id (a test double for the tokenizer's detokenizer)."""

    def __init__(self, alphabet: str) -> None:
        self.alphabet = alphabet

    def push(self, token_id: int) -> str:
        return self.alphabet[token_id]

    def flush(self) -> str:
        return ""


def feed(text: str, stop, include=False):
    ts = TextStream(CharDetok(text), stop, include)
    pieces = []
    for i in range(len(text)):
        pieces.append(ts.push(i))
        if ts.stopped:
            break
    pieces.append(ts.finish())
    return ts, pieces


def test_no_stop_passes_through():
    ts, pieces = feed("hello world", [])
    assert "".join(pieces) == "hello world" and not ts.stopped


def test_stop_across_tokens_cuts_before_and_holds_prefix():
    ts, pieces = feed("abc<END>xyz", ["<END>"])
    assert ts.stopped and ts.text == "abc" and "".join(pieces) == "abc"
    assert "<" not in "".join(pieces)


def test_partial_prefix_released_when_it_is_not_a_stop():
    ts, pieces = feed("a<Ex>b", ["<END>"])
    assert not ts.stopped and ts.text == "a<Ex>b"


def test_include_stop_and_earliest_of_several():
    ts, _ = feed("one two three", ["three", "two"], include=True)
    assert ts.text == "one two"
