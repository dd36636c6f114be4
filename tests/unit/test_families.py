"""Every model family the torch runtime runs is lossless against Hugging Face transformers, for every draft
source: greedy output token-identical to `generate` (mixed prompt lengths, early EOS, positions past the
scaled families' original context), sampled output distributed as the target's joint distribution
(chi-square, false-alarm rate 1e-4 per test), and the learner's recomputed logprobs (transformers, as
`rl/learner.py` loads the policy) equal to the rollout's. What the runtime does not run is refused in
one line. Checkpoints come from `tests/families.py` (transformers' own config classes)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.families import FAMILIES, ORIGINAL, VOCAB, as_rope_scaling, build_family, family_config
from tests.stats import chi2_threshold, chi_square
from tlt_stream.basics.errors import CheckpointError
from tlt_stream.drafter.model import Drafter
from tlt_stream.model import load_model, load_spec
from tlt_stream.rl.grpo import token_logprobs
from tlt_stream.rl.learner import load_for_training
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.proposers import EagleProposer, GroupProposer, NgramProposer, OracleProposer

MAX_NEW = 20


def prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths; the longest runs past `ORIGINAL` so generation uses the scaled positions."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 1, ORIGINAL + 9, 3, 12)]
    out[3] = [5, 6, 7, 5, 6, 7, 5, 6]  # repetitive: n-gram lookups hit
    return out


def hf_continuations(hf, ps: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy `generate`, no EOS."""
    out = []
    for p in ps:
        ids = torch.tensor([p])
        gen = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, eos_token_id=None
        )
        out.append(gen[0, len(p) :].tolist())
    return out


