import pytest

from pdserve.frontend.protocol import ApiError, parse_chat, parse_completion


def err(fn, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(body)
    assert e.value.status == 400
    return e.value


def test_completion_prompt_forms():
    assert parse_completion({"prompt": "hi"}).prompts == ("hi",)
    assert parse_completion({"prompt": [1, 2]}).prompts == ((1, 2),)
    assert parse_completion({"prompt": ["a", "b"]}).prompts == ("a", "b")
    assert parse_completion({"prompt": [[1], [2, 3]]}).prompts == ((1,), (2, 3))


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_p": 1.01}, "top_p"),
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": "x", "temperature": True}, "temperature"),
    ],
)
def test_completion_bad_input(body, param):
    assert err(parse_completion, body).param == param


def test_not_an_object():
    assert "JSON object" in err(parse_completion, [1, 2]).message


def test_chat_messages_normalised_and_checked():
    spec = parse_chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 3,
        }
    )
    assert spec.messages[0]["content"] == "ab" and spec.params.max_tokens == 5
    assert spec.params.logprobs == 3
    assert err(parse_chat, {"messages": []}).param == "messages"
    assert err(parse_chat, {"messages": [{"role": "wizard", "content": "x"}]}).param == "messages"
    assert err(parse_chat, {"messages": [{"role": "user", "content": 3}]}).param == "messages"
    assert (
        err(parse_chat, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).param
        == "top_logprobs"
    )
