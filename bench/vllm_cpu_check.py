"""What of the vLLM backend can be checked without a GPU, checked against the real vLLM (issue 25 point 5).

Run by bench/vllm_cpu_check.sh in a side environment holding vLLM (never CI). Writes one JSON object to --out
(vLLM logs to stdout, so stdout is not the place). Each check is a record {"ok", ...}; nothing is mocked:

- `fields`: every key our translation emits (`rollout/vllm/config.py`) is a field of vLLM's `EngineArgs`,
  `SpeculativeConfig` and `SamplingParams`;
- `sampling`: our sampling settings at T = 0, T = 1 and with stop strings through `SamplingParams` itself
  (greedy vs seeded sampling, stop ids, `logprobs = 0`, detokenisation only for stop strings);
- `speculative`: EAGLE chains at T = 0 and T > 0, n-gram and the adaptive batch-size schedule through
  `SpeculativeConfig` with the target's `ModelConfig`: vLLM reads our exported drafter's config.json;
- `engine_config`: `EngineArgs(**llm_kwargs(...)).create_engine_config()` under vLLM's CPU platform (the
  platform a CPU-only host with vLLM's CUDA wheel lacks: it stops at "Device string must not be empty");
- `target_weights`, `draft_weights`: a random Llama and Qwen2 policy through vLLM's model classes
  (`get_model_architecture`, `load_weights`, on the CPU) and the exported drafters through
  `EagleLlamaForCausalLM.load_weights`, both the build-time load and our in-place swap's tensors, each
  parameter compared with ours (stacked q/k/v and gate/up included);
- `api`: the vLLM calls the backend makes (worker reload, draft model access, engine requests, RPC),
  bound to the real signatures.

What it cannot check (needs a GPU): any forward of vLLM's models, the engine's scheduling, sampling and
rejection sampling, CUDA graphs, the in-place reload inside a running engine. docs/vllm.md says which.

    python -m bench.vllm_cpu_check --work DIR --out RESULT.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def stand_in_platform() -> str:
    """vLLM's CPU platform as the current one, before anything of vLLM reads it; returns what was detected."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    detected = type(platforms.current_platform).__name__
    platforms._current_platform = CpuPlatform()
    return detected


# ------------------------------------------------------------------------------------------------- inputs


