"""`StopStrings` on a real byte-level BPE: the windowed check stops exactly where decoding the whole response
at every length first shows a stop string, including strings of multi-byte characters cut across tokens."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tlt_stream.rollout.stops import StopStrings

# One xdist worker runs this module, so its module-scoped fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_stop_strings")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [f"Étape {i}: {i} → {i * 2} ✓ donc la réponse est {i}. </answer>" for i in range(200)]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def naive_first_stop(tokenizer, tokens: list[int], strings: list[str]) -> int | None:
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n], skip_special_tokens=False)
        if any(s in text for s in strings):
            return n
    return None


@pytest.mark.parametrize("strings", [["</answer>"], ["→ 8", "✓"], ["réponse est 1"], ["é"]])
def test_the_windowed_check_stops_where_the_whole_text_first_shows_a_stop_string(tokenizer, strings) -> None:
    stop = StopStrings(tokenizer, strings)
    rng = random.Random(0)
    texts = [f"Étape {i}: {i} → {i * 2} ✓ donc la réponse est {i}. </answer> suite" for i in range(1, 30)]
    sequences = [tokenizer.encode(t) for t in texts]
    vocab = [i for i in range(len(tokenizer)) if i != tokenizer.eos_token_id]
    sequences += [[rng.choice(vocab) for _ in range(rng.randint(1, 120))] for _ in range(200)]  # bytes cut anyhow
    found = 0
    for tokens in sequences:
        expected = naive_first_stop(tokenizer, tokens, strings)
        assert stop.first_stop(tokens) == expected, tokenizer.decode(tokens)
        found += expected is not None
    assert found >= 10, "the strings occur: the property is exercised"


def test_a_long_response_is_checked_on_its_tail_only(tokenizer) -> None:
    stop = StopStrings(tokenizer, ["</answer>"])
    tokens = tokenizer.encode("</answer>" + " x" * 500)
    assert not stop(tokens), "an old occurrence far behind the newest token is not re-found at every step"
    assert stop.window == 4 * len("</answer>") + 8


@pytest.mark.parametrize("bad", [[], [""], ["ok", 3]])
def test_bad_stop_strings_are_refused(tokenizer, bad) -> None:
    with pytest.raises(ValueError, match="stop string"):
        StopStrings(tokenizer, bad)
