"""`tlt-stream run --policy DIR --dataset TRAIN --eval-dataset TEST --reward FILE:FN`: a workload of one's own,
end to end, against the real servers.

Evidence from outside the code under test: an audit consumer group created on the run's `prompts` stream
before it starts keeps every dispatched prompt (the producer trims only what every group acked), so the test
reads what was dispatched and compares it with the dataset file; the final checkpoint's weights are compared
with the initial policy's, tensor by tensor.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from safetensors.torch import load_file

from tlt_stream.basics.config import Config, load_config
from tlt_stream.basics.messages import codec_for
from tlt_stream.bus.streams import Keys
from tlt_stream.rl.checkpoint import latest_checkpoint

pytestmark = [pytest.mark.redis, pytest.mark.mqtt, pytest.mark.slow]

TRAIN = [{"question": f"{a}+{b}=", "solution": {"value": str(a + b)}} for a, b in [(1, 2), (3, 4), (5, 6)]]
REWARD = "def score(response, answer):\n    return float(len(response) % 2)  # variance on a random policy\n"
ROW_REWARD = """
def score(response, answer, data_source, extra_info):
    assert data_source == "gsm8k-like" and isinstance(extra_info["index"], int), (data_source, extra_info)
    return float(len(response) % 2)
"""


def env_for(config: Config) -> dict[str, str]:
    assert config.bus.redis_url and config.bus.mqtt_url
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")}
    return {**clean, "TLT_REDIS_URL": config.bus.redis_url, "TLT_MQTT_URL": config.bus.mqtt_url}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def run(config: Config, *args: str, timeout: float = 240) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tlt_stream.commands.cli", "run", "--run", config.run, *args),
        env=env_for(config),
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(timeout):
        _, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stderr.decode()


async def test_a_policy_dataset_and_reward_of_ones_own_train_and_evaluate(
    one_backend: str, bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", TRAIN)
    test = write_jsonl(tmp_path / "test.jsonl", TRAIN[:2])
    (tmp_path / "my_reward.py").write_text(REWARD)
    out = tmp_path / "run"
    assert bus_config.bus.redis_url
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    prompts = Keys(bus_config.run).stream("prompts")
    await redis.xgroup_create(prompts, "audit", id="0", mkstream=True)  # keeps every dispatched prompt
    try:
        code, log = await run(
            bus_config,
            *("--policy", str(init_policy), "--dataset", str(train), "--eval-dataset", str(test)),
            *("--reward", f"{tmp_path / 'my_reward.py'}:score", "--steps", "2", "--out", str(out)),
            *("--prompts-per-step", "2", "--group-size", "4", "--max-len", "48", "--eval", "8"),
            *("--set", "data.prompt_field=question", "--set", "data.answer_field=solution.value"),
            *("--set", "launch.eval_every=1", "--log-to", "tensorboard,wandb"),
        )
        assert code == 0, log[-3000:]
        assert "no drafter for" in log and "drafting n-grams" in log, "no drafter of its own: n-gram drafts"
        entries = await redis.xrange(prompts)
    finally:
        await redis.aclose()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(init_policy)
    dataset = {(row["question"], row["solution"]["value"]) for row in TRAIN}
    codec = codec_for("prompts")
    dispatched = [codec.decode(fields[b"m"]) for _, fields in entries]
    assert len(dispatched) == 4, "2 steps of 2 prompts"
    seen = [(tokenizer.decode(g.prompt_ids), g.answer) for g in dispatched]
    assert set(seen) <= dataset, seen
    assert set(seen[:3]) == dataset, "the first epoch visits every prompt once before any comes again"

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    final = latest_checkpoint(out / "checkpoints")
    assert final is not None and final.step == 2
    before, after = load_file(init_policy / "model.safetensors"), load_file(final.policy_dir / "model.safetensors")
    moved = [name for name in before if not before[name].equal(after[name])]
    assert moved, "the learner's updates changed the weights"

    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 1, 2] and all(e["dataset"] == str(test) for e in evals)
    assert all(e["prompts"] == 2 and 0 <= e["mean_reward"] <= 1 for e in evals)
    logged = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["version"] for r in logged] == [1, 1, 2, 2] and all(r["response"] is not None for r in logged)
    assert {r["prompt"] for r in logged} <= {row["question"] for row in TRAIN}, "decoded with the policy's tokenizer"
    assert "Sampled responses" in (out / "report" / "report.html").read_text()

    from tests.tracking_files import tensorboard_scalars, wandb_history

    board, eval_board = (
        tensorboard_scalars(out / "tensorboard" / "learner"),
        tensorboard_scalars(out / "tensorboard" / "eval"),
    )
    assert board["reward_mean"] == pytest.approx({r["version"]: r["reward_mean"] for r in rows})
    assert eval_board["eval/mean_reward"] == pytest.approx({e["version"]: e["mean_reward"] for e in evals})
    history = wandb_history(out)  # the learner's run and the evaluations' (one W&B group)
    assert {v: history[v]["reward_mean"] for v in (1, 2)} == {r["version"]: r["reward_mean"] for r in rows}
    assert {v: history[v]["eval/accuracy"] for v in (0, 1, 2)} == {e["version"]: e["accuracy"] for e in evals}
    served = load_config(out / "config.toml", environ={})
    assert served.preset is None and served.learner.lr == 1e-6, "a model of one's own gets the field's defaults"
    assert served.learner.policy == str(init_policy) and served.sd.drafter == "ngram"


async def test_a_bad_dataset_row_stops_the_run_in_one_line_naming_file_row_and_field(
    one_backend: str, bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}])
    code, log = await run(
        bus_config, "--policy", str(init_policy), "--dataset", str(train), "--max-len", "48", "--out", str(tmp_path)
    )
    lines = [line for line in log.splitlines() if line.startswith("tlt-stream run:")]
    assert code == 2 and lines[-1] == f"tlt-stream run: {train}: row 2: missing field 'answer'", log[-2000:]


async def test_a_bf16_qwen_checkpoint_with_a_bpe_tokenizer_and_a_verl_parquet_trains_and_stops_on_eos_or_string(
    one_backend: str, bus_config: Config, tmp_path: Path
) -> None:
    import torch

    from tests.worlds import gsm8k_like_rows, qwen_like_policy, write_parquet

    policy = qwen_like_policy(tmp_path / "qwen")
    rows = gsm8k_like_rows([(1, 2), (3, 4), (5, 6), (7, 8)])
    write_parquet(rows, tmp_path / "train.parquet")
    write_parquet(rows[:2], tmp_path / "test.parquet")
    (tmp_path / "my_reward.py").write_text(ROW_REWARD)  # it needs the row's other fields, by name
    out = tmp_path / "run"
    assert bus_config.bus.redis_url
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    keys = Keys(bus_config.run)
    await redis.xgroup_create(keys.stream("prompts"), "audit", id="0", mkstream=True)  # keeps every entry

    async def audit_samples() -> None:
        """An audit group on `samples` as soon as the stream exists (it may not before the run starts: a new
        run is one whose samples stream is absent); the learner trims only what every group acked, and its
        first trim comes after the first update, seconds after the first sample."""
        while not await redis.exists(keys.stream("samples")):  # noqa: ASYNC110 (a poll of Redis, not of a flag)
            await asyncio.sleep(0.01)
        await redis.xgroup_create(keys.stream("samples"), "audit", id="0")

    auditor = asyncio.create_task(audit_samples())
    try:
        code, log = await run(
            bus_config,
            *("--policy", str(policy), "--dataset", str(tmp_path / "train.parquet")),
            *("--eval-dataset", str(tmp_path / "test.parquet"), "--reward", f"{tmp_path / 'my_reward.py'}:score"),
            *("--steps", "2", "--prompts-per-step", "4", "--group-size", "8", "--max-len", "160", "--eval", "2"),
            *("--sd", "off", "--set", 'rollout.stop=["Q"]', "--out", str(out)),
        )
        assert code == 0, log[-3000:]
        assert auditor.done()
        await auditor
        prompts = await redis.xrange(keys.stream("prompts"))
        samples = await redis.xrange(keys.stream("samples"))
    finally:
        await redis.aclose()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    im_end, endoftext = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    groups = [codec_for("prompts").decode(f[b"m"]) for _, f in prompts]
    expected = {tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows}
    assert {tokenizer.decode(g.prompt_ids) for g in groups} == expected, "every training prompt, chat-templated"
    decoded = [codec_for("samples").decode(f[b"m"]) for _, f in samples]
    assert len({s.sample_id for s in decoded}) == 2 * 4 * 8
    ends = []
    for s in decoded:
        tokens = s.token_ids.to_torch().tolist()
        stops = [i for i, t in enumerate(tokens) if t in (im_end, endoftext)]
        before = tokenizer.decode(tokens[:-1])
        assert "Q" not in before, "nothing runs on past the stop string"
        if s.finish_reason == "eos":
            assert stops == [len(tokens) - 1], "a response ends at its first EOS id"
            ends.append(tokens[-1])
        elif s.finish_reason == "stop":
            assert not stops and "Q" in tokenizer.decode(tokens), "the token that completes 'Q' ends it, kept"
            ends.append("Q")
        else:
            assert not stops and len(s.prompt_ids) + len(tokens) == 160, "cut off at max_len, no EOS inside"
    assert im_end in ends and endoftext in ends, f"both EOS ids stop responses: {ends}"
    assert "Q" in ends, "the stop string stops responses"

    final = latest_checkpoint(out / "checkpoints")
    assert final is not None and final.step == 2
    before = load_file(policy / "model.safetensors")
    after = load_file(final.policy_dir / "model.safetensors")
    assert {t.dtype for t in before.values()} == {torch.bfloat16}
    changed = sum(int((after[k].float() != v.float()).sum()) for k, v in before.items())
    assert changed > 0.5 * sum(v.numel() for v in before.values()), "fp32 masters: most weights moved at lr 1e-6"
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 2]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["logprob_mismatch_max"] < 0.1 for m in metrics), "the rollout's numbers are the learner's"


async def test_a_qwen3_checkpoint_of_512_positions_trains_with_nothing_but_policy_dataset_and_reward(
    one_backend: str, bus_config: Config, tmp_path: Path
) -> None:
    """No --max-len: rows are as long as the checkpoint's context (512 positions, shorter than the tiny
    world's length), and the run trains."""
    from tests.families import chat_policy

    policy = chat_policy("qwen3", tmp_path / "qwen3", positions=512)
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": f"what is {a} plus 2?", "answer": str(a + 2)} for a in range(4)]
    )
    (tmp_path / "my_reward.py").write_text(REWARD)
    out = tmp_path / "run"
    code, log = await run(
        bus_config,
        *("--policy", str(policy), "--dataset", str(train), "--reward", f"{tmp_path / 'my_reward.py'}:score"),
        *("--steps", "1", "--out", str(out)),
    )
    assert code == 0, log[-3000:]
    assert "rows of 512 tokens" in (out / "logs" / "rollout-0.log").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1]
