"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``.

Mounted only with ``--allow-runtime-lora-updating`` (or ``KVSERVE_ALLOW_RUNTIME_LORA_UPDATING``,
vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); without it neither route exists (404), as in
vLLM. Under ``/v1/``, so behind ``--api-key`` when one is set (server/auth.py). A loaded
adapter is listed by ``/v1/models`` and selected by a request's ``model`` (server/serving.py,
``ServingContext.check_model``).

Load: body ``{"lora_name", "lora_path"}`` (a PEFT directory the server can read); 200 with the
text ``Success: LoRA adapter '<name>' added successfully.``; a 400 in OpenAI's shape when a
field is empty, the name is taken (by a loaded adapter or the base model's served names), the
files cannot be served by this model, or LoRA is off (``--enable-lora``). Unload: body
``{"lora_name"}``; 200 with ``Success: LoRA adapter '<name>' removed successfully.``, 404 for a
name that is not loaded. Requests already running under an unloaded adapter finish on it; new
ones naming it get 404 ``model_not_found``. Loads and unloads are applied one at a time.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from server.errors import APIError, bad_request
from server.serving import ServingContext, engine_error, request_id_of

logger = logging.getLogger("kvserve.server")


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest``."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``UnloadLoRAAdapterRequest`` (``lora_int_id`` accepted and ignored: the name
    says which)."""

    lora_name: str
    lora_int_id: int | None = None


def add_routes(app: FastAPI, ctx: ServingContext) -> None:
    """Mount the two routes on ``app`` (the caller checks the runtime-updating gate)."""
    engine = ctx.engine
    updating = asyncio.Lock()  # one load or unload at a time: "name taken" is then exact

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
        """Read the adapter at ``lora_path`` and serve it as model ``lora_name``."""
        name, path = req.lora_name, req.lora_path
        if not name.strip() or not path.strip():
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.",
                              param="lora_name" if not name.strip() else "lora_path")
        if name in ctx.served_model_names:
            raise bad_request(f"'{name}' is a name of the base model; give the adapter "
                              f"another name", param="lora_name")
        async with updating:
            if name in ctx.lora_names():
                raise bad_request(f"The lora adapter '{name}' has already been loaded.",
                                  param="lora_name")
            try:
                lora_id = await engine.load_lora_adapter(name, path)
            except ValueError as exc:
                raise bad_request(str(exc), param="lora_path") from None
            except Exception as exc:  # noqa: BLE001 - a dead engine 503, else 500 (logged)
                raise engine_error(exc, ctx, request_id_of(raw)) from None
        logger.info("LoRA adapter %r loaded from %s (lora_id %d)", name, path, lora_id)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest,
                                  raw: Request) -> PlainTextResponse:
        """Stop serving adapter ``lora_name``: new requests naming it get 404."""
        name = req.lora_name
        if not name.strip():
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.",
                              param="lora_name")
        async with updating:
            try:
                await engine.unload_lora_adapter(name)
            except KeyError:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                               param="lora_name", code="lora_adapter_not_found") from None
            except Exception as exc:  # noqa: BLE001 - a dead engine 503, else 500 (logged)
                raise engine_error(exc, ctx, request_id_of(raw)) from None
        logger.info("LoRA adapter %r unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
