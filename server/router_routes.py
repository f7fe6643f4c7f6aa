"""The endpoints that sglang-router and vllm-router probe on a worker, in the shapes their own
code reads (added by ``build_app``; each read from the routers' sources and tried against them):

- ``GET /get_server_info`` (``/server_info``), ``GET /get_model_info`` (``/model_info``): the
  worker's model, tokenizer, KV block size and limits under both routers' names;
- ``GET /get_load``: SGLang's per-rank list (vllm-router's ``{"load": N}`` shares the path and
  cannot be answered too: its ``power_of_two`` sees load -1);
- ``POST /flush_cache`` (SGLang), ``POST /reset_prefix_cache`` (vLLM): drop every cached block
  no request holds, in every KV tier or the ones named; behind ``--api-key``;
- ``GET /health_generate``: one real token through the engine, 200 or 503;
- ``GET /kv_event_sources``: this replica's KV-event publishers, as vllm-router reads them;
- ``PRI * HTTP/2.0``: 505, not 404 (:class:`HTTP2PrefaceMiddleware`).

All but the two cache resets are open with ``--api-key`` (the routers send no key with some
probes). Each endpoint's fields are spelled out on :func:`add_routes`."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.async_engine import EngineDeadError
from engine.params.sampling import SamplingParams
from server.config_file import ServerSettings
from server.errors import APIError, bad_request
from server.serving import ServingContext

logger = logging.getLogger("kvserve.server")

HEALTH_GENERATE_TIMEOUT = 20.0  # seconds (SGLang's health-check timeout)
RESET_TIMEOUT = 30.0  # seconds to wait for the engine thread's next step boundary
KV_EVENTS_SCHEMA_VERSION = 1  # vllm-router subscribes only to sources that state it
_VLLM_DEVICES = {"gpu": "device", "cuda": "device", "cpu": "host"}
_WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]", ""}


class HTTP2PrefaceMiddleware:
    """``PRI * HTTP/2.0``, the HTTP/2 prior-knowledge preface, reaches this HTTP/1.1 server
    as a request (sglang-router's client tries it once per connection pool before falling back
    to HTTP/1.1): answer 505 HTTP Version Not Supported, logged as such, instead of a 404 that
    reads as a missing route. The client cannot parse an HTTP/1.1 answer anyway; it falls back."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and scope.get("method") == "PRI":
            logger.info("PRI %s 505: an HTTP/2 prior-knowledge preface; this server speaks "
                        "HTTP/1.1 (the client falls back)", scope.get("path") or "*")
            await Response("HTTP/2 is not supported: use HTTP/1.1\n", status_code=505,
                           media_type="text/plain")(scope, receive, send)
            return
        await self.app(scope, receive, send)


