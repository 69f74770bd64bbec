"""Request parsing: headers and body metadata, prompts, validation errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from misat_router.errors import InvalidRequest
from misat_router.policy.settings import PrefixIndexSettings, WorkloadMix
from misat_router.request_meta import EndpointKind, _all_ints, decode_json_object, parse_request, render_messages

MIX = WorkloadMix.model_validate({"classes": [
    {"name": "rlvr", "share": 50}, {"name": "agentic", "share": 50, "multi_turn": True}]})
PREFIX = PrefixIndexSettings(chars_per_token=4.0)


def parse(body: object, headers: dict[str, str] | None = None,
          kind: EndpointKind = EndpointKind.COMPLETIONS, mix: WorkloadMix = MIX):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(raw, CIMultiDict(headers or {}), kind, mix=mix, prefix=PREFIX,
                         request_id="r1")


def test_headers_give_metadata_and_body_is_forwarded_verbatim() -> None:
    raw = b'{"prompt": [1, 2, 3], "max_tokens": 7,   "stream": true}'
    p = parse(raw, {"x-rollout-class": "agentic", "X-Session-Id": "s1", "X-Session-Turn": "4",
                    "X-Session-End": "yes"})
    m = p.meta
    assert (m.workload_class, m.session_id, m.turn, m.end_of_session) == ("agentic", "s1", 4, True)
    assert m.prompt_token_ids == (1, 2, 3) and m.prompt_tokens == 3 and m.max_tokens == 7
    assert p.stream is True and p.body == raw


def test_body_rollout_object_is_an_alternative_and_is_stripped() -> None:
    p = parse({"prompt": "abcdefgh", "rollout": {"class": "rlvr", "session_id": "g1",
                                                 "turn": 0, "end": False}})
    assert p.meta.workload_class == "rlvr" and p.meta.session_id == "g1"
    assert p.meta.prompt_text == "abcdefgh" and p.meta.prompt_tokens == 2  # 8 chars / 4
    assert json.loads(p.body) == {"prompt": "abcdefgh"}


@pytest.mark.parametrize("extra", [
    pytest.param(b'"temperature": 0.7, "stop": ["\\u00e9t\xc3\xa9", "\\n"], "seed": 18446744073709551615',
                 id="orjson-decodes"),
    pytest.param(b'"temperature": NaN, "logit_bias": {"5": -Infinity}', id="nan-and-infinity"),
    pytest.param(b'"seed": 123456789012345678901234567890', id="integer-past-64-bits"),
])
def test_a_stripped_body_keeps_every_other_value(extra: bytes) -> None:
    """Without its labels the body is written back (through orjson where orjson decoded it); what
    the engine then decodes is what the client sent, less ``rollout``, whichever decoder read it."""
    raw = b'{"prompt": [1, 2, 3], "rollout": {"class": "rlvr", "session_id": "g1"}, ' + extra + b"}"
    sent = json.loads(raw)
    del sent["rollout"]
    got = json.loads(parse(raw).body)
    assert json.dumps(got, sort_keys=True) == json.dumps(sent, sort_keys=True)  # NaN != NaN, its text is equal


def test_integers_past_64_bits_get_the_standard_librarys_verdict() -> None:
    """orjson reads them as floats, which the checks refuse; the standard library's integers pass
    here (the engine refuses such a token id or length), as they did before orjson."""
    big = 2**64
    p = parse(b'{"prompt": [1, 18446744073709551616], "max_tokens": 18446744073709551616, "rollout": {"class": "rlvr"}}')
    assert p.meta.prompt_token_ids == (1, big) and p.meta.max_tokens == big and type(p.meta.max_tokens) is int
    assert json.loads(p.body) == {"prompt": [1, big], "max_tokens": big}
    with pytest.raises(InvalidRequest, match="n must be an integer >= 1"):
        parse(b'{"prompt": [1], "n": -9223372036854775809}', {"X-Rollout-Class": "rlvr"})


def test_admin_bodies_keep_integers_past_64_bits() -> None:
    """An engine call's body goes to every engine re-encoded: its integers must stay integers."""
    obj = decode_json_object(b'{"path": "/update", "body": {"seed": 123456789012345678901234567890, "lr": 0.5}}')
    assert obj["body"] == {"seed": 123456789012345678901234567890, "lr": 0.5}
    assert type(obj["body"]["seed"]) is int


def test_chat_messages_render_to_text() -> None:
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]
    assert render_messages(msgs) == "system\nbe brief\nuser\nhi\n"
    p = parse({"messages": msgs, "max_completion_tokens": 3}, {"X-Rollout-Class": "rlvr"},
              kind=EndpointKind.CHAT)
    assert p.meta.prompt_text == "system\nbe brief\nuser\nhi\n" and p.meta.max_tokens == 3


def test_batch_prompts_count_every_prompt() -> None:
    p = parse({"prompt": [[1, 2], [3, 4, 5]]}, {"X-Rollout-Class": "rlvr"})
    assert p.meta.prompt_token_ids == (1, 2) and p.meta.prompt_tokens == 5