def cut_at(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


class Family:
    """One family's checkpoint, transformers' model, the runtime's model and transformers' greedy output.
    The EOS id is picked from the output so that some rows stop early and others run to the limit."""

    def __init__(self, name: str, root: Path) -> None:
        self.name, self.path = name, root / name
        self.hf = build_family(name, self.path)
        self.model = load_model(self.path)
        self.prompts = prompts()
        raw = hf_continuations(self.hf, self.prompts, MAX_NEW)
        counts = Counter(t for r in raw for t in r[2:])
        self.eos = next(t for t, _ in counts.most_common() if sum(t in r for r in raw) < len(raw))
        self.reference = [cut_at(r, self.eos) for r in raw]
        assert any(len(r) < MAX_NEW for r in self.reference) and any(len(r) == MAX_NEW for r in self.reference)

    def engine(self, source: str) -> GenerationEngine:
        model = self.model
        if source == "plain":
            return GenerationEngine(model, 3, 128)
        if source.startswith("eagle"):
            torch.manual_seed(1)
            arm = Arm.drafter(4, 1, 4) if source == "eagle-chain" else Arm.drafter(3, 3, 12)
            return GenerationEngine(model, 3, 128, proposer=EagleProposer(Drafter(model.spec).bind(model)), arm=arm)
        if source == "ngram":
            return GenerationEngine(model, 3, 128, proposer=NgramProposer(), arm=Arm.drafter(5, 1, 5))
        if source == "group":  # history that agrees for a while and then diverges, and noise
            group = GroupProposer(max_match=6, strong_match=3)
            g = torch.Generator().manual_seed(5)
            for p, ref in zip(self.prompts, self.reference, strict=True):
                group.remember(p, ref[: len(ref) // 2] + torch.randint(1, VOCAB, (12,), generator=g).tolist())
            return GenerationEngine(model, 3, 128, proposer=group, arm=Arm.group_source(6, 8))
        if source == "scripted":  # the right token among wrong siblings at every level: deep acceptance
            script = {tuple(p[1:]): r for p, r in zip(self.prompts, self.reference, strict=True)}
            return GenerationEngine(model, 3, 128, proposer=OracleProposer(script, VOCAB), arm=Arm.drafter(5, 3, 15))
        raise ValueError(source)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory):
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(name: str) -> Family:
        if name not in built:
            built[name] = Family(name, root)
        return built[name]

    return get


@pytest.mark.parametrize("source", ["plain", "eagle-chain", "eagle-tree", "ngram", "group", "scripted"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_output_is_transformers_for_every_family_and_draft_source(families, name: str, source: str) -> None:
    family = families(name)
    engine = family.engine(source)
    results = engine.generate(family.prompts, MAX_NEW, eos_ids=[family.eos])
    assert [r.token_ids for r in results] == family.reference, (name, source)
    if source != "plain":
        plain = family.engine("plain").generate(family.prompts, MAX_NEW, eos_ids=[family.eos])
        for spec, ref in zip(results, plain, strict=True):
            assert spec.finish_reason == ref.finish_reason
            assert max(abs(a - b) for a, b in zip(spec.logprobs, ref.logprobs, strict=True)) < 1e-4
        assert engine.rounds > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_rope_scaling_and_rope_parameters_load_the_same_spec(families, name: str, tmp_path: Path) -> None:
    import shutil

    family = families(name)
    legacy = tmp_path / "legacy"
    shutil.copytree(family.path, legacy)
    as_rope_scaling(legacy)
    assert load_spec(legacy) == load_spec(family.path) == family.model.spec


def test_each_family_maps_its_own_layout() -> None:
    from tlt_stream.model.families import spec_from_hf_config

    classes = {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "ministral": "Ministral"}

    def spec(name: str, **overrides):
        arch = f"{classes.get(name, 'Llama')}ForCausalLM"
        return spec_from_hf_config({**family_config(name, **overrides).to_dict(), "architectures": [arch]})

    qwen3 = spec("qwen3")
    assert qwen3.qk_norm and not qwen3.qkv_bias and not qwen3.o_bias and qwen3.head_dim == 32
    assert spec("qwen2").qkv_bias and not spec("qwen2").o_bias and not spec("qwen2").qk_norm
    assert not spec("mistral").qkv_bias and spec("mistral").sliding_window is None
    assert spec("ministral").sliding_window == 4096
    assert spec("llama3").rope_type == "llama3" and spec("llama3").rope_original_max_positions == ORIGINAL
    yarn = spec("yarn")
    assert (
        yarn.rope_type == "yarn" and abs(yarn.rope_attention_factor - (0.1 * torch.log(torch.tensor(8.0)) + 1)) < 1e-6
    )
    assert spec("llama", attention_bias=True).o_bias


@pytest.mark.parametrize("name", FAMILIES)
def test_drafter_rope_is_the_targets_and_its_export_config_says_so(families, name: str) -> None:
    """The drafter takes the target's RoPE (positions as long as the target's); the exported config's
    `rope_parameters`, read by transformers' own RoPE code, gives the same frequencies and attention factor."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tlt_stream.drafter.export import eagle_config

    model = families(name).model
    drafter = Drafter(model.spec)
    assert not drafter.spec.qk_norm and drafter.spec.sliding_window is None
    config = LlamaConfig(
        **{k: v for k, v in eagle_config(drafter.spec, dtype="float32").items() if k != "architectures"}
    )
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        torch.testing.assert_close(drafter.inv_freq, model.inv_freq, rtol=0, atol=0)
        return
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    torch.testing.assert_close(drafter.inv_freq, inv_freq, rtol=0, atol=0)
    assert factor == pytest.approx(drafter.spec.rope_attention_factor)


@pytest.mark.parametrize("name", FAMILIES)
def test_learner_logprobs_match_the_rollouts(families, name: str) -> None:
    """Sampled responses at temperature 1: the learner's model (transformers, fp32) gives each response
    token the logprob the rollout reported."""
    family = families(name)
    results = family.engine("plain").generate(family.prompts, MAX_NEW, 1.0, seed=3, eos_ids=[family.eos])
    learner = load_for_training(family.path).eval()
    for prompt, result in zip(family.prompts, results, strict=True):
        ids = torch.tensor([prompt + result.token_ids])
        with torch.no_grad():
            logits = learner(input_ids=ids).logits[:, :-1]
        recomputed = token_logprobs(logits, ids[:, 1:])[0, len(prompt) - 1 :]
        torch.testing.assert_close(recomputed, torch.tensor(result.logprobs), atol=1e-4, rtol=0)


def exact_joint(hf, prompt: list[int], length: int, temperature: float, vocab: int) -> dict[tuple[int, ...], float]:
    import itertools

    seqs = list(itertools.product(range(vocab), repeat=length))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logits = hf(ids).logits[:, len(prompt) - 1 : len(prompt) - 1 + length]
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(2, torch.tensor(seqs)[:, :, None]).sum((1, 2))
    return {s: float(p) for s, p in zip(seqs, logp.exp(), strict=True)}


@pytest.fixture(scope="module")
def tiny_families(tmp_path_factory: pytest.TempPathFactory):
    root, built = tmp_path_factory.mktemp("tiny_families"), {}

    def get(name: str):
        if name not in built:
            hf = build_family(name, root / name, seed=11, vocab=4, initializer_range=0.5, num_hidden_layers=1)
            built[name] = hf, load_model(root / name)
        return built[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "eagle-chain", "eagle-tree", "group"])
@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_sampled_output_follows_the_target_distribution(tiny_families, name: str, mode: str) -> None:
    hf, model = tiny_families(name)
    prompt, length, temperature, n = [1, 2, 3, 1, 2], 3, 0.9, 6000
    expected = exact_joint(hf, prompt, length, temperature, vocab=4)
    proposer, arm = None, None
    if mode.startswith("eagle"):
        torch.manual_seed(0)
        proposer = EagleProposer(Drafter(model.spec).bind(model))
        arm = Arm.drafter(3, 1, 3) if mode == "eagle-chain" else Arm.drafter(2, 3, 6)
    elif mode == "ngram":
        proposer, arm = NgramProposer(), Arm.drafter(3, 1, 3)
    elif mode == "group":  # the rows are one prompt's siblings: what they write drafts for the others
        proposer, arm = GroupProposer(), Arm.group_source(3, 4)
    engine = GenerationEngine(model, 64, 16, proposer=proposer, arm=arm)
    results = engine.generate([prompt] * n, length, temperature, seed=1000)
    if proposer is not None:
        assert engine.rounds > 0
    stat, df = chi_square(Counter(tuple(r.token_ids) for r in results), expected, n)
    assert stat < chi2_threshold(df), (name, mode, stat, chi2_threshold(df))


def _edit(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_what_the_runtime_does_not_run_is_refused_in_one_line_pointing_at_vllm(tmp_path: Path) -> None:
    from transformers import LlamaConfig, Qwen3MoeConfig

    from tlt_stream.model.families import spec_from_hf_config

    def refusal(cfg: dict) -> str:
        with pytest.raises(CheckpointError) as info:
            spec_from_hf_config(cfg)
        message = str(info.value)
        assert "\n" not in message and "vLLM backend" in message, message
        return message

    llama = {"architectures": ["LlamaForCausalLM"]}
    dynamic = LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}).to_dict() | llama
    assert "dynamic NTK" in refusal(dynamic)
    moe = Qwen3MoeConfig(num_experts=4).to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}
    assert "mixture-of-experts" in refusal(moe)
    assert "multimodal" in refusal(
        {**family_config("qwen2").to_dict(), "architectures": ["Qwen2VLForConditionalGeneration"], "vision_config": {}}
    )
    partial = {**family_config("llama").to_dict(), "architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5}
    assert "partial rotary" in refusal(partial)
    longrope = LlamaConfig().to_dict() | llama | {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}
    assert "longrope" in refusal(longrope)
    assert "unsupported architectures" in refusal({"architectures": ["GPT2LMHeadModel"]})

    build_family("mistral", tmp_path / "window", sliding_window=16)  # a window shorter than the rows: it slides
    model = load_model(tmp_path / "window")
    assert model.spec.sliding_window == 16
    GenerationEngine(model, 1, 16)  # fits inside the window: exact
    with pytest.raises(ValueError, match=r"16-token attention window.*vLLM backend"):
        GenerationEngine(model, 1, 64)
    _edit(tmp_path / "window", sliding_window=None)
    GenerationEngine(load_model(tmp_path / "window"), 1, 64)


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_chat_structure_and_every_eos_id_of_each_family(tmp_path: Path, name: str) -> None:
    """Prompts rendered with the family's template keep its special tokens whole (Qwen3's thinking tags
    with `data.enable_thinking` false, Llama 3's header ids), and every EOS id generation_config.json lists
    stops a response."""
    from transformers import AutoTokenizer

    from tests.families import LLAMA3_EOS, QWEN3_EOS, chat_policy
    from tlt_stream.basics.config import Config, override
    from tlt_stream.model import stop_token_ids
    from tlt_stream.rl.datasets import pool_from_config

    policy = chat_policy(name, tmp_path / name)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    ids = tokenizer.convert_tokens_to_ids
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "what is 1 plus 2?", "answer": "3"}) + "\n")
    rendered = {}
    for thinking in (None, False):
        config = override(Config(), {"data.enable_thinking": thinking})
        pool = pool_from_config(str(tmp_path / "d.jsonl"), config, tokenizer, seed=0, max_len=512)
        rendered[thinking] = pool.rows[0][2]  # (prompt_id, text, ids, answer)
    if name == "qwen3":
        think = [ids("<think>"), ids("</think>")]
        assert all(t in rendered[False] for t in think) and not any(t in rendered[None] for t in think)
        assert rendered[False][-6:] == tokenizer("assistant\n<think>\n\n</think>\n\n")["input_ids"][-6:]
        eos = [ids(t) for t in QWEN3_EOS]
    else:
        assert rendered[None][:2] == [ids("<|begin_of_text|>"), ids("<|start_header_id|>")]
        assert rendered[None].count(ids("<|end_header_id|>")) == 2 and ids("<|eot_id|>") in rendered[None]
        eos = [ids(t) for t in LLAMA3_EOS]
    assert stop_token_ids(policy, tokenizer) == sorted(eos)
    results = GenerationEngine(load_model(policy), 32, 128).generate(
        [rendered[None]] * 96, 60, 1.0, seed=0, eos_ids=eos
    )
    ends = Counter(r.token_ids[-1] for r in results if r.finish_reason == "eos")
    assert set(ends) == set(eos), ends  # each EOS id ends some response (near-uniform next tokens)
    assert all(t not in eos for r in results for t in r.token_ids[:-1]), "no response runs past an EOS id"


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_drafter_init_trains_and_exports_for_each_family(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tlt-stream drafter init` on the family's checkpoint (no --max-len: the checkpoint's context), a few
    online training steps on its own features, and `export-drafter` to vLLM's EAGLE layout, whose config
    transformers parses with the target's RoPE; speculative decoding with the drafter stays the target's."""
    from transformers import AutoTokenizer, LlamaConfig

    from tests.families import chat_policy
    from tlt_stream.commands.cli import main
    from tlt_stream.drafter.export import eagle_tensor_names, export_drafter
    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.drafter.train import DrafterTrainer, Window, pack_windows

    policy = chat_policy(name, tmp_path / "policy", positions=128)
    train = tmp_path / "train.jsonl"
    train.write_text(
        "".join(json.dumps({"prompt": f"what is {i} plus 2?", "answer": str(i + 2)}) + "\n" for i in range(4))
    )
    out = tmp_path / "drafter"
    code = main(["drafter", "init", "--policy", str(policy), "--dataset", str(train), "--out", str(out),
                 "--samples", "4", "--steps", "3", "--threads", "1"])  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == 4 and report["response_tokens"] > 0
    target = load_model(policy)
    drafter = load_drafter(out, target)
    assert drafter.spec.rope_type == target.spec.rope_type and not drafter.spec.qk_norm

    g = torch.Generator().manual_seed(0)
    windows = []
    for _ in range(4):
        tokens = torch.randint(0, target.spec.vocab_size, (24,), generator=g)
        with torch.inference_mode():
            features = target(tokens[None], torch.arange(24)[None], target.new_cache(1, 24))[0]
        windows.append(Window(tokens, features.clone(), prompt_len=3))
    (batch,) = pack_windows(windows, row_tokens=96)
    drafter.train()
    trainer = DrafterTrainer(drafter.requires_grad_(True), lr=3e-3, total_steps=10, warmup=1, unroll=2)
    losses = [trainer.step(batch)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0]

    export_drafter(out, tmp_path / "eagle", format="eagle")
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    parsed = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    assert parsed.rope_parameters["rope_type"] == target.spec.rope_type
    from safetensors import safe_open

    with safe_open(tmp_path / "eagle" / "model.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == eagle_tensor_names(drafter.spec)

    tokenizer = AutoTokenizer.from_pretrained(policy)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "what is 3 plus 2?"}], tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    drafter = load_drafter(out, target)
    plain = GenerationEngine(target, 1, 128).generate([prompt], 30)[0].token_ids
    sd = GenerationEngine(target, 1, 128, proposer=EagleProposer(drafter), arm=Arm.drafter(3, 2, 5))
    assert sd.generate([prompt], 30)[0].token_ids == plain


def test_rows_are_sized_from_the_checkpoint_and_the_kv_budget(tmp_path: Path) -> None:
    """rollout.max_len unset is the checkpoint's context and a longer one is refused naming the key; the
    KV cache costs rows, not length: the engine runs the rows its budget holds, and refuses with the numbers
    when not one fits. Qwen3-0.6B at 40,960 tokens in fp32 takes ~9.4 GB a row."""
    from tlt_stream.basics.config import Config, override
    from tlt_stream.basics.config.rollout import context_len
    from tlt_stream.basics.errors import ConfigError
    from tlt_stream.model import ModelSpec
    from tlt_stream.model.cache import kv_bytes_per_row
    from tlt_stream.rollout.build import build_engine

    qwen3_06b = ModelSpec("qwen3", 151_936, 1024, 3072, 28, 16, 8, 128, qk_norm=True)
    assert kv_bytes_per_row(qwen3_06b, 40_960, torch.float32) == 2 * 28 * 8 * 128 * 40_960 * 4  # 9.4e9
    assert context_len(None, 512) == 512 and context_len(300, 512) == 300
    with pytest.raises(ConfigError, match=r"rollout\.max_len: 1408 is longer than the 512 positions"):
        context_len(1408, 512)

    build_family("qwen3", tmp_path / "p")  # 256 positions
    per_row = 2 * 2 * 2 * 32 * 256 * 4  # layers, kv heads, head_dim, max_len, fp32
    config = override(
        Config(), {"rollout.max_len": 256, "rollout.max_batch": 8, "rollout.kv_cache_gib": 3.5 * per_row / 2**30}
    )
    engine, _ = build_engine(str(tmp_path / "p"), config)
    assert engine.cache.max_batch == 3 and engine.cache.max_len == 256
    small = override(config, {"rollout.kv_cache_gib": 0.5 * per_row / 2**30})
    with pytest.raises(ConfigError, match=r"one row of 256 tokens needs .* GiB of KV cache"):
        build_engine(str(tmp_path / "p"), small)


YARN_PARAMS = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL}
VARIANTS = {
    "qwen3-bias-untied-gqa4": ("qwen3", dict(attention_bias=True, tie_word_embeddings=False, num_key_value_heads=1)),
    "qwen3-yarn": ("qwen3", dict(rope_parameters={**YARN_PARAMS, "rope_theta": 1e6})),
    "llama3-biases-head-dim": ("llama3", dict(attention_bias=True, mlp_bias=True, head_dim=8)),
    "llama-yarn-attention-factor": (
        "llama",
        dict(rope_parameters={**YARN_PARAMS, "attention_factor": 1.3, "beta_fast": 16.0, "rope_theta": 1e4}),
    ),
    "qwen2-yarn-mscale-untruncated": (
        "qwen2",
        dict(
            rope_parameters={**YARN_PARAMS, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False, "rope_theta": 1e4}
        ),
    ),
    "mistral-linear-window": (
        "mistral",
        dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}, sliding_window=512),
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_other_shapes_of_the_families_match_transformers_logits(tmp_path: Path, variant: str) -> None:
    """Biases, GQA, an explicit head_dim, YaRN's optional keys on other families: prefill and incremental
    decode logits are transformers' (fp32) past the original context."""
    family, overrides = VARIANTS[variant]
    hf = build_family(family, tmp_path / variant, **overrides)
    model = load_model(tmp_path / variant)
    ids = torch.randint(1, VOCAB, (1, 2 * ORIGINAL + 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = hf(ids).logits[0]
        cache = model.new_cache(1, ids.shape[1])
        n = ids.shape[1] - 4
        prefill = model.logits(model(ids[:, :n], torch.arange(n)[None], cache))[0]
        cache.advance(torch.tensor([n]))
        steps = []
        for i in range(n, ids.shape[1]):
            steps.append(model.logits(model(ids[:, i : i + 1], torch.tensor([[i]]), cache))[0, 0])
            cache.advance(torch.tensor([1]))
    torch.testing.assert_close(torch.cat([prefill, torch.stack(steps)]), reference, atol=1e-4, rtol=0)