def add_routes(app: FastAPI, ctx: ServingContext, settings: ServerSettings,
               version: str) -> None:
    """Add the router endpoints to ``app``. Their shapes:

    - ``GET /get_server_info`` (also ``/server_info``): sglang-router registers the worker's
      model under ``served_model_name`` (else ``model_path``) and loads its tokenizer from
      ``tokenizer_path`` / ``model_path``; vllm-router's ``kv_aware`` policy keys its KV index on
      ``model_id`` and ``kv_block_size``. Beside them SGLang's own names (``context_length``,
      ``page_size``, ``max_total_num_tokens``, ``max_running_requests``, ``dp_size``) and
      kvserve's (``max_model_len``, ``kv_events_endpoint``, ``cache_tiers``). No ``block_size``
      or ``model`` key: vllm-router reads ``block_size`` as another name of ``kv_block_size``
      and sglang-router ``model`` as one of ``model_id``, and a body with both fails to parse.
    - ``GET /get_model_info`` (also ``/model_info``): SGLang's fields (``model_path``,
      ``tokenizer_path``, ``is_generation``, ``model_type``, ``architectures``, ...).
    - ``GET /get_load``: SGLang's list, one entry per data-parallel rank (one here):
      ``num_reqs`` (running + waiting), ``num_waiting_reqs``, ``num_tokens`` (KV tokens held by
      requests: blocks in use x block size), which sglang-router sums for ``power_of_two``.
      vllm-router reads ``{"load": N}`` from the same path and the two routers send the same
      request, so it cannot be answered both ways: vllm-router's ``power_of_two`` sees load -1.
    - ``POST /flush_cache`` (SGLang) and ``POST /reset_prefix_cache`` (vLLM): drop every cached
      block no request holds, in every KV tier or the ones named
      (``?tier=device,host,disk,remote``, repeatable; vLLM's ``?device=gpu|cpu`` names the
      device or host tier). Blocks of running, waiting or swapped requests are never dropped
      (``reset_running_requests=true`` is a 400). Answer: ``{"success": true,
      "dropped_blocks": {"device": 12, "host": 0, "disk": 40}}`` (a tier's null: it cannot be
      cleared from this server). Behind ``--api-key`` (server/auth.py).
    - ``GET /health_generate``: one real token through the engine (greedy, a one-token prompt,
      bounded by :data:`HEALTH_GENERATE_TIMEOUT`); probes that arrive while one runs share its
      answer, so a burst of them costs one request. 200 ``{"status": "ok"}`` or 503.
    - ``GET /kv_event_sources``: the KV-event publishers of this replica, as vllm-router reads
      them: a JSON object keyed by data-parallel rank (``{"0": {"endpoint": "tcp://HOST:5557",
      "replay_endpoint": ..., "topic": ..., "publisher": "zmq", "encoding": "msgpack",
      "schema_version": 1, ...}}``; vllm-router spawns no subscriber without ``publisher``,
      ``encoding`` and ``schema_version``), ``{}`` when events are off. A wildcard host in the
      endpoint (``tcp://*:5557``) is replaced by ``--host``, or when that is a wildcard too by
      the host the router reached this server at.
    - ``PRI * HTTP/2.0`` (sglang-router's client trying HTTP/2 prior knowledge): 505, not 404
      (:class:`HTTP2PrefaceMiddleware`); the client falls back to HTTP/1.1.

    sglang-router sends its ``--api-key`` with every probe, vllm-router with
    ``/get_server_info`` and ``/kv_event_sources`` but not with ``/get_load`` or the
    ``/flush_cache`` it passes on (so behind a key its flush is a 401).
    """
    engine = ctx.engine
    probe = _HealthProbe(engine)
    app.add_middleware(HTTP2PrefaceMiddleware)

    def server_info(request: Request) -> dict[str, Any]:
        cfg = engine.config
        stats = engine.stats()
        sources = kv_event_sources(cfg, settings.host, request)
        return {
            "model_id": engine.model_name,
            "served_model_name": engine.model_name,
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "version": version,
            "max_model_len": engine.max_model_len,
            "context_length": engine.max_model_len,  # SGLang's name
            "kv_block_size": cfg.block_size,  # vllm-router's name
            "page_size": cfg.block_size,  # SGLang's name
            "max_total_num_tokens": stats.num_blocks_total * cfg.block_size,
            "max_running_requests": cfg.max_num_seqs,
            "dp_size": 1,
            "kv_cache_dtype": str(cfg.kv_cache_dtype),
            "enable_prefix_caching": bool(cfg.enable_prefix_caching),
            "cache_tiers": engine.cache_tiers(),
            "kv_events_endpoint": sources["0"]["endpoint"] if sources else None,
        }

    def model_info() -> dict[str, Any]:
        hf = engine.hf_config
        archs = list(getattr(hf, "architectures", None) or [])
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "served_model_name": engine.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(hf, "model_type", None),
            "architectures": archs,
        }

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> JSONResponse:
        return JSONResponse(server_info(request))

    @app.get("/server_info", include_in_schema=False)
    async def server_info_alias(request: Request) -> JSONResponse:
        return JSONResponse(server_info(request))

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        return JSONResponse(model_info())

    @app.get("/model_info", include_in_schema=False)
    async def model_info_alias() -> JSONResponse:
        return JSONResponse(model_info())

    @app.get("/get_load")
    async def get_load() -> JSONResponse:
        s = engine.stats()
        return JSONResponse([{
            "dp_rank": 0,
            "num_reqs": s.num_requests_running + s.num_requests_waiting,
            "num_waiting_reqs": s.num_requests_waiting,
            "num_running_reqs": s.num_requests_running,
            "num_tokens": s.num_blocks_used * engine.config.block_size,
            "kv_cache_usage_perc": s.kv_cache_usage_perc,
        }])

    async def reset(request: Request) -> JSONResponse:
        tiers = requested_tiers(request)
        if not engine.is_healthy:
            raise APIError(503, "the engine is not running", code="engine_dead")
        try:
            dropped = await engine.reset_prefix_cache(tiers, timeout=RESET_TIMEOUT)
        except ValueError as exc:
            raise bad_request(str(exc), param="tier") from None
        except EngineDeadError:
            raise APIError(503, "the engine is not running", code="engine_dead") from None
        except asyncio.TimeoutError:
            raise APIError(503, f"the engine did not reach a step boundary within "
                           f"{RESET_TIMEOUT:g} s", code="engine_busy") from None
        return JSONResponse({"success": True, "dropped_blocks": dropped})

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> JSONResponse:
        """SGLang's: drop the prefix cache (every tier, or ``?tier=``)."""
        return await reset(request)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        """vLLM's: drop the prefix cache (every tier, or ``?tier=`` / ``?device=``)."""
        return await reset(request)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if ctx.draining_since is not None:
            return APIError(503, "the server is shutting down", code="shutting_down",
                            headers={"Retry-After": "5"}).response()
        problem = await probe.run()
        if problem is not None:
            return APIError(503, f"no token generated: {problem}",
                            code="engine_unhealthy").response()
        return JSONResponse({"status": "ok"})

    @app.get("/kv_event_sources")
    async def get_kv_event_sources(request: Request) -> JSONResponse:
        return JSONResponse(kv_event_sources(engine.config, settings.host, request))


