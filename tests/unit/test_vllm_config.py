"""SD arms and sampling settings translated to vLLM's dicts (pure code: no vLLM needed).

Field names and rules checked here were read in vLLM 0.33.0 (wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64,
`vllm/_version.py` commit id g4ba787ec9): `SpeculativeConfig` in vllm/config/speculative.py (a pydantic
dataclass that forbids unknown fields), `EngineArgs` in vllm/engine/arg_utils.py, `SamplingParams` in
vllm/sampling_params.py, the batch-size schedule rules in vllm/v1/spec_decode/dynamic/utils.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.switch import DEFAULT_EDGES, SdSwitch, bucket_of
from tlt_stream.rollout.vllm.config import (
    SpecTranslation,
    UnsupportedSetting,
    dynamic_schedule,
    expressible,
    llm_kwargs,
    sampling_params,
    speculative_config,
)

# Fields of vLLM 0.33.0 our translations use, each checked to exist there (a new key must be added here
# only after checking it in vLLM's source).
SPECULATIVE_FIELDS = {
    "method",
    "model",
    "num_speculative_tokens",
    "draft_sample_method",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "num_speculative_tokens_per_batch_size",
}
ENGINE_ARGS = {
    "model",
    "skip_tokenizer_init",
    "max_num_seqs",
    "max_model_len",
    "dtype",
    "seed",
    "logprobs_mode",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "enforce_eager",
    "speculative_config",
    "per_request_spec_decode_metrics",
    "worker_extension_cls",
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "kv_cache_memory_bytes",
    "distributed_executor_backend",
    "scheduler_cls",
}
SAMPLING_FIELDS = {
    "n",
    "temperature",
    "top_p",
    "seed",
    "max_tokens",
    "ignore_eos",
    "stop_token_ids",
    "logprobs",
    "detokenize",
    "stop",
    "include_stop_str_in_output",
}


def vllm_schedule_lookup(schedule: list[tuple[int, int, int]], max_batch: int, max_k: int) -> list[int]:
    """vLLM's `validate_and_normalize_dynamic_sd_schedule` + `build_dynamic_sd_schedule_lookup`, restated:
    ranges (start, end, K) inclusive, positive, start <= end, K >= 0, sorted and non-overlapping, the first
    starting at 1; gaps carry the previous K; K capped at num_speculative_tokens; index = batch size."""
    assert schedule, "must not be empty"
    previous_end = 0
    for start, end, k in schedule:
        assert start > 0 and end > 0 and start <= end and k >= 0, (start, end, k)
        assert start > previous_end, "ranges must be sorted and non-overlapping"
        previous_end = end
    assert schedule[0][0] == 1, "the first range must start at 1"
    lookup = [0] * (max_batch + 1)
    last = None
    for b in range(1, max_batch + 1):
        for start, end, k in schedule:
            if start <= b <= end:
                last = k
                break
        lookup[b] = min(max_k, last if last is not None else 0)
    return lookup


# ---------------------------------------------------------------------------------------------------- arms


def test_an_eagle_chain_becomes_vllms_eagle_config_with_the_draft_sampling_of_the_temperature() -> None:
    greedy = speculative_config("d4k1v4", drafter="/x/eagle", temperature=0.0)
    assert greedy == SpecTranslation(
        {"method": "eagle", "model": "/x/eagle", "num_speculative_tokens": 4, "draft_sample_method": "greedy"}
    )
    sampled = speculative_config(Arm.drafter(3, 1, 3), drafter="/x/eagle", temperature=1.0)
    assert sampled is not None and sampled.config["draft_sample_method"] == "probabilistic"
    assert sampled.config["num_speculative_tokens"] == 3 and sampled.notes == ()
    assert set(sampled.config) <= SPECULATIVE_FIELDS


def test_a_vllm_without_draft_sample_method_drafts_greedily_and_says_so() -> None:
    older = SPECULATIVE_FIELDS - {"draft_sample_method", "num_speculative_tokens_per_batch_size"}
    t = speculative_config(Arm.drafter(2, 1, 2), drafter="d", temperature=0.7, available=older)
    assert t is not None and "draft_sample_method" not in t.config
    assert len(t.notes) == 1 and "greedily" in t.notes[0]
    exact = speculative_config(Arm.drafter(2, 1, 2), drafter="d", temperature=0.0, available=older)
    assert exact is not None and exact.notes == ()  # greedy drafting is what we do at T = 0


def test_plain_is_no_speculation_and_ngram_maps_to_prompt_lookup() -> None:
    assert speculative_config("plain", temperature=1.0) is None
    t = speculative_config("ngram-d6", temperature=1.0)
    assert t is not None
    assert t.config == {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert "earliest" in t.notes[0]


@pytest.mark.parametrize(
    ("arm", "needle"),
    [
        ("d4k2v8", "no EAGLE tree drafting"),
        ("d6k4v16", "use a chain such as d6k1v6"),
        ("d4k1v2", "use d2k1v2"),
        ("group-d4v8", "verify must equal depth: group-d4v4"),
        ("d4k2v8+g8", "group drafts do not merge"),
        ("d6k1v6|g12", "group drafts do not merge"),
    ],
)
def test_arms_vllm_cannot_run_are_refused_with_what_to_use(arm: str, needle: str) -> None:
    assert needle in (expressible(arm) or "")
    with pytest.raises(UnsupportedSetting, match=needle):
        speculative_config(arm, drafter="d", temperature=1.0)


def test_group_drafts_are_vllms_custom_proposer_at_one_depth() -> None:
    from tlt_stream.rollout.vllm.config import dynamic_schedule
    from tlt_stream.rollout.vllm.group import GROUP_PROPOSER

    t = speculative_config("group-d6v6", temperature=1.0)
    assert t is not None
    assert t.config == {"method": "custom_class", "model": GROUP_PROPOSER, "num_speculative_tokens": 6}
    with pytest.raises(UnsupportedSetting, match="not told the step's chain length"):
        dynamic_schedule({0: "group-d6v6", 1: "plain"}, max_num_seqs=8)


def test_an_eagle_arm_needs_the_export() -> None:
    assert expressible("d4k1v4") is None
    with pytest.raises(UnsupportedSetting, match="exported directory"):
        speculative_config("d4k1v4", temperature=0.0)


# ------------------------------------------------------------------------------------------ batch schedule


def test_a_switch_and_per_bucket_chains_become_vllms_batch_size_schedule() -> None:
    table = {0: "d6k1v6", 1: "d6k1v6", 2: "d4k1v4", 3: "d2k1v2", 4: "plain"}
    method, k, schedule = dynamic_schedule(table, max_num_seqs=64, switch_threshold=7)
    assert method == "eagle" and k == 6
    assert schedule == [(1, 2, 6), (3, 4, 4), (5, 7, 2), (8, 64, 0)]
    lookup = vllm_schedule_lookup(schedule, 64, k)
    assert [lookup[b] for b in (1, 2, 3, 4, 5, 7, 8, 16, 64)] == [6, 6, 4, 4, 2, 2, 0, 0, 0]


def test_the_switch_band_is_resolved_to_off() -> None:
    """vLLM's schedule is a function of the batch size: where our SdSwitch keeps its state (the band
    threshold < b <= threshold + margin), the schedule says off, and it agrees with the switch elsewhere."""
    switch = SdSwitch(threshold=6, margin=3)
    _, k, schedule = dynamic_schedule({0: "d4k1v4"}, max_num_seqs=32, edges=(), switch_threshold=switch.threshold)
    lookup = vllm_schedule_lookup(schedule, 32, k)
    for b in range(1, 33):
        if b <= switch.threshold or b > switch.off_above:
            assert (lookup[b] > 0) == SdSwitch(switch.threshold, switch.margin).update(b), b
        else:
            assert lookup[b] == 0, b


@settings(max_examples=200, deadline=None)
@given(
    edges=st.lists(st.integers(1, 80), min_size=1, max_size=7, unique=True).map(sorted),
    depths=st.lists(st.integers(0, 8), min_size=1, max_size=8),
    max_num_seqs=st.integers(1, 96),
    threshold=st.one_of(st.none(), st.integers(0, 100)),
    ngram=st.booleans(),
)
def test_the_schedule_gives_every_batch_size_the_arm_of_its_bucket(
    edges: list[int], depths: list[int], max_num_seqs: int, threshold: int | None, ngram: bool
) -> None:
    """For every running batch size, vLLM's lookup of our schedule drafts the chain length of the arm the
    table gives its bucket (`tuner.bucket_of`), 0 for plain or missing buckets and above the switch."""
    table = {
        bucket: Arm.plain() if d == 0 else (Arm.ngram(d) if ngram else Arm.drafter(d, 1, d))
        for bucket, d in enumerate(depths)
    }

    def wanted(b: int) -> int:
        arm = table.get(bucket_of(b, edges))
        on = threshold is None or b <= threshold
        return arm.depth if arm is not None and on else 0

    if not any(wanted(b) for b in range(1, max_num_seqs + 1)):
        with pytest.raises(UnsupportedSetting):
            dynamic_schedule(table, max_num_seqs=max_num_seqs, edges=edges, switch_threshold=threshold)
        return
    method, k, schedule = dynamic_schedule(table, max_num_seqs=max_num_seqs, edges=edges, switch_threshold=threshold)
    assert method == ("ngram" if ngram else "eagle")
    lookup = vllm_schedule_lookup(schedule, max_num_seqs, k)
    assert lookup[1:] == [wanted(b) for b in range(1, max_num_seqs + 1)]
    assert k == max(lookup) and schedule[-1][1] == max_num_seqs
    assert all(a[2] != b[2] for a, b in itertools.pairwise(schedule)), "neighbours merged"


def test_tables_vllm_cannot_run_are_refused() -> None:
    with pytest.raises(UnsupportedSetting, match="one speculative method"):
        dynamic_schedule({0: "ngram-d4", 1: "d4k1v4"}, max_num_seqs=8)
    with pytest.raises(UnsupportedSetting, match="tree"):
        dynamic_schedule({0: "d4k2v8"}, max_num_seqs=8)
    with pytest.raises(UnsupportedSetting, match="no speculative arm"):
        dynamic_schedule({0: "plain"}, max_num_seqs=8)
    with pytest.raises(UnsupportedSetting, match="never drafts"):
        dynamic_schedule({3: "d4k1v4"}, max_num_seqs=4, edges=DEFAULT_EDGES)  # bucket 3 starts at batch 5


# ------------------------------------------------------------------------------------------------ sampling


def test_sampling_params_stop_exactly_at_our_eos_and_return_the_sampled_tokens_logprob() -> None:
    params = sampling_params(max_tokens=100, temperature=1.0, seed=123, eos_ids=[7, 2, 7])
    assert params == {
        "n": 1,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": 123,
        "max_tokens": 100,
        "ignore_eos": True,  # not the model's generation-config EOS ...
        "stop_token_ids": [2, 7],  # ... exactly ours
        "logprobs": 0,  # the sampled token only
        "detokenize": False,
    }
    assert set(params) <= SAMPLING_FIELDS
    assert sampling_params(max_tokens=1, temperature=0.0, seed=None, eos_ids=())["temperature"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"top_p": 0.9}, "top_p < 1 is refused"),
        ({"temperature": 1e-7}, "greedily below"),
        ({"temperature": -1.0}, "finite and >= 0"),
        ({"temperature": math.nan}, "finite and >= 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ],
)
def test_sampling_settings_vllm_would_change_are_refused(kwargs: dict, needle: str) -> None:
    base = {"max_tokens": 8, "temperature": 1.0, "seed": 0, "eos_ids": [2]}
    with pytest.raises(UnsupportedSetting, match=needle):
        sampling_params(**{**base, **kwargs})


# ------------------------------------------------------------------------------------------------- engine


def test_llm_kwargs_keep_vllm_in_token_ids_with_processed_logprobs() -> None:
    kwargs = llm_kwargs("/w/policy", max_batch=32, max_len=1408, dtype="bfloat16")
    assert set(kwargs) <= ENGINE_ARGS
    assert kwargs["model"] == "/w/policy" and kwargs["skip_tokenizer_init"] is True
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert (kwargs["max_num_seqs"], kwargs["max_model_len"]) == (32, 1408)
    assert "speculative_config" not in kwargs and "per_request_spec_decode_metrics" not in kwargs


def test_llm_kwargs_name_the_worker_extension_only_where_vllm_has_it() -> None:
    kwargs = llm_kwargs("/p", max_batch=4, max_len=64, worker_extension="pkg.mod.Ext")
    assert kwargs["worker_extension_cls"] == "pkg.mod.Ext" and set(kwargs) <= ENGINE_ARGS
    with pytest.raises(UnsupportedSetting, match="worker_extension_cls"):
        llm_kwargs(
            "/p", max_batch=4, max_len=64, worker_extension="x.Y", available=ENGINE_ARGS - {"worker_extension_cls"}
        )


def test_llm_kwargs_with_a_schedule_draft_up_to_its_longest_chain() -> None:
    spec = speculative_config("d6k1v6", drafter="/w/eagle", temperature=1.0)
    _, _, schedule = dynamic_schedule({0: "d6k1v6", 1: "d3k1v3"}, max_num_seqs=16, edges=(4, 8))
    kwargs = llm_kwargs("/w/policy", max_batch=16, max_len=512, speculative=spec, schedule=schedule)
    assert set(kwargs) <= ENGINE_ARGS and set(kwargs["speculative_config"]) <= SPECULATIVE_FIELDS
    assert kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 4, 6], [5, 8, 3], [9, 16, 0]]
    assert kwargs["speculative_config"]["num_speculative_tokens"] == 6
    assert kwargs["per_request_spec_decode_metrics"] == "detailed"


def test_llm_kwargs_refuse_what_the_installed_vllm_lacks() -> None:
    spec = speculative_config("d4k1v4", drafter="/w/eagle", temperature=0.0)
    with pytest.raises(UnsupportedSetting, match="logprobs_mode"):
        llm_kwargs("/p", max_batch=4, max_len=64, available=ENGINE_ARGS - {"logprobs_mode"})
    with pytest.raises(UnsupportedSetting, match="num_speculative_tokens_per_batch_size"):
        llm_kwargs(
            "/p",
            max_batch=4,
            max_len=64,
            speculative=spec,
            schedule=[(1, 2, 4), (3, 4, 0)],
            spec_available=SPECULATIVE_FIELDS - {"num_speculative_tokens_per_batch_size"},
        )
    with pytest.raises(UnsupportedSetting, match="needs a speculative arm"):
        llm_kwargs("/p", max_batch=4, max_len=64, schedule=[(1, 4, 2)])
    older = llm_kwargs(
        "/p", max_batch=4, max_len=64, speculative=spec, available=ENGINE_ARGS - {"per_request_spec_decode_metrics"}
    )
    assert "per_request_spec_decode_metrics" not in older  # optional: accept lengths are then unreported


def test_stop_strings_reach_vllm_with_the_text_they_need_and_the_stop_string_kept() -> None:
    params = sampling_params(max_tokens=100, temperature=1.0, seed=1, eos_ids=[2], stop_strings=("</answer>",))
    assert params["stop"] == ["</answer>"] and params["include_stop_str_in_output"] is True
    assert params["detokenize"] is True, "vLLM matches stop strings on the text it detokenizes"
    assert set(params) <= SAMPLING_FIELDS
