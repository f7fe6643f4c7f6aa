"""``ZmqEventPublisher``: sends the engine's event batches on a ZMQ PUB socket, off the engine
thread.

The engine thread only puts a step's events into a bounded queue (``publish``: never blocks;
when the queue holds ``max_queue_size`` batches the new one is dropped and counted). A daemon
thread (``kvserve-kv-events``) takes them in order, numbers them (0, 1, 2, ... for the life of
the publisher), encodes them with msgpack and sends ``[topic, seq, payload]``; a PUB socket
never blocks either (past ``hwm`` queued messages ZMQ drops for the slow subscriber). The same
thread keeps the last ``buffer_steps`` batches and answers replay requests on the ROUTER
socket (``engine.kv_events.replay``). Sockets are bound (or connected) in the constructor, so
a taken port fails the server's start rather than a thread later.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import zmq

from engine.config.kv_events import KVEventsConfig
from engine.kv_events.events import EventBatch, KVCacheEvent, seq_frame
from engine.kv_events.replay import ReplayBuffer
from engine.kv_events.stats import KVEventsStats

logger = logging.getLogger("kvserve.engine")
_POLL_S = 0.05  # the most a replay request waits while no batch arrives
_CLOSE_S = 1.0  # the most close() waits for queued batches to go out


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, ``ipc://`` or ``inproc://`` address binds, any other connects."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self._rank = data_parallel_rank
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer = ReplayBuffer(config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, int(_CLOSE_S * 1000))
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {config.endpoint}"
                             f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}"
                             f": {exc}") from None
        # the addresses as bound (a wildcard port resolved), for logs and tests
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                if self._replay is not None else None)
        logger.info("KV cache events: publishing on %s%s%s", self.endpoint,
                    f" (topic {config.topic!r})" if config.topic else "",
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")
        self.published_events = self.published_batches = 0
        self.dropped_events = self.dropped_batches = 0
        self.replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()

    # ---- engine thread -------------------------------------------------------------------
    def publish(self, events: list[KVCacheEvent]) -> bool:
        """Queue one step's events (nothing for an empty list); False when dropped."""
        if not events:
            return True
        if self._stop.is_set():
            raise RuntimeError("the KV events publisher is closed")
        try:
            self._queue.put_nowait(EventBatch(time.time(), tuple(events), self._rank))
        except queue.Full:
            self.dropped_batches += 1
            self.dropped_events += len(events)
            return False
        return True

    def stats(self) -> KVEventsStats:
        return KVEventsStats(enabled=True, published_events=self.published_events,
                             published_batches=self.published_batches,
                             dropped_events=self.dropped_events,
                             dropped_batches=self.dropped_batches, replays=self.replays,
                             queued_batches=self._queue.qsize())

    def close(self) -> None:
        """Send what is queued (for at most a second), stop the thread, close the sockets.
        Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=_CLOSE_S + 1.0)
        self._close_sockets()

    # ---- publisher thread ----------------------------------------------------------------
    def _run(self) -> None:
        seq = 0
        deadline = None
        while True:
            if self._stop.is_set():
                deadline = deadline or time.monotonic() + _CLOSE_S
                if self._queue.empty() or time.monotonic() > deadline:
                    return
            if self._replay is not None:
                self._serve_replays()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            try:
                payload = batch.encode()
                self._pub.send_multipart([self._topic, seq_frame(seq), payload])
            except Exception:  # noqa: BLE001 - a bad batch must not end the publisher
                logger.exception("kv events: publishing batch %d failed", seq)
                continue
            self._buffer.append(seq, payload)
            self.published_batches += 1
            self.published_events += len(batch.events)
            seq += 1

    def _serve_replays(self) -> None:
        while self._replay.poll(0):
            try:
                request = self._replay.recv_multipart(zmq.NOBLOCK)
                answer = self._buffer.answer(request)
                if answer is None:
                    logger.warning("kv events: malformed replay request (%d frames)",
                                   len(request))
                    continue
                self.replays += 1  # counted first: a subscriber may read stats on the answer
                for message in answer:
                    self._replay.send_multipart(message)
            except zmq.ZMQError:
                logger.exception("kv events: answering a replay request failed")
                return

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._ctx.term()