def requested_tiers(request: Request) -> list[str] | None:
    """The tiers a reset names (``tier``, comma-separated or repeated; vLLM's ``device``), or
    None for all."""
    q = request.query_params
    if q.get("reset_running_requests", "").lower() in ("1", "true", "yes"):
        raise bad_request("kvserve never drops the KV of requests in flight: only cached "
                          "blocks no request holds are dropped", param="reset_running_requests")
    tiers = [t.strip() for v in q.getlist("tier") for t in v.split(",") if t.strip()]
    for dev in q.getlist("device"):
        if dev.lower() not in _VLLM_DEVICES:
            raise bad_request(f"device must be one of {', '.join(_VLLM_DEVICES)}; got {dev!r}",
                              param="device")
        tiers.append(_VLLM_DEVICES[dev.lower()])
    return tiers or None


def _field(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def kv_event_sources(config: Any, listen_host: str, request: Request) -> dict[str, Any]:
    """vllm-router's ``/kv_event_sources`` body for ``config.kv_events_config`` (``{}`` when
    events are off or the endpoint cannot be reached from outside this process)."""
    cfg = getattr(config, "kv_events_config", None)
    if cfg is None or not _field(cfg, "enable_kv_cache_events", False):
        return {}
    publisher = _field(cfg, "publisher") or "zmq"
    endpoint = _field(cfg, "endpoint") or ""
    if publisher != "zmq" or not endpoint.startswith(("tcp://", "ipc://")):
        return {}
    host = _reachable_host(listen_host, request)
    replay = _field(cfg, "replay_endpoint")
    return {"0": {
        "data_parallel_rank": 0,
        "endpoint": resolve_endpoint(endpoint, host),
        "replay_endpoint": resolve_endpoint(replay, host) if replay else None,
        "topic": _field(cfg, "topic", ""),
        "hwm": _field(cfg, "hwm"),
        "buffer_steps": _field(cfg, "buffer_steps"),
        "publisher": "zmq",
        "encoding": "msgpack",
        "schema_version": KV_EVENTS_SCHEMA_VERSION,
        "enable_kv_cache_events": True,
    }}


def _reachable_host(listen_host: str, request: Request) -> str:
    """``--host`` unless it is a wildcard; then the host the client reached us at."""
    if listen_host not in _WILDCARD_HOSTS:
        return listen_host
    return request.url.hostname or "127.0.0.1"


def resolve_endpoint(endpoint: str, host: str) -> str:
    """``endpoint`` with a wildcard host (``*``, ``0.0.0.0``, ``[::]``) replaced by ``host``."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    netloc = endpoint[len("tcp://"):]
    current, _, port = netloc.rpartition(":")
    if current not in _WILDCARD_HOSTS:
        return endpoint
    try:
        if ipaddress.ip_address(host.strip("[]")).version == 6:
            host = f"[{host.strip('[]')}]"
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


class _HealthProbe:
    """One real token through the engine; concurrent probes share the one in flight."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._task: asyncio.Task | None = None

    async def run(self) -> str | None:
        """None when a token came back, else why not."""
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._generate())
        return await asyncio.shield(self._task)

    async def _generate(self) -> str | None:
        engine = self.engine
        try:
            stream = engine.submit([0], SamplingParams(max_tokens=1, temperature=0.0),
                                   engine.new_request_id("health"))
        except Exception as exc:  # noqa: BLE001 - dead, draining, queue full: all a 503
            return f"{type(exc).__name__}: {exc}"
        try:
            out = await asyncio.wait_for(_last(stream), HEALTH_GENERATE_TIMEOUT)
        except asyncio.TimeoutError:
            return f"none within {HEALTH_GENERATE_TIMEOUT:g} s"
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        finally:
            stream.abort()
        if out is None or out.error or not out.outputs or not out.outputs[0].token_ids:
            return (out.error if out is not None and out.error else "the engine returned none")
        return None


async def _last(stream: Any) -> Any:
    last = None
    async for out in stream:
        last = out
    return last
