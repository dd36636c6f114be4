"""The suffix trie against brute force on random documents (hypothesis): counts, memory, matches, drafts."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_stream.rollout.suffix import SuffixTrie

DEPTH = 6


def substrings(docs: dict[int, list[int]], depth: int) -> Counter:
    out: Counter = Counter()
    for text in docs.values():
        for start in range(len(text)):
            for end in range(start + 1, min(start + depth, len(text)) + 1):
                out[tuple(text[start:end])] += 1
    return out


def walk(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            out[(*path, token)] = child.count
            stack.append(((*path, token), child))
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


@settings(max_examples=150, deadline=None)
@given(operations, st.lists(st.integers(0, 3), min_size=1, max_size=10))
def test_counts_memory_match_and_draft_agree_with_brute_force(ops, context) -> None:
    trie, docs = SuffixTrie(max_depth=DEPTH), {}
    for op, doc, tokens in ops:
        if op == "remove":
            if doc in docs:
                trie.remove(doc)
                del docs[doc]
        else:
            trie.extend(doc, tokens)
            docs.setdefault(doc, []).extend(tokens)
    expected = substrings(docs, DEPTH)
    assert walk(trie) == dict(expected), "every substring of <= max_depth tokens, counted, and nothing else"
    assert trie.nodes == len(expected), "freed nodes are not held: memory follows the documents kept"

    def continuations(suffix: tuple[int, ...]) -> Counter:
        return Counter({s[-1]: n for s, n in expected.items() if len(s) == len(suffix) + 1 and s[:-1] == suffix})

    _node, length = trie.match(context, max_match=4)
    lengths = [n for n in range(min(4, len(context), DEPTH - 1), 0, -1) if continuations(tuple(context[-n:]))]
    assert length == (lengths[0] if lengths else 0), "the longest suffix that something followed"
    tokens, parents, matched = trie.draft(context, depth=3, budget=5, max_match=4)
    assert matched == length
    if not length:
        assert tokens == [] and parents == []
        return
    suffix = tuple(context[-length:])
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
    best = max(first_level.values())
    assert first_level[tokens[0]] == best, "the most frequent continuation is tried first"


def test_a_groups_finished_siblings_draft_the_rest_of_a_shared_passage() -> None:
    trie = SuffixTrie(max_depth=16)
    prompt = [9, 9, 1]
    trie.extend("prompt", prompt)
    trie.extend("sibling-0", [5, 6, 7, 8, 2, 3, 4])
    trie.extend("sibling-1", [5, 6, 7, 8, 2, 3, 0])
    trie.extend("running", [1, 5, 6])
    tokens, parents, matched = trie.draft([*prompt, 1, 5, 6], depth=6, budget=6)
    assert matched >= 2 and tokens[:5] == [7, 8, 2, 3, 4] and parents[:5] == [0, 1, 2, 3, 4]
    assert tokens[5] == 0 and parents[5] == 4, "where the siblings disagree, both continuations compete"