def make_models(work: Path) -> dict[str, dict[str, Path]]:
    """A random Llama (head_dim != hidden / heads) and Qwen2 (q/k/v bias) policy in Hugging Face layout, a random
    drafter for each, and its EAGLE export (float32, and bfloat16 with the policy's embedding)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tlt_stream.drafter.export import export_drafter
    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model

    torch.manual_seed(0)
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    shape.update(num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    kinds = {
        "llama": (LlamaForCausalLM, LlamaConfig(head_dim=24, **shape)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**shape)),
    }
    made = {}
    for name, (model_class, config) in kinds.items():
        root = work / name
        model_class(config).eval().save_pretrained(root / "policy", safe_serialization=True)
        target = load_model(root / "policy")
        drafter = Drafter(target.spec)
        with torch.no_grad():
            for key, param in drafter.named_parameters():
                param.copy_((1.0 if key.endswith("layernorm.weight") else 0.0) + 0.1 * torch.randn_like(param))
        save_drafter(drafter.bind(target), root / "drafter")
        export_drafter(root / "drafter", root / "eagle", format="eagle")
        export_drafter(root / "drafter", root / "eagle-bf16", format="eagle", dtype="bfloat16", policy=root / "policy")
        made[name] = {"policy": root / "policy", "drafter": root / "drafter", "eagle": root / "eagle"}
        made[name]["eagle_bf16"] = root / "eagle-bf16"
    return made


# ------------------------------------------------------------------------------------------------- checks


def check_fields(models: dict[str, dict[str, Path]]) -> dict[str, Any]:
    import vllm
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    from tlt_stream.rollout.vllm.backend import WORKER_EXTENSION, field_names
    from tlt_stream.rollout.vllm.config import dynamic_schedule, llm_kwargs, sampling_params, speculative_config

    m = models["llama"]
    _, _, schedule = dynamic_schedule({0: "d4k1v4", 1: "d2k1v2"}, max_num_seqs=64, switch_threshold=12)
    spec = speculative_config("d4k1v4", drafter=m["eagle"], temperature=1.0)
    kwargs = llm_kwargs(m["policy"], max_batch=64, max_len=512, speculative=spec, schedule=schedule,
                        worker_extension=WORKER_EXTENSION)  # fmt: skip
    sampling = sampling_params(max_tokens=8, temperature=1.0, seed=1, eos_ids=[2], stop_strings=["</a>"])
    missing = {
        "EngineArgs": sorted(set(kwargs) - field_names(EngineArgs)),
        "SpeculativeConfig": sorted(set(kwargs["speculative_config"]) - field_names(SpeculativeConfig)),
        "SamplingParams": sorted(set(sampling) - field_names(vllm.SamplingParams)),
    }
    return {"ok": not any(missing.values()), "missing": missing}


def check_sampling() -> dict[str, Any]:
    import vllm
    from vllm.sampling_params import RequestOutputKind, SamplingType

    from tlt_stream.rollout.vllm.config import sampling_params

    cases = {
        "greedy": sampling_params(max_tokens=8, temperature=0.0, seed=None, eos_ids=[2, 7]),
        "sampled": sampling_params(max_tokens=8, temperature=1.0, seed=5, eos_ids=[2]),
        "stop_strings": sampling_params(max_tokens=8, temperature=0.7, seed=5, eos_ids=[2], stop_strings=["</a>"]),
    }
    built = {name: vllm.SamplingParams(**kw, output_kind=RequestOutputKind.FINAL_ONLY) for name, kw in cases.items()}
    seen = {
        name: {
            "sampling_type": p.sampling_type.name,
            "stop_token_ids": sorted(p.stop_token_ids or []),
            "ignore_eos": p.ignore_eos,
            "logprobs": p.logprobs,
            "detokenize": p.detokenize,
            "stop": list(p.stop or []),
            "top_p": p.top_p,
            "top_k": p.top_k,
        }
        for name, p in built.items()
    }
    ok = (
        built["greedy"].sampling_type == SamplingType.GREEDY
        and built["sampled"].sampling_type == SamplingType.RANDOM_SEED
        and seen["greedy"]["stop_token_ids"] == [2, 7]
        and all(
            s["ignore_eos"] and s["logprobs"] == 0 and s["top_p"] == 1.0 and s["top_k"] in (0, -1, None)
            for s in seen.values()
        )
        and not seen["greedy"]["detokenize"]
        and seen["stop_strings"]["detokenize"]
        and seen["stop_strings"]["stop"] == ["</a>"]
    )
    return {"ok": bool(ok), "seen": seen}


def _target_model_config(policy: Path, max_len: int = 512) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=str(policy), skip_tokenizer_init=True, max_model_len=max_len, dtype="float32")


def check_speculative(models: dict[str, dict[str, Path]]) -> dict[str, Any]:
    from vllm.config import ParallelConfig, SpeculativeConfig

    from tlt_stream.rollout.vllm.config import dynamic_schedule, llm_kwargs, speculative_config

    out: dict[str, Any] = {}
    for name, m in models.items():
        target = _target_model_config(m["policy"])
        method, top, schedule = dynamic_schedule({0: "d4k1v4", 1: "d2k1v2"}, max_num_seqs=64, switch_threshold=12)
        cases = {
            "chain_t0": speculative_config("d4k1v4", drafter=m["eagle"], temperature=0.0).config,
            "chain_t1": speculative_config("d3k1v3", drafter=m["eagle"], temperature=1.0).config,
            "ngram": speculative_config("ngram-d4", temperature=1.0).config,
            "schedule": llm_kwargs(m["policy"], max_batch=64, max_len=512, schedule=schedule,
                                   speculative=speculative_config(f"d{top}k1v{top}", drafter=m["eagle"],
                                                                  temperature=1.0))["speculative_config"],
        }  # fmt: skip
        for case, config in cases.items():
            spec = SpeculativeConfig(**config, target_model_config=target, target_parallel_config=ParallelConfig())
            record: dict[str, Any] = {"method": spec.method, "k": spec.num_speculative_tokens}
            if spec.method == "eagle":
                draft = spec.draft_model_config
                record.update(
                    draft_architectures=list(draft.architectures),
                    draft_layers=draft.hf_config.num_hidden_layers,
                    draft_max_model_len=draft.max_model_len,
                    draft_sample_method=spec.draft_sample_method,
                    schedule=[list(e) for e in spec.num_speculative_tokens_per_batch_size or []],
                )
            out[f"{name}/{case}"] = record
    ok = all(
        r["method"] == "ngram"
        or (
            r["draft_architectures"] == ["EagleLlamaForCausalLM"]
            and r["draft_layers"] == 1
            and r["draft_max_model_len"] == 512
        )
        for r in out.values()
    )
    ok = ok and out["llama/chain_t0"]["draft_sample_method"] == "greedy"
    ok = ok and out["llama/chain_t1"]["draft_sample_method"] == "probabilistic"
    ok = ok and out["llama/schedule"]["schedule"] == [list(e) for e in schedule] and method == "eagle"
    return {"ok": bool(ok), "cases": out}


def engine_config(policy: Path, eagle: Path, *, max_batch: int = 8, dtype: str = "float32") -> Any:
    from vllm.engine.arg_utils import EngineArgs

    from tlt_stream.rollout.vllm.backend import WORKER_EXTENSION
    from tlt_stream.rollout.vllm.config import llm_kwargs, speculative_config

    spec = speculative_config("d4k1v4", drafter=eagle, temperature=1.0)
    kwargs = llm_kwargs(policy, max_batch=max_batch, max_len=512, dtype=dtype, speculative=spec,
                        worker_extension=WORKER_EXTENSION)  # fmt: skip
    return EngineArgs(**kwargs).create_engine_config()


def check_engine_config(models: dict[str, dict[str, Path]]) -> dict[str, Any]:
    from tlt_stream.rollout.vllm.backend import WORKER_EXTENSION

    m = models["llama"]
    config = engine_config(m["policy"], m["eagle"], max_batch=16)
    seen = {
        "model_dtype": str(config.model_config.dtype),
        "logprobs_mode": config.model_config.logprobs_mode,
        "skip_tokenizer_init": config.model_config.skip_tokenizer_init,
        "max_model_len": config.model_config.max_model_len,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "prefix_caching": config.cache_config.enable_prefix_caching,
        "worker_extension_cls": config.parallel_config.worker_extension_cls,
        "speculative": [config.speculative_config.method, config.speculative_config.num_speculative_tokens],
        "per_request_spec_decode_metrics": config.observability_config.per_request_spec_decode_metrics,
        # VllmSettings.dtype's default: what vLLM's auto makes of a float32 checkpoint (on this platform)
        "auto_dtype_of_a_float32_checkpoint": str(
            engine_config(m["policy"], m["eagle"], dtype="auto").model_config.dtype
        ),
    }
    ok = (
        seen["logprobs_mode"] == "processed_logprobs"
        and seen["skip_tokenizer_init"]
        and (seen["max_model_len"], seen["max_num_seqs"]) == (512, 16)
        and seen["worker_extension_cls"] == WORKER_EXTENSION
        and seen["speculative"] == ["eagle", 4]
        and seen["per_request_spec_decode_metrics"] == "detailed"
    )
    return {"ok": bool(ok), "seen": seen}


def _stacked(tensors: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Checkpoint tensors (q/k/v, gate/up separate) in vLLM's stacked parameter layout, names unprefixed."""
    import torch

    out = {}
    for name, tensor in tensors.items():
        if ".q_proj." in name or ".gate_proj." in name:
            parts = ("q_proj", "k_proj", "v_proj") if ".q_proj." in name else ("gate_proj", "up_proj")
            fused = "qkv_proj" if parts[0] == "q_proj" else "gate_up_proj"
            out[prefix + name.replace(parts[0], fused)] = torch.cat([tensors[name.replace(parts[0], p)] for p in parts])
        elif not any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
            out[prefix + name] = tensor
    return out


