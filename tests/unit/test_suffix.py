"""The suffix automaton against brute force on random documents (hypothesis): counts, memory, matches, drafts,
chains."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_stream.rollout.suffix import SuffixAutomaton


def substrings(docs: dict[int, list[int]]) -> Counter:
    """Every substring of every document, with its number of occurrences."""
    out: Counter = Counter()
    for text in docs.values():
        for start in range(len(text)):
            for end in range(start + 1, len(text) + 1):
                out[tuple(text[start:end])] += 1
    return out


operations = st.lists(
    st.tuples(
        st.sampled_from(["extend", "extend", "extend", "remove"]),
        st.integers(0, 3),  # document
        st.lists(st.integers(0, 3), min_size=1, max_size=9),  # tokens (a small vocabulary: many repeats)
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(operations, st.lists(st.integers(0, 3), min_size=1, max_size=10), st.sampled_from([0, 4, 10_000]))
def test_counts_memory_match_and_draft_agree_with_brute_force(ops, context, rebuild_min) -> None:
    index, docs, dead = SuffixAutomaton(rebuild_min=rebuild_min), {}, 0
    for op, doc, tokens in ops:
        if op == "remove":
            if doc in docs:
                before = index.nodes
                index.remove(doc)
                dead += len(docs.pop(doc))
                if index.nodes < before:  # rebuilt: nothing removed is held any more
                    dead = 0
        else:
            index.extend(doc, tokens)
            docs.setdefault(doc, []).extend(tokens)
    expected = substrings(docs)
    for pattern, n in expected.items():
        assert index.count(pattern) == n, f"{pattern} occurs {n} times"
    for pattern in {tuple(random.Random(i).choices(range(5), k=1 + i % 4)) for i in range(40)} - set(expected):
        assert index.count(pattern) == 0, f"{pattern} does not occur in the documents kept"
    live = sum(map(len, docs.values()))
    assert dead <= max(rebuild_min, live), "removed text never outweighs what is kept past the rebuild bound"
    assert index.nodes <= 2 * (live + dead), "at most two states per token held (the automaton's bound)"
    assert sorted(index.documents, key=str) == sorted(docs, key=str)

    def continuations(suffix: tuple[int, ...]) -> Counter:
        return Counter({s[-1]: n for s, n in expected.items() if len(s) == len(suffix) + 1 and s[:-1] == suffix})

    _state, length = index.match(context, max_match=4)
    lengths = [n for n in range(min(4, len(context)), 0, -1) if continuations(tuple(context[-n:]))]
    assert length == (lengths[0] if lengths else 0), "the longest suffix that something followed"
    tokens, parents, matched = index.draft(context, depth=3, budget=5, max_match=4)
    assert matched == length
    chain, chain_matched = index.chain(context, length=4, max_match=4)
    assert chain_matched == length
    if not length:
        assert tokens == [] and parents == [] and chain == []
        return
    suffix = tuple(context[-length:])
    walked: tuple[int, ...] = ()
    for token in chain:
        seen = continuations(suffix + walked)
        assert seen[token] == max(seen.values()), "a chain takes the most frequent continuation at each step"
        walked += (token,)
    assert len(chain) == 4 or not continuations(suffix + walked), "it stops at its length or where nothing followed"
    paths: dict[int, tuple[int, ...]] = {0: ()}
    for i, (token, parent) in enumerate(zip(tokens, parents, strict=True), start=1):
        assert 0 <= parent < i
        paths[i] = (*paths[parent], token)
        assert continuations(suffix + paths[parent])[token] > 0, "every candidate really followed its path"
        assert len(paths[i]) <= 3
    for parent in set(parents):
        kids = [t for t, p in zip(tokens, parents, strict=True) if p == parent]
        assert len(kids) == len(set(kids)), "siblings are distinct tokens"
        seen = continuations(suffix + paths[parent])
        assert [seen[t] for t in kids] == sorted((seen[t] for t in kids), reverse=True), "best first"
    first_level = continuations(suffix)
    assert first_level[tokens[0]] == max(first_level.values()), "the most frequent continuation is tried first"
    whole = sum(first_level.values())
    assert len(tokens) == min(5, len(_tree(suffix, continuations, 3))), "the budget is filled when it can be"
    assert whole > 0


def _tree(suffix, continuations, depth) -> list[tuple[int, ...]]:
    """Every path of at most `depth` tokens that followed `suffix` (the nodes a draft may choose from)."""
    out, frontier = [], [()]
    for _ in range(depth):
        frontier = [(*path, t) for path in frontier for t in continuations(suffix + path)]
        out += frontier
    return out


def test_memory_follows_the_documents_kept_through_many_responses() -> None:
    """A worker's history: responses come and the oldest go; states stay proportional to what is kept."""
    rng = random.Random(0)
    index, kept = SuffixAutomaton(), []
    for doc in range(400):
        index.extend(doc, [rng.randrange(50) for _ in range(rng.randrange(20, 200))])
        kept.append(doc)
        if len(kept) > 16:
            index.remove(kept.pop(0))
    live = sum(len(index.tokens(d)) for d in kept)
    assert index.nodes <= 4 * max(live, 256), f"{index.nodes} states for {live} tokens kept"


def test_a_groups_finished_siblings_draft_the_rest_of_a_shared_passage() -> None:
    index = SuffixAutomaton()
    prompt = [9, 9, 1]
    index.extend("prompt", prompt)
    index.extend("sibling-0", [5, 6, 7, 8, 2, 3, 4])
    index.extend("sibling-1", [5, 6, 7, 8, 2, 3, 0])
    index.extend("running", [1, 5, 6])
    tokens, parents, matched = index.draft([*prompt, 1, 5, 6], depth=6, budget=6)
    assert matched >= 2 and tokens[:5] == [7, 8, 2, 3, 4] and parents[:5] == [0, 1, 2, 3, 4]
    assert tokens[5] == 0 and parents[5] == 4, "where the siblings disagree, both continuations compete"
