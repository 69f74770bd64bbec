"""Usage read off engine answers (router/usage.py): JSON answers from the tail, streams by bytes."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from misat_router.json_codec import decode, holds_overflow, loads
from misat_router.policy.types import Completion, RequestMeta
from misat_router.usage import SseUsageTracker, find_top_level_usage, usage_from_json

META = RequestMeta("r1", "rlvr", prompt_tokens=11)
USAGE = {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3,
         "prompt_tokens_details": {"cached_tokens": 2}}


def vllm_completion(usage: object = USAGE, text: str = " hello", **extra: object) -> dict[str, object]:
    """A vLLM /v1/completions answer, members in vLLM's order."""
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                         "stop_reason": None, "prompt_logprobs": None}],
            "service_tier": None, "system_fingerprint": None, "usage": usage, "kv_transfer_params": None,
            **extra}


def compact(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def test_vllm_answer_compact_and_spaced() -> None:
    for dump in (compact, lambda o: json.dumps(o).encode(), lambda o: json.dumps(o, indent=2).encode()):
        body = dump(vllm_completion())
        assert find_top_level_usage(body) == (True, USAGE)
        assert usage_from_json(body, META, ok=True) == Completion(5, 3, 2, ok=True)


def test_usage_without_details_and_null_details() -> None:
    u = {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": None}
    assert usage_from_json(compact(vllm_completion(u)), META, ok=True) == Completion(4, 1, None, ok=True)


def test_usage_missing_is_estimated() -> None:
    body = compact({k: v for k, v in vllm_completion().items() if k != "usage"})
    assert find_top_level_usage(body) == (False, None)
    assert usage_from_json(body, META, ok=True) == Completion(11, 0, None, ok=True)


def test_usage_null_is_estimated() -> None:
    body = compact(vllm_completion(None))
    assert find_top_level_usage(body) == (True, None)
    assert usage_from_json(body, META, ok=False) == Completion(11, 0, None, ok=False)


def test_usage_before_choices() -> None:
    obj = vllm_completion()
    reordered = {"usage": obj["usage"], **{k: v for k, v in obj.items() if k != "usage"}}
    assert usage_from_json(compact(reordered), META, ok=True) == Completion(5, 3, 2, ok=True)


def test_strings_holding_usage_are_not_usage() -> None:
    fake = '{"usage": {"prompt_tokens": 99, "completion_tokens": 99}}'
    for text in (fake, '"usage":{"prompt_tokens":1,"completion_tokens":1}}', 'a\\"usage":{', '\\'):
        body = compact(vllm_completion(text=text))
        assert usage_from_json(body, META, ok=True) == Completion(5, 3, 2, ok=True), text
        # ... and where the answer has no usage of its own, the text's is never taken.
        body = compact({k: v for k, v in vllm_completion(text=text).items() if k != "usage"})
        assert usage_from_json(body, META, ok=True) == Completion(11, 0, None, ok=True), text


def test_nested_usage_after_the_top_level_one_is_not_taken() -> None:
    nested = {"usage": {"prompt_tokens": 77, "completion_tokens": 77}}
    body = compact(vllm_completion(kv_transfer_params=nested))
    assert usage_from_json(body, META, ok=True) == Completion(5, 3, 2, ok=True)
    body = compact({**{k: v for k, v in vllm_completion().items() if k != "usage"}, "kv_transfer_params": nested})
    assert usage_from_json(body, META, ok=True) == Completion(11, 0, None, ok=True)


def test_error_answers_and_garbage() -> None:
    err = compact({"object": "error", "message": "bad", "type": "BadRequestError", "param": None, "code": 400})
    assert usage_from_json(err, META, ok=False) == Completion(11, 0, None, ok=False)
    for body in (b"", b"not json", b'{"usage": {"prompt_tokens": 1,', b"[1, 2]", b'"usage"'):
        assert usage_from_json(body, META, ok=False) == Completion(11, 0, None, ok=False)


def test_big_integers_and_what_only_the_standard_decoder_takes() -> None:
    body = compact(vllm_completion(kv_transfer_params={"seed": 2**80}))
    assert usage_from_json(body, META, ok=True) == Completion(5, 3, 2, ok=True)
    # orjson reads an integer past 64 bits as a float (`==` would not tell: 2.0**64 == 2**64);
    # holds_overflow finds it, for the callers to which the type matters (request_meta.py).
    value, by_orjson = decode(b'{"a": 18446744073709551616, "b": [-9223372036854775809]}')
    assert by_orjson and type(value["a"]) is float and holds_overflow(value)
    assert not holds_overflow(decode(b'{"a": 18446744073709551615, "b": [-9223372036854775808, 1e18]}')[0])
    assert loads(b'\xef\xbb\xbf{"a": NaN}')["a"] != 0  # BOM and NaN: json.loads takes both


# Random objects with "usage" keys and look-alike strings anywhere: the tail reading must
# agree with decoding the whole body whenever it decides.
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(
    alphabet=st.sampled_from(list('usage"\\{}[]:, ab\n')), max_size=12))
_usage = st.one_of(st.none(), st.fixed_dictionaries(
    {"prompt_tokens": st.integers(0, 10**6), "completion_tokens": st.integers(0, 10**6)},
    optional={"prompt_tokens_details": st.one_of(st.none(), st.fixed_dictionaries(
        {"cached_tokens": st.integers(0, 10**6)}))}))
_json = st.recursive(_leaf, lambda kids: st.one_of(
    st.lists(kids, max_size=3),
    st.dictionaries(st.sampled_from(["usage", "a", "choices", 'us"age', "usage\\"]), kids, max_size=3)),
    max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(before=st.dictionaries(st.sampled_from(["id", "choices", "x"]), _json, max_size=3),
       usage=st.one_of(st.just("absent"), _usage),
       after=st.dictionaries(st.sampled_from(["kv_transfer_params", "y"]), _json, max_size=2),
       indent=st.sampled_from([None, 1]))
def test_tail_reading_agrees_with_a_full_decode(before: dict[str, object], usage: object,
                                               after: dict[str, object], indent: int | None) -> None:
    obj = dict(before)
    if usage != "absent":
        obj["usage"] = usage
    obj.update(after)
    body = json.dumps(obj, indent=indent).encode()
    found, value = find_top_level_usage(body)
    if found:
        assert value == json.loads(body).get("usage")
    expected = json.loads(body).get("usage")
    got = usage_from_json(body, META, ok=True)
    if isinstance(expected, dict):
        assert (got.prompt_tokens, got.completion_tokens) == (expected["prompt_tokens"], expected["completion_tokens"])
    else:
        assert got == Completion(11, 0, None, ok=True)


# ---- streams ----------------------------------------------------------------------------


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else compact(e)) + b"\n\n" for e in events)


