"""The plain-loop image bench's accounting (hotloop.bench.image_loop) on the CPU: what it times, counts and
alternates, with a step whose cost is known; the GPU figures themselves come from the bench, not tests."""
import time

import pytest
import torch

from hotloop.bench import image_loop


class Numbers(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3,), float(i)), i


def test_plain_loop_counts_every_image_and_times_the_steady_window():
    batch, batches = 4, 12
    loader = torch.utils.data.DataLoader(Numbers(batch * batches + 3), batch_size=batch, drop_last=False)
    seen = []

    def step(x, y):  # 10 ms of CPU: the process's CPU time is read in clock ticks
        seen.extend(y.tolist())
        end = time.thread_time() + 0.01
        while time.thread_time() < end:
            pass

    got = image_loop.plain_loop(step, loader, torch.device("cpu"), warmup=3, steady=5)
    assert seen == list(range(batch * batches + 3))  # the whole epoch, the short last batch included
    assert got["images"] == len(seen)
    assert 0 <= got["first_s"] < got["epoch_s"]
    assert got["epoch_s"] >= 13 * 0.01 and got["cpu_s"] >= 13 * 0.01 - 0.02  # ticks of 10 ms
    # 5 steps of 4 images, each at least 10 ms: at most 400 img/s
    assert 0 < got["rate"] <= 5 * batch / (5 * 0.01)


def test_an_epoch_shorter_than_the_window_is_an_error():
    loader = torch.utils.data.DataLoader(Numbers(8), batch_size=4)
    with pytest.raises(RuntimeError, match="an epoch of 2 batches is shorter than 7 steps"):
        image_loop.plain_loop(lambda x, y: None, loader, torch.device("cpu"), warmup=3, steady=4)


def test_alternated_flips_the_order_each_round():
    order = []
    got = image_loop.alternated({"a": "A", "b": "B"}, lambda way: order.append(way) or way.lower(), rounds=3)
    assert order == ["A", "B", "B", "A", "A", "B"]
    assert got == {"a": ["a"] * 3, "b": ["b"] * 3}


def test_resident_rate_counts_the_batch():
    calls = []
    rate = image_loop.resident_rate(lambda x, y: calls.append(len(y)), torch.zeros(6, 3), torch.zeros(6), torch.device("cpu"),
                                    warmup=2, steady=3)
    assert calls == [6] * 5 and rate > 0
