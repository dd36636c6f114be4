"""The torch runtime against transformers' own Qwen2/Llama implementations, plus KV-cache bookkeeping."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from tlt_stream.model import CheckpointError, KVCache, Transformer, load_model, load_spec

ATOL = 1e-4

CONFIGS = {
    "qwen2-mha-untied": (Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=4)),
    "qwen2-gqa2-tied": (Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-gqa4-bias": (
        LlamaConfig,
        dict(num_attention_heads=8, num_key_value_heads=2, attention_bias=True, mlp_bias=True, vocab_size=101),
    ),
    "llama-gqa4-tied-headdim": (
        LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True, rope_theta=500.0),
    ),
    "llama-gqa2-nobias": (LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=False)),
}


def make_checkpoint(tmp_path: Path, name: str, **save_kwargs) -> tuple[torch.nn.Module, Path]:
    config_cls, overrides = CONFIGS[name]
    kwargs = dict(
        hidden_size=64,
        intermediate_size=88,
        num_hidden_layers=2,
        vocab_size=97,
        initializer_range=0.2,
        rms_norm_eps=1e-5,
    )
    kwargs.update(overrides)
    torch.manual_seed(zlib.crc32(name.encode()))
    hf = AutoModelForCausalLM.from_config(config_cls(**kwargs)).eval()
    for p in hf.parameters():
        if p.ndim == 1:
            p.data.normal_(1.0, 0.2)
    path = tmp_path / name
    hf.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return hf, path


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_incremental_decode_match_transformers(tmp_path: Path, name: str) -> None:
    hf, path = make_checkpoint(tmp_path, name)
    model = load_model(path)
    vocab = model.spec.vocab_size
    gen = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, vocab, (2, 14), generator=gen)  # [B, T_total]
    cache = model.new_cache(3, 32)
    with torch.no_grad():
        hidden = model(seqs[:, :8], torch.arange(8).expand(2, 8), cache)
        cache.advance(torch.tensor([8, 8]))
        ours = [model.logits(hidden)]
        for step in (1, 1, 2, 1, 1):
            t0 = int(cache.lengths[0])
            hidden = model(seqs[:, t0 : t0 + step], torch.arange(t0, t0 + step).expand(2, step), cache)
            cache.advance(torch.tensor([step, step]))
            ours.append(model.logits(hidden))
    ours_all = torch.cat(ours, dim=1)  # [B, 14, V]
    for b in range(2):
        torch.testing.assert_close(ours_all[b], hf_logits(hf, seqs[b].tolist()), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen2-gqa2-tied", "llama-gqa4-bias"])
def test_padded_batch_of_mixed_lengths_matches_unbatched(tmp_path: Path, name: str) -> None:
    hf, path = make_checkpoint(tmp_path, name)
    model = load_model(path)
    gen = torch.Generator().manual_seed(2)
    lens = [3, 9, 5, 1]
    prompts = [torch.randint(0, model.spec.vocab_size, (n + 2,), generator=gen).tolist() for n in lens]
    t = max(lens)
    ids = torch.zeros(len(lens), t, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = torch.tensor(prompts[b][:n])
    num_new = torch.tensor(lens)
    cache = model.new_cache(4, 16)
    with torch.no_grad():
        prefill = model.logits(model(ids, torch.arange(t).expand(len(lens), t), cache, num_new=num_new))
        assert torch.isfinite(prefill).all()
        cache.advance(num_new)
        decoded = []
        for i in range(2):
            step_ids = torch.tensor([[p[n + i]] for p, n in zip(prompts, lens, strict=True)])
            decoded.append(model.logits(model(step_ids, cache.lengths[:4, None].clone(), cache)))
            cache.advance(torch.ones(4, dtype=torch.long))
    for b, n in enumerate(lens):
        ref = hf_logits(hf, prompts[b])
        torch.testing.assert_close(prefill[b, :n], ref[:n], atol=ATOL, rtol=0)
        torch.testing.assert_close(decoded[0][b, 0], ref[n], atol=ATOL, rtol=0)
        torch.testing.assert_close(decoded[1][b, 0], ref[n + 1], atol=ATOL, rtol=0)


# A token tree: node i's parent (-1 = the committed context), node tokens drawn at random.
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, -1]


def tree_paths(parents: list[int]) -> list[list[int]]:
    paths = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def test_tree_mask_equals_separate_path_forwards(tmp_path: Path) -> None:
    _, path = make_checkpoint(tmp_path, "llama-gqa4-bias")
    model = load_model(path)
    vocab = model.spec.vocab_size
    gen = torch.Generator().manual_seed(3)
    paths = tree_paths(TREE_PARENTS)
    n = len(TREE_PARENTS)
    contexts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in (6, 3)]
    nodes = torch.randint(0, vocab, (2, n), generator=gen)  # [B, N]
    tree_mask = torch.zeros(n, n, dtype=torch.bool)
    for node, p in enumerate(paths):
        tree_mask[node, p] = True
    depth = torch.tensor([len(p) - 1 for p in paths])
    cache = model.new_cache(2, 32)
    ctx_ids = torch.zeros(2, 6, dtype=torch.long)
    for b, c in enumerate(contexts):
        ctx_ids[b, : len(c)] = torch.tensor(c)
    ctx_lens = torch.tensor([len(c) for c in contexts])
    with torch.no_grad():
        model(ctx_ids, torch.arange(6).expand(2, 6), cache, num_new=ctx_lens)
        cache.advance(ctx_lens)
        positions = ctx_lens[:, None] + depth  # [B, N]
        num_new = torch.tensor([n, n - 2])  # row 1's last two nodes are padding
        tree_hidden = model(nodes, positions, cache, tree_mask=tree_mask.expand(2, n, n), num_new=num_new)
        assert torch.isfinite(tree_hidden).all()
        for b, c in enumerate(contexts):
            for node, p in enumerate(paths[: int(num_new[b])]):
                seq = torch.tensor([c + nodes[b, p].tolist()])
                fresh = model.new_cache(1, 32)
                ref = model(seq, torch.arange(seq.shape[1])[None], fresh)[0, -1]
                torch.testing.assert_close(tree_hidden[b, node], ref, atol=ATOL, rtol=0)


def test_spec_offset_drafts_levels_without_committing(tmp_path: Path) -> None:
    _, path = make_checkpoint(tmp_path, "qwen2-gqa2-tied")
    model = load_model(path)
    paths = tree_paths(TREE_PARENTS)
    n = len(TREE_PARENTS)
    gen = torch.Generator().manual_seed(6)
    context = torch.randint(0, 97, (2, 4), generator=gen)
    nodes = torch.randint(0, 97, (2, n), generator=gen)
    tree_mask = torch.zeros(n, n, dtype=torch.bool)
    for node, p in enumerate(paths):
        tree_mask[node, p] = True
    positions = 4 + torch.tensor([len(p) - 1 for p in paths]).expand(2, n)
    with torch.no_grad():
        cache = model.new_cache(2, 16)
        model(context, torch.arange(4).expand(2, 4), cache)
        cache.advance(torch.tensor([4, 4]))
        whole = model(nodes, positions, cache, tree_mask=tree_mask.expand(2, n, n))
        parts = []
        for lo, hi in ((0, 3), (3, 6), (6, n)):
            mask = tree_mask[lo:hi, :hi].expand(2, hi - lo, hi)
            parts.append(model(nodes[:, lo:hi], positions[:, lo:hi], cache, tree_mask=mask, spec_offset=lo))
        assert cache.lengths[:2].tolist() == [4, 4]
        torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=ATOL, rtol=0)
        chain = model(nodes, 4 + torch.arange(n).expand(2, n), cache)
        steps = [model(nodes[:, i : i + 1], torch.full((2, 1), 4 + i), cache, spec_offset=i) for i in range(n)]
        torch.testing.assert_close(torch.cat(steps, dim=1), chain, atol=ATOL, rtol=0)


def test_compact_after_tree_verification_continues_like_the_accepted_path(tmp_path: Path) -> None:
    hf, path = make_checkpoint(tmp_path, "qwen2-gqa2-tied")
    model = load_model(path)
    paths = tree_paths(TREE_PARENTS)
    n = len(TREE_PARENTS)
    gen = torch.Generator().manual_seed(4)
    context = torch.randint(0, 97, (2, 5), generator=gen)
    nodes = torch.randint(0, 97, (2, n), generator=gen)
    tree_mask = torch.zeros(n, n, dtype=torch.bool)
    for node, p in enumerate(paths):
        tree_mask[node, p] = True
    depth = torch.tensor([len(p) - 1 for p in paths])
    accepted = [paths[6], paths[5][:1]]  # row 0 keeps 0-1-3-6, row 1 keeps only node 0
    src_idx = torch.zeros(2, 4, dtype=torch.long)
    count = torch.tensor([len(a) for a in accepted])
    for b, a in enumerate(accepted):
        src_idx[b, : len(a)] = torch.tensor(a)
    nxt = torch.randint(0, 97, (2, 1), generator=gen)
    cache = model.new_cache(2, 32)
    with torch.no_grad():
        model(context, torch.arange(5).expand(2, 5), cache)
        cache.advance(torch.tensor([5, 5]))
        model(nodes, 5 + depth.expand(2, n), cache, tree_mask=tree_mask.expand(2, n, n))
        cache.compact(2, src_idx, count)
        assert cache.lengths[:2].tolist() == [9, 6]
        logits = model.logits(model(nxt, cache.lengths[:2, None].clone(), cache))
    for b, a in enumerate(accepted):
        seq = context[b].tolist() + nodes[b, a].tolist() + nxt[b].tolist()
        torch.testing.assert_close(logits[b, 0], hf_logits(hf, seq)[-1], atol=ATOL, rtol=0)


def test_compact_moves_entries_and_advances_lengths() -> None:
    cache = KVCache(2, 3, 1, 10, 2)
    cache.k.copy_(torch.arange(cache.k.numel(), dtype=torch.float).view_as(cache.k))
    cache.v.copy_(-cache.k)
    before = cache.k.clone()
    cache.lengths[:3] = torch.tensor([2, 4, 1])
    cache.compact(torch.tensor([2, 0]), torch.tensor([[0, 3, 4], [2, 5, 0]]), torch.tensor([3, 1]))
    assert cache.lengths.tolist() == [3, 4, 4]
    torch.testing.assert_close(cache.k[:, 2, :, 1:4], before[:, 2, :, [1, 4, 5]])
    torch.testing.assert_close(cache.k[:, 0, :, 2], before[:, 0, :, 4])
    torch.testing.assert_close(cache.k[:, 1], before[:, 1])
    torch.testing.assert_close(cache.v, -cache.k)


def test_move_slot_keeps_a_sequence_decodable(tmp_path: Path) -> None:
    hf, path = make_checkpoint(tmp_path, "llama-gqa2-nobias")
    model = load_model(path)
    seq = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = model.new_cache(3, 16)
    with torch.no_grad():
        model(torch.tensor([seq[:6]]), torch.arange(6)[None], cache, first_slot=2)
        cache.advance(torch.tensor([6]), first_slot=2)
        cache.move_slot(2, 0)
        assert cache.lengths.tolist() == [6, 0, 6]
        logits = model.logits(model(torch.tensor([[seq[6]]]), torch.tensor([[6]]), cache))
    torch.testing.assert_close(logits[0, 0], hf_logits(hf, seq)[-1], atol=ATOL, rtol=0)


def test_sharded_checkpoint_and_bf16_load(tmp_path: Path) -> None:
    hf, path = make_checkpoint(tmp_path, "qwen2-mha-untied", max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").is_file()
    seq = list(range(0, 90, 9))
    cases = [(torch.float32, None, ATOL), (torch.bfloat16, None, 0.3), (torch.bfloat16, torch.float32, 0.3)]
    for dtype, cache_dtype, atol in cases:
        model = load_model(path, dtype=dtype)
        assert model.dtype == dtype
        cache = model.new_cache(1, 16, dtype=cache_dtype)
        with torch.no_grad():
            logits = model.logits(model(torch.tensor([seq]), torch.arange(len(seq))[None], cache))
            cache.advance(torch.tensor([len(seq)]))
            step = model.logits(model(torch.tensor([[5]]), torch.tensor([[len(seq)]]), cache))
        torch.testing.assert_close(logits[0].float(), hf_logits(hf, seq), atol=atol, rtol=0)
        torch.testing.assert_close(step[0, -1].float(), hf_logits(hf, [*seq, 5])[-1], atol=atol, rtol=0)


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_checkpoint_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_model(tmp_path / "empty")

    _, path = make_checkpoint(tmp_path, "llama-gqa2-nobias")
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="unsupported architectures"):
        load_spec(path)
    _edit_config(path, architectures=["LlamaForCausalLM"], rope_parameters={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(CheckpointError, match="no 'low_freq_factor'"):
        load_spec(path)
    _edit_config(path, rope_parameters=None, rope_scaling={"type": "su", "factor": 2.0})
    with pytest.raises(CheckpointError, match="RoPE type 'su'"):
        load_spec(path)
    _edit_config(path, rope_scaling=None, rope_theta=1e6)
    assert load_spec(path).rope_theta == 1e6

    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_model(path)

    _, qwen = make_checkpoint(tmp_path, "qwen2-mha-untied")
    _edit_config(qwen, use_sliding_window=True, sliding_window=4, max_window_layers=0, layer_types=None)
    assert load_spec(qwen).sliding_window == 4  # refused by an engine whose rows outgrow it
    _edit_config(qwen, layer_types=["full_attention"] * 2)  # transformers' layers then slide nowhere
    assert load_spec(qwen).sliding_window is None


def test_forward_rejects_overflowing_the_cache() -> None:
    from tlt_stream.model import ModelSpec

    model = Transformer(ModelSpec("qwen2", 11, 16, 24, 1, 2, 1, 8)).eval()
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="exceeds the cache"), torch.no_grad():
        model(torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], cache)
