"""The page pool: reference counts, prefix-cache lookup, LRU eviction."""

import pytest
from plinth.engine.block_manager import BlockPool, OutOfPages, hash_pages


def test_allocate_release_and_reuse():
    pool = BlockPool(4, 7)
    a = pool.allocate(3)
    assert pool.num_free == 1 and len(set(a)) == 3
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    pool.release(a)
    assert pool.num_free == 4


def test_hash_chain_depends_on_all_previous_pages():
    a = hash_pages([1, 2, 3, 4, 5, 6], 2)
    b = hash_pages([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and a[0] != b[0] and a[2] != b[2]  # same tokens, different prefix
    assert hash_pages([1, 2, 3, 4, 5], 2) == a[:2]  # only full pages
    assert hash_pages([1, 2, 3, 4, 5, 6], 2, hash_seed=1) != a  # a different model never matches
    assert hash_pages([1, 2, 3, 4, 5, 6], 2, start=a[:1]) == a


def test_cached_pages_survive_release_and_are_found():
    pool = BlockPool(8, 2)
    pages = pool.allocate(3)
    hashes = hash_pages([1, 2, 3, 4, 5, 6], 2)
    for p, h in zip(pages, hashes):
        pool.register(p, h)
    pool.release(pages)
    assert pool.num_free == 8
    assert pool.lookup(hashes) == pages
    assert pool.num_free == 5
    pool.release(pages)


def test_lru_evicts_unhashed_first_then_oldest():
    pool = BlockPool(4, 1)
    old, new = pool.allocate(2)
    pool.register(old, 111)
    pool.register(new, 222)
    pool.release([old])
    pool.release([new])
    # two never-hashed pages are taken before any cached one
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint({old, new})
    (evicted,) = pool.allocate(1)
    assert evicted == old and not pool.contains(111) and pool.contains(222)


def test_shared_pages_need_every_holder_to_release():
    pool = BlockPool(4, 4)
    pages = pool.allocate(2)
    pool.share(pages)
    pool.release(pages)
    assert pool.num_free == 2
    pool.release(pages)
    assert pool.num_free == 4
    with pytest.raises(AssertionError):
        pool.release(pages)


def test_disabled_cache_finds_nothing():
    pool = BlockPool(4, 2, enable_caching=False)
    (p,) = pool.allocate(1)
    pool.register(p, 5)
    pool.release([p])
    assert pool.lookup([5]) == []
