"""sk.prefetch: order, shardings from the plan, how far ahead it draws, the checkpoint
position, exhaustion and errors."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardkit as sk


class Counted:
    """Batches {"x": (8, 4) filled with n} for n = 0.. count-1; records how many were drawn."""

    def __init__(self, count):
        self.count, self.drawn = count, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.drawn == self.count:
            raise StopIteration
        self.drawn += 1
        return {"x": np.full((8, 4), self.drawn - 1, np.float64), "n": np.full((8,), self.drawn - 1, np.int32)}

    def position(self):
        return {"drawn": self.drawn}


@pytest.fixture(scope="module")
def step():
    plan = sk.Plan(sk.make_mesh("data=4,tensor=2"), rules=[(r".*", ())])
    step = sk.train_step(plan, optax.sgd(0.1))(lambda p, b: (b["x"] @ p["w"]).mean())
    step.init({"w": np.ones((4, 1), np.float32)})
    return step


def test_order_shardings_lookahead_and_position(step):
    source = Counted(5)
    feed = sk.prefetch(source, step, size=2, position=source.position)
    assert source.drawn == 2 and feed.position == {"drawn": 0}
    want = step.place_batch(Counted(1).__next__())[1]
    got = []
    for i, batch in enumerate(feed):
        assert isinstance(batch["x"], jax.Array) and batch["x"].dtype == np.float32  # as the step casts
        assert batch["x"].sharding == want["x"] and batch["n"].sharding == want["n"]
        assert batch["x"].sharding.spec == P("data")
        assert feed.position == {"drawn": i + 1}  # resume after batch i: the source is further on
        assert source.drawn == min(i + 3, 5)
        got.append(int(batch["n"][0]))
    assert got == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):
        next(feed)  # stays exhausted


def test_plan_placement_and_errors(step):
    feed = sk.prefetch(iter([{"x": np.zeros((8, 4), np.float32)}]), step.plan, size=1)
    assert next(feed)["x"].sharding == step.plan.batch_shardings({"x": np.zeros((8, 4))})["x"]
    assert list(feed) == [] and feed.position is None
    assert list(sk.prefetch([], step)) == []
    with pytest.raises(ValueError, match="size must be a positive integer.*got 0"):
        sk.prefetch([], step, size=0)
    with pytest.raises(ValueError, match="must be an sk.TrainStep or sk.Plan, got Mesh"):
        sk.prefetch([], step.plan.mesh)
    with pytest.raises(sk.ShardingError):  # 6 rows do not split over data=4: named by the plan
        sk.prefetch([{"x": np.zeros((6, 4), np.float32)}], step)
