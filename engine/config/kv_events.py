"""``KVEventsConfig``: vLLM's ``kv_events_config`` (``--kv-events-config``), same field names.

``enable_kv_cache_events`` turns the events on (off by default). ``publisher``: ``zmq`` (a ZMQ
PUB socket) or ``null`` (nothing is built); left out it is ``zmq`` when events are on, as in
vLLM. ``endpoint``: the PUB address; a wildcard (``tcp://*:5557``), ``ipc://`` or ``inproc://``
address binds, any other (``tcp://router-host:5557``) connects, vLLM's rule. ``replay_endpoint``
(optional) binds a ROUTER socket that answers a subscriber's replay request from a sequence
number out of the last ``buffer_steps`` batches. ``hwm``: the PUB socket's send high-water mark
(messages; past it ZMQ drops for a slow subscriber). ``max_queue_size``: batches waiting for the
publisher thread; a step whose batch finds the queue full drops it (counted) instead of waiting.
``topic``: the first frame of every message (subscribers filter on its prefix).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config.json_object import json_object

PUBLISHERS = ("zmq", "null")
_SCHEMES = ("tcp://", "ipc://", "inproc://")
_EXAMPLE = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_endpoint(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value.startswith(_SCHEMES) or \
            len(value) <= len(value.split("//", 1)[0]) + 2:
        raise ValueError(f"kv_events_config {name} must be a ZMQ address (tcp://*:5557, "
                         f"tcp://HOST:PORT, ipc://PATH or inproc://NAME); got {value!r}")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config enable_kv_cache_events must be true or false; "
                             f"got {self.enable_kv_cache_events!r}")
        publisher = self.publisher
        if publisher is None:
            publisher = "zmq" if self.enable_kv_cache_events else "null"
        if publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config publisher must be one of "
                             f"{', '.join(PUBLISHERS)}; got {self.publisher!r}")
        object.__setattr__(self, "publisher", publisher)
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.endpoint:
                raise ValueError("kv_events_config replay_endpoint must differ from endpoint")
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"kv_events_config {name} must be an integer >= {low}; "
                                 f"got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config topic must be a string; got {self.topic!r}")

    @property
    def active(self) -> bool:
        """Events are on and go somewhere: the engine records and publishes them."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def as_dict(self) -> dict[str, Any]:
        """The JSON object this config reads back from."""
        return dataclasses.asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> KVEventsConfig:
        """Normalise a dict, its JSON text or an instance; None is the default (off)."""
        if value is None:
            return cls()
        if isinstance(value, KVEventsConfig):
            return value
        value = json_object(value, "kv_events_config", _EXAMPLE, cls)
        if value is None:
            return cls()
        return cls(**value)
