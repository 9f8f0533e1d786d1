"""The llm's `Outbox` (Triton-free): every response is sent on its one thread, in order, off the
caller's thread; a client's cancellation is seen there and passed on once; nothing touches a
client after its last response; a refused second request of an id does not unwatch the first."""
from __future__ import annotations

import threading
import time

from triton_vlm.serving.outbox import Outbox

POLL_S = 0.005


class Client:
    """A response sender that records who touched it, and fails the test if touched after the end."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.threads: set[str] = set()
        self.cancelled = False
        self.ended = False
        self.polls = 0
        self.touched_after_end = False

    def deliver(self, value: int, last: bool):
        def send() -> bool:
            self._touch()
            self.sent.append(value)
            self.ended = last
            return last
        return send

    def is_cancelled(self) -> bool:
        self._touch()
        self.polls += 1
        return self.cancelled

    def _touch(self) -> None:
        self.touched_after_end |= self.ended
        self.threads.add(threading.current_thread().name)


def until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def test_responses_go_in_order_on_the_outbox_thread_and_no_client_is_touched_after_its_end():
    outbox = Outbox(poll_s=POLL_S)
    clients = [Client() for _ in range(3)]
    for key, client in enumerate(clients):
        outbox.watch(key, client.is_cancelled, lambda: None)
    for value in range(50):
        for key, client in enumerate(clients):
            outbox.put(key, client.deliver(value, last=value == 49))
    outbox.close()
    for client in clients:
        assert client.sent == list(range(50))
        assert client.threads == {"llm-outbox"} and not client.touched_after_end
    time.sleep(5 * POLL_S)
    assert all(not client.touched_after_end for client in clients)


def test_a_cancelled_client_is_passed_on_once_and_then_left_alone():
    outbox = Outbox(poll_s=POLL_S)
    client, cancels = Client(), []
    outbox.watch("a", client.is_cancelled, lambda: cancels.append("a"))
    outbox.put("a", client.deliver(0, last=False))
    assert until(lambda: client.polls >= 2)  # polled while it runs
    client.cancelled = True
    assert until(lambda: cancels == ["a"])
    polls = client.polls
    time.sleep(10 * POLL_S)
    assert cancels == ["a"] and client.polls == polls  # asked no more once it was seen cancelled
    outbox.put("a", client.deliver(1, last=True))  # the engine's final "cancelled" response still goes
    outbox.close()
    assert client.sent == [0, 1] and not client.touched_after_end


def test_a_refused_second_request_of_an_id_leaves_the_first_watched():
    outbox = Outbox(poll_s=POLL_S)
    first, second, cancels = Client(), Client(), []
    outbox.watch(first, first.is_cancelled, lambda: cancels.append("first"))
    outbox.watch(second, second.is_cancelled, lambda: cancels.append("second"))
    outbox.put(second, second.deliver(-1, last=True))  # refused: its one response, the last
    first.cancelled = True
    assert until(lambda: cancels == ["first"])
    outbox.close()
    assert not second.touched_after_end and second.sent == [-1]


def test_a_delivery_that_raises_ends_its_request_only():
    outbox = Outbox(poll_s=POLL_S)
    broken, fine = Client(), Client()
    outbox.watch("broken", broken.is_cancelled, lambda: None)

    def fail() -> bool:
        broken.ended = True
        raise RuntimeError("the client went away")
    outbox.put("broken", fail)
    outbox.put("fine", fine.deliver(7, last=True))
    outbox.close()
    assert fine.sent == [7] and not broken.touched_after_end
