"""The pure parts of misat_client: label names and shapes, the hold-retry decisions."""

from __future__ import annotations

import email.utils

import pytest

from misat_client import HoldRetry, RolloutLabels
from misat_client import labels as client_labels
from misat_client.retry import HOLD_CODE, is_held, parse_retry_after
from misat_router import proxy, request_meta
from misat_router.errors import HoldDeadlineExceeded

NOW = 1_700_000_000.0


def test_label_names_are_the_routers() -> None:
    assert client_labels.HEADER_CLASS == request_meta.HEADER_CLASS
    assert client_labels.HEADER_SESSION_ID == request_meta.HEADER_SESSION_ID
    assert client_labels.HEADER_TURN == request_meta.HEADER_TURN
    assert client_labels.HEADER_END == request_meta.HEADER_END
    assert client_labels.HEADER_ENGINE == request_meta.HEADER_ENGINE
    assert proxy.ENGINE_HEADER.decode() == client_labels.ANSWER_ENGINE_HEADER
    assert client_labels.BODY_ROLLOUT_FIELD == request_meta.BODY_ROLLOUT_FIELD
    full = RolloutLabels("agentic", "s-1", 2, end=True, engine="http://e:8000").body()
    assert set(full) == set(request_meta.ROLLOUT_KEYS)


def test_hold_code_is_the_routers() -> None:
    assert HoldDeadlineExceeded("x", retry_after_s=1).code == HOLD_CODE


def test_headers_and_body_carry_only_what_is_set() -> None:
    labels = RolloutLabels("agentic", "traj-7")
    assert labels.headers() == {"X-Rollout-Class": "agentic", "X-Session-Id": "traj-7"}
    third = labels.with_turn(3, end=True)
    assert third.headers() == {"X-Rollout-Class": "agentic", "X-Session-Id": "traj-7", "X-Session-Turn": "3",
                               "X-Session-End": "true"}
    assert third.add_to_body({"prompt": [1]}) == {
        "prompt": [1], "rollout": {"class": "agentic", "session_id": "traj-7", "turn": 3, "end": True}}
    assert RolloutLabels().headers() == {} and RolloutLabels().body() == {}
    after = labels.with_turn(4, engine="http://10.0.0.7:8000")
    assert after.headers()["X-Session-Engine"] == "http://10.0.0.7:8000"
    assert after.body()["engine"] == "http://10.0.0.7:8000"
    with pytest.raises(ValueError, match="engine"):
        RolloutLabels("agentic", "traj-7", engine="")


@pytest.mark.parametrize("bad", [{"turn": -1}, {"turn": True}, {"session_id": " "}, {"rollout_class": ""}])
def test_bad_labels_are_refused_naming_the_field(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        RolloutLabels(**bad)  # type: ignore[arg-type]


def test_session_end_path_keeps_an_odd_id_one_segment() -> None:
    assert client_labels.session_end_path("a/b c") == "/v1/sessions/a%2Fb%20c/end"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5", 5.0), (" 0 ", 0.0), ("2.5", 2.5), ("-3", 0.0), (None, None), ("soon", None), ("inf", None),
     (email.utils.formatdate(NOW + 7, usegmt=True), 7.0), (email.utils.formatdate(NOW - 7, usegmt=True), 0.0)],
)
def test_retry_after_reads_seconds_and_dates(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value, NOW) == seconds


def test_retry_policy_honours_caps_and_bounds() -> None:
    policy = HoldRetry(max_retries=2, fallback_retry_after_s=1.5, max_retry_after_s=10.0)
    assert policy.delay("4", 1, NOW) == 4.0
    assert policy.delay("600", 2, NOW) == 10.0  # capped
    assert policy.delay(None, 1, NOW) == 1.5  # no header: the fallback
    assert policy.delay("4", 3, NOW) is None  # budget spent
    assert HoldRetry(max_retries=0).delay("1", 1, NOW) is None
    with pytest.raises(ValueError, match="max_retries"):
        HoldRetry(max_retries=-1)
    with pytest.raises(ValueError, match="fallback_retry_after_s"):
        HoldRetry(fallback_retry_after_s=100.0, max_retry_after_s=60.0)


def test_only_the_hold_answer_is_retried() -> None:
    assert is_held(503, "hold_deadline_exceeded")
    assert not is_held(503, None)  # a draining router
    assert not is_held(502, "hold_deadline_exceeded")
