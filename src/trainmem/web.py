"""``trainmem serve``: a local web calculator over the estimator (FastAPI; extra ``web``).

The page (static/index.html: plain HTML, CSS and JavaScript, charts drawn as SVG, nothing fetched from elsewhere)
is a view of these endpoints, documented on FastAPI's /docs page:

- ``GET /api/models``, ``GET /api/gpus``, ``GET /api/recipes``: the catalog, the GPU table and the recipes
  (report.models_document, gpus_document, recipes_table.recipes_document);
- ``POST /api/estimate``: the document ``trainmem estimate --json`` prints for the same inputs, built by the same
  functions (planner.estimate_searched, report.to_dict);
- ``POST /api/plan``: the document ``trainmem plan --json`` prints (plan.run_plan, report.plan_document);
- ``GET /``: the page.

What a request may name is closed: a catalog model or an uploaded config.json sent as JSON in the body (at most
64 KiB a request, parsed as JSON only, never written to disk, never executed: configs carry no code, and nothing
here loads one through transformers). No request names a path the server reads. Bad input comes back as 422 with
the field named, never a traceback.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .errors import ConfigError, TrainmemError
from .estimate import DEFAULT_HEADROOM

MAX_BODY_BYTES = 64 * 1024
"""The largest request body /api accepts (an uploaded config.json is a few KiB)."""

DEFAULT_PORT = 8000


class EstimateInput(BaseModel):
    """The workload, as `trainmem estimate`'s flags name it (the defaults are the CLI's)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="A catalog model (GET /api/models).")
    config: dict[str, Any] | None = Field(None, description="An uploaded config.json, instead of model.")
    recipe: str = "mixed-bf16"
    optimizer: str = "adamw"
    batch: int = Field(1, ge=1, le=1 << 20)
    seq: int = Field(2048, ge=1, le=1 << 24)
    grad_accum: int = Field(1, ge=1, le=1 << 16)
    attention: str = "sdpa"
    checkpointing: str = "none"
    loss: str = "standard"
    gpus: int = Field(1, ge=1, le=1 << 20)
    zero: int | None = Field(None, ge=0, le=3)
    fsdp: str | None = None
    offload: str = "none"
    tp: int = Field(1, ge=1, le=1 << 20, description="Tensor parallel degree.")
    sp: bool = Field(False, description="Sequence parallel on the tensor-parallel GPUs.")
    pp: int = Field(1, ge=1, le=1 << 20, description="Pipeline stages.")
    pp_schedule: str = "1f1b"
    virtual_stages: int = Field(1, ge=1, le=1 << 20)
    micro_batches: int = Field(0, ge=0, le=1 << 20, description="Micro-batches per step through the pipeline "
                               "(0: pp).")
    cp: int = Field(1, ge=1, le=1 << 20, description="Context parallel degree.")
    ep: int = Field(1, ge=1, le=1 << 20, description="Expert parallel degree.")
    lora: int | None = Field(None, ge=1, le=65536)
    lora_alpha: float | None = None
    lora_targets: str = "q,v"
    dora: bool = False
    qlora: bool = False
    base_quant: str | None = None
    gpu: str | None = Field(None, description="A GPU name (GET /api/gpus): fits and max_batch answer for it.")
    headroom: float = Field(DEFAULT_HEADROOM, ge=1.0, le=10.0)
    max_batch: bool = Field(False, description="Replace batch by the largest that fits gpu.")


