"""The feed: batches made ahead on a background thread are the batches asked for, whatever it guessed."""

import threading

import numpy as np
import pytest

from transformer.train.feed import Feed


class Maker:
    """make(index) -> a batch that names its index, recording which thread made which index."""

    def __init__(self, fail_at: int | None = None):
        self.made: list[tuple[int, str]] = []
        self.fail_at = fail_at

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        if index == self.fail_at:
            raise ValueError(f"no batch {index}")
        self.made.append((index, threading.current_thread().name))
        return {"tokens": np.full((2, 3), index)}


def put(host):
    return {k: v + 1000 for k, v in host.items()}  # stands for the device copy: a different object


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_every_index_asked_for_gets_its_own_batch(depth):
    make = Maker()
    feed = Feed(make, put, depth)
    asked = [0, 1, 2, 3, 2, 3, 9, 10, 4]  # a rollback to 2, then batches skipped, then back
    for i, index in enumerate(asked):
        host, placed = feed.get(index)
        assert (host["tokens"] == index).all() and (placed["tokens"] == index + 1000).all()
        feed.ahead(asked[i + 1 :])
    feed.close()
    assert {index for index, _ in make.made} >= set(asked)


def test_a_wrong_guess_is_dropped_and_the_asked_batch_made():
    make = Maker()
    feed = Feed(make, put, 2)
    feed.ahead([5, 6])  # the loop expected steps on batches 5 and 6, then rolled back to 3
    host, placed = feed.get(3)
    assert (host["tokens"] == 3).all() and (placed["tokens"] == 1003).all()
    feed.ahead([4])
    assert (feed.get(4)[0]["tokens"] == 4).all()
    feed.close()


def test_guessed_batches_are_made_on_the_feed_thread_and_not_again():
    make = Maker()
    feed = Feed(make, put, 2)
    feed.get(0)
    feed.ahead([1, 2, 3])  # depth 2: 1 and 2 only
    for index in (1, 2):
        feed.get(index)
    feed.close()
    assert [i for i, _ in make.made] == [0, 1, 2]
    assert make.made[0][1] == threading.current_thread().name  # nothing was guessed for the first
    assert all(name.startswith("feed") for _, name in make.made[1:])


def test_no_thread_without_prefetch():
    make = Maker()
    feed = Feed(make, put, 0)
    feed.ahead([1, 2])
    feed.get(1)
    feed.close()
    assert make.made == [(1, threading.current_thread().name)]


def test_a_failure_making_a_batch_is_raised_by_the_step_that_needs_it():
    feed = Feed(Maker(fail_at=2), put, 1)
    feed.get(1)
    feed.ahead([2])  # made (and failed) on the thread: nothing raised yet
    with pytest.raises(ValueError, match="no batch 2"):
        feed.get(2)
    feed.ahead([5])
    feed.close()


def test_a_failed_guess_that_is_never_asked_for_raises_nothing():
    feed = Feed(Maker(fail_at=2), put, 1)
    feed.ahead([2])
    feed.ahead([3])  # the run went elsewhere (a rollback): the failed guess is dropped
    assert (feed.get(3)[0]["tokens"] == 3).all()
    feed.close()