def chunk(text: str, finish: str | None = None, index: int = 0) -> dict[str, object]:
    return {"id": "cmpl-9", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish,
                         "stop_reason": None}]}


def final_usage() -> dict[str, object]:
    return {"id": "cmpl-9", "object": "text_completion", "created": 1, "model": "m", "choices": [],
            "usage": USAGE}


def test_stream_final_usage_chunk_and_done() -> None:
    t = SseUsageTracker()
    t.feed(sse(chunk("a"), chunk("b"), chunk("c", "length"), final_usage(), b"[DONE]"))
    assert t.stream_id == "cmpl-9" and t.finished == {0} and t.events == 3
    assert t.completion(META, ok=True) == Completion(5, 3, 2, ok=True)
    assert not t.mid_event


def test_stream_without_usage_counts_content_events() -> None:
    t = SseUsageTracker()
    t.feed(sse(chunk("a"), chunk("b"), b"[DONE]"))
    assert t.completion(META, ok=True) == Completion(11, 2, None, ok=True)


def test_stream_chunk_boundaries_anywhere() -> None:
    data = sse(chunk('say "usage": {'), chunk("b", "stop"), final_usage(), b"[DONE]").replace(b"\n", b"\r\n")
    for size in (1, 2, 3, 7, 64):
        t = SseUsageTracker()
        for i in range(0, len(data), size):
            t.feed(data[i:i + size])
        assert t.completion(META, ok=True) == Completion(5, 3, 2, ok=True), size
        assert t.events == 2 and t.finished == {0} and t.stream_id == "cmpl-9"


def test_stream_cut_mid_event_is_noticed() -> None:
    data = sse(chunk("a"), final_usage())
    t = SseUsageTracker()
    t.feed(data[:-5])
    assert t.mid_event and t.usage is None  # the usage event never completed
    t.feed(data[-5:])
    assert not t.mid_event and t.usage == USAGE


def test_stream_content_mentioning_usage_and_continuous_usage() -> None:
    t = SseUsageTracker()
    spoof = chunk('"usage": {"prompt_tokens": 1, "completion_tokens": 1}')
    first = {**chunk("x"), "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
    later = {**chunk("y"), "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    t.feed(sse(first, spoof, later, {**chunk("z"), "usage": None}, b"[DONE]"))
    assert t.usage == {"prompt_tokens": 5, "completion_tokens": 2}  # the last object, never the text's
    assert t.events == 4


def test_stream_several_choices_finish_separately() -> None:
    t = SseUsageTracker()
    t.feed(sse(chunk("a", index=0), chunk("b", index=1), chunk("c", "stop", index=1)))
    assert t.finished == {1}
    t.feed(sse(chunk("d", "length", index=0)))
    assert t.finished == {0, 1}


def test_stream_content_events_are_counted_without_decoding() -> None:
    t = SseUsageTracker()
    t.feed(sse(chunk("first")))  # the stream's id comes from its first event
    body = sse(*(chunk(f"line {i}\ndata: not an event") for i in range(50)))
    for i in range(0, len(body), 1000):  # several events per piece, and pieces cut mid-event
        t.feed(body[i:i + 1000])
    t.feed(sse(chunk("end", "stop"), final_usage(), b"[DONE]"))
    assert t.events == 52 and t.finished == {0} and t.usage == USAGE and t.stream_id == "cmpl-9"
