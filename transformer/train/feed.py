"""The next steps' batches, made on a background thread and put on the devices while this step runs.

A batch is a pure function of its data index (`Data.train_batch`), so making it early changes no
result: `Feed` only decides *when* it is made. The loop asks for the batch of one index and says
which indices the next steps will read (`data.prefetch` of them); those are made and put ahead, each
host-to-device copy issued from the thread while the device computes. A guess the loop later
contradicts (a rollback, or batches skipped after a spike) is dropped and the batch made on demand,
so what is fed is always the batch asked for.

Worth it where a batch costs host time the device would wait on: the corrupting objectives (MLM,
span corruption: ~1.5 ms a batch of 16 x 256 on a 2-core CPU, against 0.04 ms for causal windows)
and any host-to-device copy on an accelerator. On XLA:CPU the step runs on the same cores, so there
it buys little (benchmarks/README.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

Host = dict[str, np.ndarray]
Placed = dict[str, jax.Array]


class Feed:
    """`get(index)` is `(make(index), put(make(index)))`, made ahead when `ahead(...)` named it."""

    def __init__(self, make: Callable[[int], Host], put: Callable[[Host], Placed], depth: int):
        self.make, self.put, self.depth = make, put, depth
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feed") if depth > 0 else None
        self.futures: dict[int, Future] = {}

    def _prepare(self, index: int) -> tuple[Host, Placed]:
        host = self.make(index)
        return host, self.put(host)

    def get(self, index: int) -> tuple[Host, Placed]:
        """The host rows and the placed batch of data index `index`."""
        future = self.futures.pop(index, None)
        return future.result() if future is not None else self._prepare(index)

    def ahead(self, indices: Iterable[int]) -> None:
        """Start making the batches of the next steps' data indices (the first `depth` of them); a
        batch made for an index no longer among them is dropped."""
        if self.pool is None:
            return
        wanted = list(itertools.islice(indices, self.depth))
        for index in [i for i in self.futures if i not in wanted]:
            self.futures.pop(index).cancel()
        for index in wanted:
            if index not in self.futures:
                self.futures[index] = self.pool.submit(self._prepare, index)

    def close(self) -> None:
        """Drop what was made ahead and stop the thread (a failure making it is not this run's concern
        any more: the loop only raises for batches it trains on). Waits for the batch being made, if
        any (one batch, milliseconds), so that no copy to the devices outlives the loop."""
        self.futures.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
