"""Request and SamplingParams: token bookkeeping, status helpers, validation with fixes."""

import numpy as np
import pytest

from paged_jax.core.request import Request, RequestStatus, SamplingParams


def test_request_fields_and_token_bookkeeping():
    req = Request("r", np.array([5, 6, 7]), eos_token_id=2, arrival_time=1.5, mm_features=[("img", 0, 2)])
    assert req.prompt_token_ids == [5, 6, 7] and type(req.prompt_token_ids[0]) is int
    assert req.sampling_params == SamplingParams() and req.arrival_time == 1.5
    assert req.mm_features[0].identifier == "img" and req.mm_features[0].length == 2
    assert (req.status, req.num_computed_tokens, req.num_cached_tokens, req.num_preemptions) == (
        RequestStatus.WAITING, 0, -1, 0)
    req.append_output_token_ids(8)
    req.append_output_token_ids([9, 10])
    req.append_output_token_ids(np.int64(11))
    req.append_output_token_ids(np.array([12]))
    assert req.output_token_ids == [8, 9, 10, 11, 12] and req.all_token_ids == [5, 6, 7, 8, 9, 10, 11, 12]
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (8, 3, 5)
    assert not req.is_finished() and req.get_finished_reason() is None
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.is_finished() and req.get_finished_reason() == "length"
    assert RequestStatus.is_finished(RequestStatus.FINISHED_ABORTED)
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_STOPPED) == "stop"


def test_sampling_params_defaults_and_validation():
    p = SamplingParams(stop_token_ids=[2, 3], temperature=0)
    assert p.stop_token_ids == (2, 3) and p.greedy and (p.max_tokens, p.top_k, p.top_p) == (16, -1, 1.0)
    assert SamplingParams(top_k=0).top_k == 0 and SamplingParams(top_p=0.5, seed=3).seed == 3
    with pytest.raises(Exception):
        p.max_tokens = 3  # frozen
    bad = [
        (dict(max_tokens=0), "max_tokens=0 must be an int >= 1"),
        (dict(temperature=-0.1), "temperature=-0.1 must be >= 0; use 0 for greedy"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-2), "top_k=-2 must be an int >= 1, or -1 / 0 to disable"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed=1.5), "seed"),
        (dict(stop_token_ids=[1, "x"]), "stop_token_ids"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(ignore_eos=1), "ignore_eos"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        Request("r", [1], sampling_params={"max_tokens": 3})
