"""The served model's names and its LoRA adapters: which `model` a request may name, GET /v1/models, and the
runtime LoRA routes (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)."""

from __future__ import annotations

import time

from fastapi.responses import PlainTextResponse

from jaxserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from jaxserve.lora_request import LoRARequest
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, _SamplingFields


class ServedModels:
    """The model under its names, and the LoRA adapters a request's `model` may name."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        # LoRA adapter name -> folder: the event loop's copy of the engine's, updated by the load and unload routes
        self.loras = dict(engine.model.loras)

    def models(self) -> dict:
        """The served model under each of its names, then its LoRA adapters (each with the model as its `parent`,
        as vLLM lists them)."""
        created, model = int(time.time()), self.engine.model
        cards = [{"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
                  "root": model.model_path, "parent": None, "max_model_len": model.max_model_len}
                 for name in self.served_names]
        cards += [{"id": name, "object": "model", "created": created, "owned_by": "jaxserve", "root": path,
                   "parent": self.config.served_model_name, "max_model_len": model.max_model_len}
                  for name, path in self.loras.items()]
        return {"object": "list", "data": cards}

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name the served model answers to, the one responses give first."""
        return self.config.served_model_name, *self.config.served_model_aliases

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names, or None for the served model (any of its names, or no `model`); 404 for
        anything else."""
        if model is None or model in self.served_names:
            return None
        if model in self.loras:
            return model
        served = ", ".join(repr(name) for name in [*self.served_names, *self.loras])
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", "model",
                       "model_not_found")

    def model_name(self, body: _SamplingFields) -> str:
        """The `model` a response names: the request's LoRA adapter, else the served model."""
        return self.check_model(body.model) or self.config.served_model_name

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """POST /v1/load_lora_adapter: the adapter into a free slot, between two steps; 400 for a name in use, a
        folder the engine cannot serve or no free slot."""
        if body.lora_name in self.loras or body.lora_name in self.served_names:
            raise APIError(400, f"The lora adapter {body.lora_name!r} has already been loaded.", "lora_name")
        request = LoRARequest(body.lora_name, len(self.loras) + 1, body.lora_path)
        try:
            await self.engine.add_lora(request)
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        except ValueError as error:
            raise APIError(400, str(error), "lora_path") from error
        self.loras[body.lora_name] = body.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """POST /v1/unload_lora_adapter: free the adapter's slot; 404 for one not loaded, 400 while a request runs
        with it."""
        if body.lora_name not in self.loras:
            raise APIError(404, f"The lora adapter {body.lora_name!r} cannot be found.", "lora_name",
                           "model_not_found")
        try:
            await self.engine.remove_lora(body.lora_name)
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        except ValueError as error:
            raise APIError(400, str(error), "lora_name") from error
        del self.loras[body.lora_name]
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
