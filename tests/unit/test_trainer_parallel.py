"""rlkube.core.trainer.parallel: the mode chosen once per trainer process, and what each mode answers for the
operations the Trainer and its role call (the real group's collectives run in tests/integration/
test_trainer_data_parallel.py)."""

from __future__ import annotations

import threading

from rlkube.core.trainer.parallel import DataParallelGroup, Single, choose
from rlkube.core.trainer.publishers import AnnounceOnly, Publisher


class Store:
    def __init__(self):
        self.keys: dict[str, str] = {}

    def set(self, key, value):
        self.keys[key] = value

    def check(self, keys):
        return all(k in self.keys for k in keys)


class Rank:
    """The parts of a DataParallel membership the strategy reads without a collective."""

    def __init__(self, data_rank: int, data_size: int, store: Store):
        self.data_rank, self.data_size, self.store = data_rank, data_size, store
        self.is_leader = data_rank == 0
        self.layout = None
        self._stop = False

    def use_layout(self, layout):
        self.layout = layout

    def announce_stop(self):
        self._stop = True
        self.store.set("stop", "1")

    def stop_announced(self):
        return self._stop or self.store.check(["stop"])


def test_one_process_is_the_identity_and_leads():
    one = choose(None)
    assert isinstance(one, Single) and one.leader and one.reads_documents and not one.has_peers
    assert one.share(7) == 7 and one.consumer_index(3) == 3
    assert one.sum([2, 5]) == [2, 5] and one.max(4) == 4 and one.any(True) and not one.any(False)
    stop = threading.Event()
    assert not one.stopping(stop)
    stop.set()
    assert one.stopping(stop)
    assert one.signal("republish/0", raised=True) is False
    assert one.sync_from_leader(None, (3, 12), None, tensor_parallel=False) == (3, 12)


def test_a_group_splits_the_step_and_agrees_through_its_store():
    store = Store()
    ranks = [choose(Rank(r, 3, store)) for r in range(3)]
    assert all(isinstance(g, DataParallelGroup) for g in ranks)
    assert [g.share(7) for g in ranks] == [3, 2, 2]  # the lower ranks take the remainder
    assert [g.consumer_index(0) for g in ranks] == [0, 1, 2]  # one consumer per replica, not per node
    assert [g.leader for g in ranks] == [True, False, False]
    # SIGTERM on rank 2 stops every rank after the same step
    assert not ranks[0].stopping(threading.Event())
    term = threading.Event()
    term.set()
    assert ranks[2].stopping(term)
    assert ranks[0].stopping(threading.Event()) and ranks[1].stopping(threading.Event())
    # a flag rank 0 raises is seen by the others
    assert not ranks[1].signal("republish/0", raised=False)
    assert ranks[0].signal("republish/0", raised=True)
    assert ranks[1].signal("republish/0", raised=False)


def test_the_model_parallel_layout_is_applied_when_the_mode_is_chosen():
    rank = Rank(0, 2, Store())
    choose(rank, layout="layout")
    assert rank.layout == "layout"


def test_publisher_capabilities_are_declared_with_defaults():
    assert (Publisher.streams, Publisher.rejoin_pending) == (False, False)
    assert (AnnounceOnly.streams, AnnounceOnly.rejoin_pending) == (False, False)
