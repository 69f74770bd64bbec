"""The request-parsing microbenchmark times both labellings of the same prompt."""

from __future__ import annotations

import json
import random

import pytest

from misat_bench.parse_microbench import case, main


def test_both_labellings_parse_to_the_same_request(capsys: pytest.CaptureFixture[str]) -> None:
    header = case(64, False, random.Random(1))()
    body = case(64, True, random.Random(1))()
    assert header.meta.prompt_token_ids == body.meta.prompt_token_ids
    assert (header.meta.workload_class, header.meta.session_id, header.meta.turn) == ("rlvr", "s", 1)
    assert (body.meta.workload_class, body.meta.session_id, body.meta.turn) == ("rlvr", "s", 1)
    assert json.loads(body.body) == json.loads(header.body)  # the labels never reach the engine
    main(["--tokens", "16", "--repeat", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(float(line.split()[-4]) > 0 for line in lines[1:])
    assert "header labels" in lines[1] and "body labels" in lines[2]
