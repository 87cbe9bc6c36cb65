"""Unit and property tests of `RadixPrefixCache` against a reference model: a dict of cached prefixes.

The reference maps every cached page-aligned prefix (a tuple of tokens) to the page that holds its
last page of tokens, plus a lock count per prefix. A radix tree is a compressed form of exactly that.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.kvcache import RadixPrefixCache


def tree_as_dict(rc: RadixPrefixCache) -> dict[tuple[int, ...], int]:
    "Flatten the tree: every cached page-aligned prefix -> its last page."
    out, ps = {}, rc.page_size
    def go(node, prefix):
        for child in node.children.values():
            for i, page in enumerate(child.pages):
                out[prefix + child.key[:(i + 1) * ps]] = page
            go(child, prefix + child.key)
    go(rc.root, ())
    return out


class Reference:
    "Cached prefixes as a dict, with lock counts; the model the radix tree must agree with."
    def __init__(self, page_size: int):
        self.ps, self.pages, self.locks = page_size, {}, {}

    def prefixes(self, ids) -> list[tuple[int, ...]]:
        ids = tuple(ids)
        return [ids[:k] for k in range(self.ps, len(ids) + 1, self.ps)]

    def match(self, ids) -> tuple[int, list[int]]:
        got = []
        for p in self.prefixes(ids):
            if p not in self.pages: break
            got.append(self.pages[p])
        return len(got) * self.ps, got

    def insert(self, ids, pages) -> int:
        existing, _ = self.match(ids)
        for p, page in zip(self.prefixes(ids), pages):
            self.pages.setdefault(p, page)
        return existing

    def lock(self, key, delta: int):
        for p in self.prefixes(key): self.locks[p] = self.locks.get(p, 0) + delta

    def sizes(self) -> tuple[int, int]:
        locked = sum(1 for p in self.pages if self.locks.get(p, 0) > 0)
        return (len(self.pages) - locked) * self.ps, locked * self.ps


# ---------------------------------------------------------------- unit tests

def test_empty_tree_matches_nothing():
    rc = RadixPrefixCache(page_size=2)
    h, pages = rc.match_prefix([1, 2, 3])
    assert (h.cached_len, pages) == (0, [])
    assert rc.evict(10) == []


def test_insert_then_match_and_split():
    rc = RadixPrefixCache(page_size=1)
    h, existing = rc.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert existing == 0 and h.cached_len == 4
    h2, pages = rc.match_prefix([1, 2, 9])           # ends inside the edge: split after 2 tokens
    assert (h2.cached_len, pages) == (2, [10, 11])
    assert len(rc.root.children) == 1
    upper = next(iter(rc.root.children.values()))
    assert upper.key == (1, 2) and list(upper.children.values())[0].key == (3, 4)
    _, existing = rc.insert([1, 2, 7], [20, 21, 22])
    assert existing == 2
    assert tree_as_dict(rc) == {(1,): 10, (1, 2): 11, (1, 2, 3): 12, (1, 2, 3, 4): 13, (1, 2, 7): 22}
    rc.check_integrity()


def test_page_alignment():
    rc = RadixPrefixCache(page_size=4)
    _, existing = rc.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 1])   # the 9th token is not a whole page
    assert existing == 0 and tree_as_dict(rc) == {(1, 2, 3, 4): 0, (1, 2, 3, 4, 5, 6, 7, 8): 1}
    h, pages = rc.match_prefix([1, 2, 3, 4, 5, 6, 7, 0])            # 7 tokens agree, 4 are a whole page
    assert (h.cached_len, pages) == (4, [0])
    with pytest.raises(ValueError, match='pages'):
        rc.insert([1, 2, 3, 4], [0, 1])


def test_lock_protects_and_moves_sizes():
    rc = RadixPrefixCache(page_size=1)
    h, _ = rc.insert([1, 2, 3], [0, 1, 2])
    rc.insert([1, 2, 9], [3, 4, 5])
    assert (rc.evictable_size, rc.protected_size) == (4, 0)
    rc.lock(h)
    assert (rc.evictable_size, rc.protected_size) == (1, 3)
    rc.lock(h)                                          # second lock: counts, sizes unchanged
    assert (rc.evictable_size, rc.protected_size) == (1, 3)
    assert rc.evict(100) == [5]                         # only the unlocked leaf goes
    rc.unlock(h)
    assert rc.evict(100) == []
    rc.unlock(h)
    assert (rc.evictable_size, rc.protected_size) == (3, 0)
    with pytest.raises(RuntimeError, match='not locked'):
        rc.unlock(h)
    rc.check_integrity()


def test_lock_survives_split():
    rc = RadixPrefixCache(page_size=1)
    h, _ = rc.insert([1, 2, 3, 4], [0, 1, 2, 3])
    rc.lock(h)
    rc.match_prefix([1, 2, 0])                          # splits the locked edge
    rc.check_integrity()
    assert rc.protected_size == 4 and rc.evict(100) == []
    rc.unlock(h)
    rc.check_integrity()
    assert sorted(rc.evict(100)) == [0, 1, 2, 3]


def test_evict_is_lru_over_leaves():
    rc = RadixPrefixCache(page_size=1)
    rc.insert([1, 1], [0, 1])
    rc.insert([2, 2], [2, 3])
    rc.insert([3, 3], [4, 5])
    rc.match_prefix([1, 1])                             # [1, 1] is now the most recent
    assert rc.evict(2) == [2, 3]                        # [2, 2] was least recently used
    assert rc.evict(1) == [4, 5]                        # a whole edge goes; [1, 1] remains
    assert tree_as_dict(rc) == {(1,): 0, (1, 1): 1}


def test_evict_parent_after_children():
    rc = RadixPrefixCache(page_size=1)
    rc.insert([1, 2, 3], [0, 1, 2])
    rc.insert([1, 2, 4], [3, 4, 5])
    freed = rc.evict(100)
    assert sorted(freed) == [0, 1, 2, 5] and freed[-1] in (0, 1)   # the shared [1, 2] goes last
    assert rc.evictable_size == 0 and tree_as_dict(rc) == {}


# ---------------------------------------------------------------- random operation sequences

tokens = st.lists(st.integers(0, 3), max_size=10)
ops = st.lists(st.one_of(
    st.tuples(st.just('insert'), tokens),
    st.tuples(st.just('match'), tokens),
    st.tuples(st.just('lock'), st.integers(0, 20)),
    st.tuples(st.just('unlock'), st.integers(0, 20)),
    st.tuples(st.just('evict'), st.integers(0, 12)),
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 3]), ops)
def test_random_ops_agree_with_reference(page_size: int, operations):
    rc, ref = RadixPrefixCache(page_size), Reference(page_size)
    next_page = 0
    fresh = []          # handles obtained since the last eviction (the only ones safe to lock)
    locked = []         # (handle, key) pairs currently locked
    for op, arg in operations:
        if op == 'insert':
            n = len(arg) // page_size
            pages = list(range(next_page, next_page + n)); next_page += n
            h, existing = rc.insert(arg, pages)
            assert existing == ref.insert(arg, pages)
            assert h.cached_len == n * page_size
            fresh.append((h, tuple(arg[:n * page_size])))
        elif op == 'match':
            h, pages = rc.match_prefix(arg)
            assert (h.cached_len, pages) == ref.match(arg)
            assert rc.pages_of(h) == pages
            fresh.append((h, tuple(arg[:h.cached_len])))
        elif op == 'lock' and fresh:
            h, key = fresh[arg % len(fresh)]
            rc.lock(h); ref.lock(key, +1); locked.append((h, key))
        elif op == 'unlock' and locked:
            h, key = locked.pop(arg % len(locked))
            rc.unlock(h); ref.lock(key, -1)
        elif op == 'evict':
            before = dict(ref.pages)
            evictable_before = rc.evictable_size
            freed = rc.evict(arg * page_size)
            assert len(freed) == len(set(freed))
            gone = {p for p, page in before.items() if page in set(freed)}
            assert all(ref.locks.get(p, 0) == 0 for p in gone), "evicted a locked prefix"
            assert all(q in gone for p in gone for q in before if q[:len(p)] == p), "evicted a prefix but kept an extension"
            assert len(freed) * page_size >= min(arg * page_size, evictable_before)
            for p in gone: del ref.pages[p]
            fresh = list(locked)        # unlocked handles may point at evicted nodes now
        assert tree_as_dict(rc) == ref.pages
        assert (rc.evictable_size, rc.protected_size) == ref.sizes()
        rc.check_integrity()
    for h, key in locked: rc.unlock(h)
    rc.check_integrity()
    assert rc.protected_size == 0
    assert sorted(rc.evict(10 ** 6)) == sorted(ref.pages.values())
    assert rc.evictable_size == 0 and tree_as_dict(rc) == {}
