"""Per-step figures from the samples alone: rollout span, tail phase, throughput, lengths, staleness."""

from __future__ import annotations

import msgspec
import pytest

from tlt_stream.basics.messages import Sample, Tensor
from tlt_stream.rl.metrics import accept_by_drafter, length_summary, rollout_timing, staleness_histogram


def sample(index: int, length: int, finished_at: float, gen_seconds: float, accept: float = 1.0) -> Sample:
    return Sample(
        sample_id=f"t/{index}",
        task_id="t",
        prompt_id="p",
        index=index,
        group_size=16,
        prompt_ids=[1],
        token_ids=Tensor.from_values([3] * length, "int32"),
        logprobs=Tensor.from_values([-0.1] * length, "float32"),
        policy_version=0,
        drafter_version=-1,
        reward=0.0,
        finish_reason="eos",
        worker_id="w",
        gen_seconds=gen_seconds,
        accept_length=accept,
        created_at=finished_at,
    )


def test_span_tail_and_throughput_follow_the_finish_times() -> None:
    # Four samples started at t=100 (gen_seconds back from their finish) and finished at 101, 102, 103, 110.
    samples = [sample(i, n, 100.0 + end, end) for i, (n, end) in enumerate([(10, 1), (20, 2), (30, 3), (40, 10)])]
    timing = rollout_timing(samples, tail_fraction=0.75)
    assert timing["rollout_seconds"] == pytest.approx(10.0)
    assert timing["tail_seconds"] == pytest.approx(7.0), "3 of 4 done at t=103; the last finished at t=110"
    assert timing["tail_share"] == pytest.approx(0.7)
    assert timing["rollout_tokens"] == 100.0 and timing["rollout_tokens_per_s"] == pytest.approx(10.0)
    half = rollout_timing(samples, tail_fraction=0.5)
    assert half["tail_seconds"] == pytest.approx(8.0), "2 of 4 done at t=102"


def test_the_earliest_start_counts_even_when_that_sample_finished_early() -> None:
    samples = [sample(0, 5, 105.0, 5.0), sample(1, 5, 106.0, 2.0)]  # started at 100 and at 104
    assert rollout_timing(samples)["rollout_seconds"] == pytest.approx(6.0)


def test_one_sample_has_no_tail_and_bad_input_is_refused() -> None:
    timing = rollout_timing([sample(0, 5, 10.0, 2.0, accept=2.5)])
    assert timing["tail_seconds"] == 0.0 and timing["accept_length_mean"] == 2.5
    with pytest.raises(ValueError, match="no samples"):
        rollout_timing([])
    with pytest.raises(ValueError, match="tail_fraction"):
        rollout_timing([sample(0, 5, 10.0, 2.0)], tail_fraction=1.0)


def test_length_summary_reports_the_long_tail() -> None:
    lengths = [10, 10, 12, 14, 15, 16, 20, 24, 30, 200]
    summary = length_summary([sample(i, n, 1.0, 1.0) for i, n in enumerate(lengths)])
    assert summary["response_len_max"] == 200.0 and summary["response_len_p50"] == 15.5
    assert summary["response_len_mean"] == pytest.approx(35.1)
    assert summary["response_len_p10"] == pytest.approx(10.0) and summary["response_len_p90"] == pytest.approx(47.0)
    assert summary["response_len_max_over_median"] == pytest.approx(200 / 15.5)


def test_staleness_histogram_counts_groups_per_lag() -> None:
    assert staleness_histogram([0, 1, 0, 2, 0]) == {"0": 3, "1": 1, "2": 1}
    assert staleness_histogram([]) == {}


def test_acceptance_is_reported_per_drafter_version_weighted_by_length() -> None:
    samples = [sample(0, 30, 1.0, 1.0, accept=3.0), sample(1, 10, 1.0, 1.0, accept=1.0)]
    samples += [msgspec.structs.replace(sample(2, 40, 1.0, 1.0, accept=4.0), drafter_version=2)]
    by_version = accept_by_drafter(samples)
    assert list(by_version) == [-1, 2]
    assert by_version[-1] == pytest.approx(40 / (10 + 10)), "30 tokens in 10 forwards + 10 tokens in 10"
    assert by_version[2] == pytest.approx(4.0)