class PlanInput(BaseModel):
    """`trainmem plan`'s flags (the defaults are the CLI's)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="A catalog model (GET /api/models).")
    config: dict[str, Any] | None = Field(None, description="An uploaded config.json, instead of model.")
    gpu: str = Field(..., description="A GPU name (GET /api/gpus) with data-sheet throughput.")
    gpus: int | None = Field(None, ge=1, le=1 << 20)
    nodes: int | None = Field(None, ge=1, le=1 << 16)
    gpus_per_node: int = Field(8, ge=1, le=64)
    seq: int = Field(2048, ge=1, le=1 << 24)
    global_batch: int | None = Field(None, ge=1, le=1 << 24)
    recipe: str | None = None
    checkpointing: str | None = None
    mfu: float | None = Field(None, gt=0, le=1)
    inter_node_gbps: float | None = Field(None, gt=0)
    host_memory_gib: float | None = Field(None, ge=0)
    min_gpus: bool = False
    top: int = Field(10, ge=1, le=1000)


SETTINGS_FIELDS = ("recipe", "optimizer", "batch", "seq", "grad_accum", "attention", "checkpointing", "loss")
REQUEST_FIELDS = ("gpus", "zero", "fsdp", "offload", "lora", "lora_alpha", "lora_targets", "dora", "qlora",
                  "base_quant", "gpu", "headroom", "tp", "sp", "pp", "pp_schedule", "virtual_stages", "micro_batches",
                  "cp", "ep")


def _model_of(body):
    """A catalog name, or the uploaded config as a ModelSpec: never a path or a Hub id."""
    from .catalog import catalog_names
    from .models import spec_from_config

    if (body.model is None) == (body.config is None):
        raise _FieldError("model", "give a catalog model or an uploaded config, one of them")
    if body.config is not None:
        try:
            return spec_from_config(body.config, name="uploaded config", source="upload")
        except TrainmemError as exc:
            raise _FieldError("config", str(exc)) from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # JSON, but not a config's shapes
            raise _FieldError("config", f"not a usable model config ({type(exc).__name__}: {exc})") from None
    if body.model not in catalog_names():
        raise _FieldError("model", f"unknown model {body.model!r}; accepted: the catalog (GET /api/models) or an "
                          "uploaded config")
    return body.model


def estimate_document(body) -> dict:
    """The `trainmem estimate --json` document for one request body (EstimateInput)."""
    from .planner import estimate_searched
    from .report import json_safe, to_dict
    from .request import make_request

    model = _model_of(body)
    options = {name: getattr(body, name) for name in SETTINGS_FIELDS + REQUEST_FIELDS}
    req = make_request(model, **options)
    est, extra = estimate_searched(req.model, req.settings, req.device, req.gpu, req.parallel, req.finetune,
                                   find_batch=body.max_batch)
    return json_safe(to_dict(est, req.gpu, extra))


def plan_document_for(body: PlanInput) -> dict:
    """The `trainmem plan --json` document for one request body (plan.run_plan, report.plan_document)."""
    from .plan import run_plan
    from .report import json_safe, plan_document

    model = _model_of(body)
    options = {k: getattr(body, k) for k in ("mfu", "inter_node_gbps", "host_memory_gib")
               if getattr(body, k) is not None}
    found, answer = run_plan(model, body.gpu, body.gpus, body.seq, body.global_batch, body.gpus_per_node, body.nodes,
                             body.recipe, body.checkpointing, body.min_gpus, **options)
    return json_safe(plan_document(found, body.top, answer))


class _FieldError(ConfigError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _field_of(message: str, names) -> str | None:
    """The request field a trainmem message is about: the first --flag it names, else the first field name."""
    import re

    lowered = message.lower()
    found: list[tuple[bool, int, int, str]] = []
    for order, name in enumerate(names):
        for spelled in (name, name.replace("_", "-"), "--" + name.replace("_", "-")):
            match = re.search(rf"(?:^| ){re.escape(spelled)}(?: |:)", lowered)
            if match:
                found.append((not spelled.startswith("--"), match.start(), order, name))
    return min(found)[3] if found else None


def create_app():
    """The FastAPI application (``trainmem serve`` runs it with uvicorn)."""
    from .report import gpus_document, models_document

    app = FastAPI(title="trainmem", summary="How much GPU memory a training run needs, where every byte goes.",
                  version=_version())
    cached: dict[str, Any] = {}

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        if request.method in ("POST", "PUT", "PATCH"):
            declared = request.headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
                return _too_large()
            body = await request.body()  # (starlette caches it for the endpoint)
            if len(body) > MAX_BODY_BYTES:
                return _too_large()
        return await call_next(request)

    @app.exception_handler(TrainmemError)
    async def config_error(request: Request, exc: TrainmemError):
        field = getattr(exc, "field", None) or _field_of(str(exc), EstimateInput.model_fields)
        return JSONResponse(status_code=422, content={"detail": [
            {"loc": ["body"] + ([field] if field else []), "msg": str(exc), "type": "value_error"}]})

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> str:
        if "page" not in cached:
            cached["page"] = resources.files("trainmem").joinpath("static/index.html").read_text(encoding="utf-8")
        return cached["page"]

    @app.get("/api/models", summary="The built-in catalog (as `trainmem models --json`).")
    def models() -> dict:
        if "models" not in cached:
            cached["models"] = models_document()
        return cached["models"]

    @app.get("/api/gpus", summary="The GPU table: names and the memory their drivers report.")
    def gpus() -> dict:
        return gpus_document()

    @app.get("/api/recipes", summary="Bytes per parameter of every recipe x optimizer (as `trainmem recipes --json`).")
    def recipes() -> dict:
        from .recipes_table import recipes_document

        return recipes_document()

    @app.post("/api/estimate", summary="The document `trainmem estimate --json` prints for these inputs.")
    def estimate(body: EstimateInput) -> JSONResponse:
        return JSONResponse(estimate_document(body))

    @app.post("/api/plan", summary="The document `trainmem plan --json` prints for these inputs.")
    def plan(body: PlanInput) -> JSONResponse:
        return JSONResponse(plan_document_for(body))

    return app


def _too_large():
    return JSONResponse(status_code=413, content={"detail": [
        {"loc": ["body"], "msg": f"the request body is larger than {MAX_BODY_BYTES // 1024} KiB",
         "type": "too_large"}]})


def _version() -> str:
    from . import __version__

    return __version__


def serve(host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
    """Run the page and its API with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(), host=host, port=port, log_level="warning")

