"""The ZMQ publisher on real sockets, read by a plain pyzmq SUB / DEALER and msgpack: three
frames per batch with consecutive sequence numbers; replay from a sequence number answers the
buffered batches from there then the end marker (vLLM's protocol); a full queue drops and
counts instead of blocking the caller; a taken address fails at construction."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from engine.config.kv_events import KVEventsConfig
from engine.kv_events import BlockStored
from engine.kv_events.publisher import ZmqEventPublisher, binds

BS = 2


def _event(i: int) -> BlockStored:
    return BlockStored((bytes([i]) * 32,), None, (i, i + 1), BS)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _publisher(tmp_path, **kw) -> ZmqEventPublisher:
    cfg = dict(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub",
               replay_endpoint=f"ipc://{tmp_path}/replay", topic="kv")
    cfg.update(kw)
    return ZmqEventPublisher(KVEventsConfig(**cfg))


def _sub(ctx, pub: ZmqEventPublisher) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    return sub


def _wait_connected(sub: zmq.Socket, pub: ZmqEventPublisher) -> None:
    """A PUB drops messages until the subscription arrived: publish probes until one lands."""
    for _ in range(100):
        pub.publish([_event(0)])
        if sub.poll(50):
            while sub.poll(50):
                sub.recv_multipart()
            return
    raise AssertionError("the subscriber never connected")


def test_batches_are_three_frames_with_consecutive_sequence_numbers(ctx, tmp_path):
    pub = _publisher(tmp_path)
    try:
        sub = _sub(ctx, pub)
        _wait_connected(sub, pub)
        first = pub.published_batches
        for i in range(1, 4):
            assert pub.publish([_event(i), _event(i + 10)])
        got = [sub.recv_multipart() for _ in range(3)]
        assert [t for t, _, _ in got] == [b"kv"] * 3
        assert [int.from_bytes(s, "big") for _, s, _ in got] == [first, first + 1, first + 2]
        ts, events, rank = msgpack.unpackb(got[0][2])
        assert abs(ts - time.time()) < 60 and rank == 0
        assert [e["type"] for e in events] == ["BlockStored", "BlockStored"]
        assert events[0]["token_ids"] == [1, 2] and events[1]["block_hashes"] == [b"\x0b" * 32]
        assert pub.stats().published_events >= 6
    finally:
        pub.close()
        pub.close()  # idempotent


def test_replay_from_a_sequence_number(ctx, tmp_path):
    pub = _publisher(tmp_path, buffer_steps=3)
    try:
        sub = _sub(ctx, pub)
        _wait_connected(sub, pub)
        base = pub.published_batches
        for i in range(1, 6):
            pub.publish([_event(i)])
        live = [sub.recv_multipart() for _ in range(5)]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)

        def replay(start: int) -> list[tuple[int, bytes]]:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(5000), "no replay answer"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                seq = int.from_bytes(seq, "big", signed=True)
                if seq == -1:
                    assert payload == b""
                    return out
                out.append((seq, payload))

        last = base + 4  # the buffer keeps the last three batches
        assert replay(base + 3) == [(int.from_bytes(s, "big"), p) for _, s, p in live[3:]]
        assert [s for s, _ in replay(0)] == [last - 2, last - 1, last]  # older ones are gone
        assert replay(last + 1) == []  # nothing yet: only the end marker
        dealer.send_multipart([b"", b"\x01"])  # malformed: ignored, the socket still answers
        assert [s for s, _ in replay(last)] == [last]
        assert pub.stats().replays == 4
    finally:
        pub.close()


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path):
    pub = _publisher(tmp_path, max_queue_size=2, replay_endpoint=None)
    release = threading.Event()
    send = pub._pub.send_multipart

    def stalled(frames):  # a publisher thread stuck on its socket
        release.wait(10)
        send(frames)

    pub._pub.send_multipart = stalled
    try:
        results = []
        t0 = time.perf_counter()
        for i in range(20):
            results.append(pub.publish([_event(i), _event(i + 50)]))
        elapsed = time.perf_counter() - t0
        assert elapsed < 0.5, "publish waited for the publisher thread"
        s = pub.stats()
        assert results.count(False) == s.dropped_batches >= 17
        assert s.dropped_events == 2 * s.dropped_batches
        release.set()
        for _ in range(100):
            if pub.stats().published_batches == 20 - s.dropped_batches:
                break
            time.sleep(0.02)
        assert pub.stats().published_batches == 20 - s.dropped_batches
    finally:
        release.set()
        pub.close()


def test_a_taken_address_fails_at_start(tmp_path):
    pub = _publisher(tmp_path, endpoint="tcp://*:*", replay_endpoint=None)
    try:
        port = pub.endpoint.rsplit(":", 1)[1]
        with pytest.raises(ValueError, match="cannot open"):
            _publisher(tmp_path, endpoint=f"tcp://*:{port}", replay_endpoint=None)
    finally:
        pub.close()


def test_bind_or_connect_follows_vllm():
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and binds("tcp://[::]:5557")
    assert not binds("tcp://router:5557") and not binds("tcp://127.0.0.1:5557")
