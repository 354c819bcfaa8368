"""The byte-bounded map behind the front end's memories (unicoll.cache): second chance, approximately LRU."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from unicoll.cache import BoundedCache


def test_entries_not_used_since_they_were_stored_go_first_once_the_bytes_exceed_the_bound():
    cache = BoundedCache(100)
    cache.put("a", 1, nbytes=40)
    cache.put("b", 2, nbytes=40)
    assert cache.get("a") == 1  # "a" used, "b" not
    cache.put("c", 3, nbytes=40)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3)
    assert cache.nbytes == 80 and len(cache) == 2


def test_entries_used_every_step_stay_while_an_endless_stream_of_others_passes_through():
    cache = BoundedCache(1_000)
    for step in range(2_000):
        for hot in ("forward", "backward"):
            if cache.get(hot) is None:
                assert step == 0, f"{hot} was dropped at step {step}"
                cache.put(hot, hot, nbytes=100)
        cache.put(("once", step), step, nbytes=100)  # new counts every step: never asked for again
        assert cache.nbytes <= 1_000
    assert len(cache) == 10


def test_when_every_older_entry_was_used_the_new_one_goes_and_stays_when_stored_again():
    cache = BoundedCache(100)
    cache.put("a", 1, nbytes=50)
    cache.put("b", 2, nbytes=50)
    cache.get("a"), cache.get("b")
    cache.put("c", 3, nbytes=50)  # "c" goes; the sweep unmarked "a" and "b"
    assert (len(cache), cache.nbytes) == (2, 100)
    cache.put("c", 3, nbytes=50)  # now the oldest unused entry, "a", goes
    assert (cache.get("a"), cache.get("b"), cache.get("c"), cache.nbytes) == (None, 2, 3, 100)


def test_storing_a_key_again_replaces_its_entry_and_its_bytes():
    cache = BoundedCache(100)
    cache.put("a", 1, nbytes=70)
    cache.put("a", 2, nbytes=30)
    cache.put("b", 3, nbytes=70)  # fits only because "a" now counts 30
    assert (cache.get("a"), cache.get("b"), cache.nbytes) == (2, 3, 100)


def test_an_entry_larger_than_the_bound_is_not_stored_and_evicts_nothing():
    cache = BoundedCache(100)
    cache.put("a", 1, nbytes=60)
    cache.put("big", 2, nbytes=101)
    assert (cache.get("a"), cache.get("big"), cache.nbytes) == (1, None, 60)


def test_an_endless_stream_of_keys_stays_within_the_bound_and_frees_what_it_dropped():
    cache = BoundedCache(10_000)
    first = np.zeros(10)
    alive = weakref.ref(first)
    cache.put(0, first, nbytes=first.nbytes + 100)
    del first
    for i in range(1, 5_000):
        value = np.zeros(i % 50 + 1)
        cache.put(i, value, nbytes=value.nbytes + 100)
        assert cache.nbytes <= 10_000
    gc.collect()
    assert alive() is None
    assert cache.nbytes == sum(v.nbytes + 100 for v in (cache.get(k) for k in range(4_900, 5_000)) if v is not None)


def test_clear_forgets_every_entry_and_its_bytes():
    cache = BoundedCache(100)
    cache.put("a", 1, nbytes=60)
    cache.clear()
    assert (cache.get("a"), cache.nbytes, len(cache)) == (None, 0, 0)