def test_the_sessions_engine_comes_from_a_header_or_the_body() -> None:
    header = parse({"prompt": [1]}, {"X-Rollout-Class": "agentic", "X-Session-Id": "s1", "X-Session-Turn": "2",
                                     "X-Session-Engine": "http://10.0.0.7:8000"})
    assert header.meta.engine_hint == "http://10.0.0.7:8000"
    body = parse({"prompt": [1], "rollout": {"class": "agentic", "session_id": "s1", "turn": 2,
                                             "engine": "http://10.0.0.7:8000"}})
    assert body.meta.engine_hint == "http://10.0.0.7:8000" and json.loads(body.body) == {"prompt": [1]}
    assert parse({"prompt": [1]}, {"X-Rollout-Class": "rlvr"}).meta.engine_hint is None


def test_default_class_applies_to_unlabelled() -> None:
    mix = MIX.model_copy(update={"default_class": "rlvr"})
    assert parse({"prompt": [1]}, mix=mix).meta.workload_class == "rlvr"


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        pytest.param(b"nope", {"X-Rollout-Class": "rlvr"}, None, id="bad-json"),
        pytest.param({"prompt": [1]}, {}, "rollout.class", id="no-class"),
        pytest.param({"prompt": [1]}, {"X-Rollout-Class": "x"}, "rollout.class", id="unknown"),
        pytest.param({"prompt": [1], "max_tokens": 0}, {"X-Rollout-Class": "rlvr"}, "max_tokens",
                     id="max-tokens-0"),
        pytest.param({"prompt": [1], "max_tokens": True}, {"X-Rollout-Class": "rlvr"},
                     "max_tokens", id="max-tokens-bool"),
        pytest.param({"prompt": [1], "stream": "yes"}, {"X-Rollout-Class": "rlvr"}, "stream",
                     id="stream-not-bool"),
        pytest.param({"prompt": [1, "a"]}, {"X-Rollout-Class": "rlvr"}, "prompt", id="mixed"),
        pytest.param({}, {"X-Rollout-Class": "rlvr"}, "prompt", id="no-prompt"),
        pytest.param({"prompt": [1], "rollout": {"klass": "rlvr"}}, {}, "rollout.klass",
                     id="rollout-typo"),
        pytest.param({"prompt": [1], "rollout": {"class": "agentic"}},
                     {"X-Rollout-Class": "rlvr"}, "rollout.class", id="header-body-conflict"),
        pytest.param({"prompt": [1]}, {"X-Rollout-Class": "rlvr", "X-Session-End": "maybe"},
                     "X-Session-End", id="bad-end"),
        pytest.param({"prompt": [1]}, {"X-Rollout-Class": "rlvr", "X-Session-Turn": "-1"},
                     "X-Session-Turn", id="negative-turn"),
        pytest.param({"prompt": [1]}, {"X-Rollout-Class": "rlvr", "X-Session-Engine": ""},
                     "rollout.engine", id="empty-engine"),
        pytest.param({"prompt": [1], "rollout": {"class": "rlvr", "engine": 3}}, {},
                     "rollout.engine", id="engine-not-a-string"),
        pytest.param({"prompt": [1], "rollout": {"engine": "http://a:8000"}},
                     {"X-Rollout-Class": "rlvr", "X-Session-Engine": "http://b:8000"}, "rollout.engine",
                     id="engine-header-body-conflict"),
    ],
)
def test_invalid_requests(body: object, headers: dict[str, str], param: str | None) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(body, headers)
    assert info.value.param == param
    assert info.value.error_type == "invalid_request_error"


def test_chat_requires_messages() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse({"messages": []}, {"X-Rollout-Class": "rlvr"}, kind=EndpointKind.CHAT)
    assert info.value.param == "messages"


@pytest.mark.parametrize("prompt", [
    [1, True, 3], [False], [1, 2.0], [1, "2"], [1, None], [[1, 2], [3, True]], [[1], [2.5]],
], ids=["bool", "false", "float", "str", "null", "nested-bool", "nested-float"])
def test_token_id_prompts_must_hold_integers_only(prompt: list[object]) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse({"prompt": prompt, "rollout": {"class": "rlvr"}})
    assert exc.value.param == "prompt"


def test_token_id_prompts_of_integers_are_taken_as_ids() -> None:
    assert parse({"prompt": [0, 5, 2**40], "rollout": {"class": "rlvr"}}).meta.prompt_token_ids == (0, 5, 2**40)
    batched = parse({"prompt": [[7, 8], [9]], "rollout": {"class": "rlvr"}}).meta
    assert batched.prompt_token_ids == (7, 8) and batched.prompt_tokens == 3


_JSON_ITEMS = st.one_of(
    st.integers(), st.integers(min_value=2**63, max_value=2**80), st.booleans(), st.none(),
    st.floats(allow_nan=False), st.text(max_size=3), st.lists(st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(items=st.lists(_JSON_ITEMS, min_size=1, max_size=12))
def test_all_ints_is_exact_on_any_decoded_list(items: list[object]) -> None:
    """The C-level check (the items' JSON without digits, commas and minus signs) answers as the
    plain definition does: bools, floats, strings, nulls, lists and integers past 64 bits in any mix."""
    assert _all_ints(items) == all(type(v) is int for v in items)