def _compare(model: Any, expected: dict[str, Any]) -> dict[str, Any]:
    """Each expected tensor against the model parameter of its name: missing names and values that differ."""
    import torch

    params = dict(model.named_parameters())
    missing = sorted(set(expected) - set(params))
    differ = sorted(
        name
        for name, tensor in expected.items()
        if name in params
        and (params[name].shape != tensor.shape or not torch.equal(params[name].detach().float(), tensor.float()))
    )
    return {"missing": missing, "differ": differ, "compared": len(expected) - len(missing)}


def check_target_weights(models: dict[str, dict[str, Path]]) -> dict[str, Any]:
    """Each policy through the class vLLM picks for it, loaded as vLLM loads a checkpoint (and as our in-place
    reload's fallback does: `model.load_weights` over the files)."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture

    out = {}
    for name, m in models.items():
        config = engine_config(m["policy"], m["eagle"])
        tensors = load_file(str(m["policy"] / "model.safetensors"))
        with set_current_vllm_config(config), torch.device("cpu"):
            model_class, _ = get_model_architecture(config.model_config)
            model = model_class(vllm_config=config, prefix="")
            loaded = set(model.load_weights(iter(tensors.items())) or ())
        params = {n for n, _ in model.named_parameters()}
        record = _compare(model, _stacked(tensors, ""))
        record.update(model_class=model_class.__name__, not_loaded=sorted(params - loaded))
        record["ok"] = not (record["missing"] or record["differ"] or record["not_loaded"])
        out[name] = record
    return {"ok": all(r["ok"] for r in out.values()), "policies": out}


def check_draft_weights(models: dict[str, dict[str, Path]]) -> dict[str, Any]:
    """Each export through `EagleLlamaForCausalLM.load_weights`: the whole file (the engine's build-time load)
    and `drafter_swap_tensors` (our in-place swap), every parameter compared with our drafter's."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM

    from tlt_stream.drafter.export import eagle_tensors
    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.model import load_model
    from tlt_stream.rollout.vllm.backend import drafter_swap_tensors

    out = {}
    for name, m in models.items():
        ours = load_drafter(m["drafter"], load_model(m["policy"]))
        expected = _stacked(eagle_tensors(ours), "model.")  # our drafter's own tensors, in vLLM's layout
        for variant, export in (("float32", m["eagle"]), ("bfloat16+embedding", m["eagle_bf16"])):
            drafts = {}
            for way, tensors in (("build", load_file(str(export / "model.safetensors"))), ("swap", None)):
                config = engine_config(m["policy"], export)  # one per model: a config registers its layers
                with set_current_vllm_config(config), torch.device("cpu"):
                    drafts[way] = EagleLlamaForCausalLM(vllm_config=config, prefix="")
                    drafts[way].load_weights(iter(tensors.items()) if tensors else iter(drafter_swap_tensors(export)))
            build, swap = drafts["build"], drafts["swap"]
            layer = build.model.layers[0]
            want = dict(expected)
            if variant != "float32":  # bf16 export: compare at bf16, and the policy's embedding is in the file
                want = {k: v.to(torch.bfloat16) for k, v in want.items()}
                want["model.embed_tokens.weight"] = load_model(m["policy"]).embed_tokens.weight.to(torch.bfloat16)
            record = {
                "build": _compare(build, want),
                "swap": _compare(swap, {k: v for k, v in want.items() if "embed_tokens" not in k}),
                "input_layernorm": type(layer.input_layernorm).__name__,
                "params": sorted(n for n, _ in build.named_parameters()),
            }
            record["ok"] = (
                not any(record[k]["missing"] or record[k]["differ"] for k in ("build", "swap"))
                and record["input_layernorm"] == "Identity"
                and not any(n.startswith("lm_head") for n in record["params"])
            )
            out[f"{name}/{variant}"] = record
    return {"ok": all(r["ok"] for r in out.values()), "exports": out}


def check_loader_claims(models: dict[str, dict[str, Path]]) -> dict[str, Any]:
    """docs/vllm.md's two claims about vLLM's loader that the export relies on: a `lm_head.weight` in a draft
    file makes loading raise, an unexpected `.bias` is skipped without a word."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM

    m = models["llama"]
    tensors = load_file(str(m["eagle"] / "model.safetensors"))
    config = engine_config(m["policy"], m["eagle"])
    hidden = tensors["fc.weight"].shape[0]
    with set_current_vllm_config(config), torch.device("cpu"):
        draft = EagleLlamaForCausalLM(vllm_config=config, prefix="")
        try:
            draft.load_weights(iter({**tensors, "lm_head.weight": torch.zeros(256, hidden)}.items()))
            lm_head = "loaded"
        except Exception as exc:  # what vLLM raises is the evidence
            lm_head = f"raised {type(exc).__name__}"
        before = {n: p.detach().clone() for n, p in draft.named_parameters()}
        draft.load_weights(iter({**tensors, "layers.0.self_attn.o_proj.bias": torch.ones(hidden)}.items()))
        bias = "skipped" if not any("o_proj.bias" in n for n, _ in draft.named_parameters()) else "loaded"
    changed = [n for n, p in draft.named_parameters() if not torch.equal(p, before[n])]
    return {"ok": lm_head.startswith("raised") and bias == "skipped", "lm_head": lm_head, "bias": bias,
            "changed_by_reload": changed}  # fmt: skip


def _binds(function: Any, *args: Any, **kwargs: Any) -> bool:
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def check_api() -> dict[str, Any]:
    """The calls `rollout/vllm/backend.py` makes, bound to vLLM's own signatures (none can run without a GPU)."""
    import vllm
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as RunnerV1
    from vllm.v1.worker.gpu_worker import Worker

    from tlt_stream.rollout.vllm.backend import WORKER_EXTENSION, TltWorkerExtension

    ours = [n for n in dir(TltWorkerExtension) if not n.startswith("__")]  # what vLLM's init_worker checks

    def has_path(method: Any) -> bool:
        return "weights_path" in inspect.signature(method).parameters

    prompt = {"prompt_token_ids": [1]}
    seen = {
        "worker.reload_weights(weights_path=, is_checkpoint_format=)": _binds(
            Worker.reload_weights, None, weights_path="/p", is_checkpoint_format=True
        ),
        "runner_v1.reload_weights has weights_path": has_path(RunnerV1.reload_weights),
        "runner_v2.reload_weights has weights_path": has_path(RunnerV2.reload_weights),
        "runner_v1.get_draft_model": callable(getattr(RunnerV1, "get_draft_model", None)),
        "runner_v2.get_draft_model": callable(getattr(RunnerV2, "get_draft_model", None)),
        "LLMEngine.add_request(id, prompt, params)": _binds(LLMEngine.add_request, None, "k", prompt, None),
        "LLMEngine.step()": _binds(LLMEngine.step, None),
        "LLMEngine.has_unfinished_requests()": _binds(LLMEngine.has_unfinished_requests, None),
        "LLM.collective_rpc(name, args=)": _binds(vllm.LLM.collective_rpc, None, "tlt_reload_policy", args=("/p",)),
        "LLM.reset_prefix_cache()": _binds(vllm.LLM.reset_prefix_cache, None),
        "extension resolves by its qualified name": resolve_obj_by_qualname(WORKER_EXTENSION) is TltWorkerExtension,
        "extension names free on Worker": bool(ours) and not any(hasattr(Worker, n) for n in ours),
    }
    return {"ok": all(seen.values()), "seen": seen}


def run(name: str, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        record = fn(*args)
    except Exception as exc:  # a check that breaks is a finding: its error is the record
        record = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    record["seconds"] = round(time.perf_counter() - start, 2)
    print(f"[vllm_cpu_check] {name}: {'ok' if record['ok'] else 'FAILED'}", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    detected = stand_in_platform()
    result: dict[str, Any] = {"check": "vllm-cpu", "platform_detected": detected, "platform_used": "CpuPlatform"}
    for package in ("vllm", "torch", "transformers"):
        result[package] = importlib.metadata.version(package)
    models = make_models(work)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    m = models["llama"]
    with set_current_vllm_config(engine_config(m["policy"], m["eagle"])):  # one CPU process group, gloo
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{work / 'dist-init'}")  # fmt: skip
        initialize_model_parallel(1, 1)
    checks = {
        "fields": (check_fields, models),
        "sampling": (check_sampling,),
        "speculative": (check_speculative, models),
        "engine_config": (check_engine_config, models),
        "target_weights": (check_target_weights, models),
        "draft_weights": (check_draft_weights, models),
        "loader_claims": (check_loader_claims, models),
        "api": (check_api,),
    }
    result["checks"] = {name: run(name, fn, *fn_args) for name, (fn, *fn_args) in checks.items()}
    result["ok"] = all(r["ok"] for r in result["checks"].values())
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
