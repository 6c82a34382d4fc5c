"""``trainmem serve``: a local web calculator over the estimator (FastAPI; extra ``web``).

The page (static/index.html: plain HTML, CSS and JavaScript, charts drawn as SVG, nothing fetched from elsewhere)
is a view of these endpoints, documented on FastAPI's /docs page:

- ``GET /api/models``, ``GET /api/gpus``, ``GET /api/recipes``: the catalog, the GPU table and the recipes
  (report.models_document, gpus_document, recipes_table.recipes_document);
- ``POST /api/estimate``: the document ``trainmem estimate --json`` prints for the same inputs, built by the same
  functions (planner.estimate_searched, report.to_dict); every estimate flag but the paths, --hub and the ways of
  printing is a field of EstimateInput (``gpu_memory``: text with a unit, ``"48GiB"``, or a number of GiB);
- ``POST /api/plan``: the document ``trainmem plan --json`` prints (plan.run_plan, report.plan_document);
- ``GET /api/options``: every estimate flag EstimateInput takes, read from the estimate command's own click options
  (flag, kind, default, bounds, help: estimate_options); the page lays out the common ones by hand and makes a control
  for every other one from this list, so that a new flag reaches the page without an edit to it;
- ``GET /``: the page.

What a request may name is closed: a catalog model, a nominal parameter count, or an uploaded config.json sent as
JSON in the body (at most 64 KiB a request, never written to disk, never executed: configs carry no code). An
uploaded config of a model type without a hand-written description is counted as the CLI counts it, by building the
transformers model on the meta device (meta_count.py: a built-in model class from AutoConfig.for_model, no remote
code, no weights, no network), after its layer and expert counts are checked against MAX_BUILT_LAYERS and
MAX_BUILT_EXPERTS. No request names a path the server reads. Bodies are standard JSON only (_check_json: no NaN,
Infinity, numbers past a float's range, lone surrogates, repeated keys or deep nesting). Bad input comes back as 422
with the field named, never a traceback or a 500. A plan request searches at most MAX_PLAN_GPUS GPUs and
MAX_PLAN_SEQ tokens, for PLAN_TIME_BUDGET_S seconds where plan.run_plan takes a time budget.
"""

from __future__ import annotations

import contextlib
import threading
from importlib import resources
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Iterator, Protocol, Sequence, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from .errors import ConfigError, TrainmemError
from .estimate import DEFAULT_HEADROOM, MAX_CUDA_OVERHEAD_BYTES
from .hardware import DEFAULT_CUDA_OVERHEAD_MIB, DEFAULT_FRAGMENTATION

if TYPE_CHECKING:
    from fastapi.responses import Response

    from .models import ModelSpec

    _F = TypeVar("_F", bound=Callable[..., Any])

    class _App(Protocol):
        """What create_app uses of FastAPI (not followed by mypy: Any): decorators that register the function they
        are given and return it."""

        state: Any

        def get(self, path: str, **options: Any) -> Callable[[_F], _F]: ...

        def post(self, path: str, **options: Any) -> Callable[[_F], _F]: ...

        def middleware(self, middleware_type: str) -> Callable[[_F], _F]: ...

        def exception_handler(self, exc_class: type[BaseException]) -> Callable[[_F], _F]: ...

MAX_BODY_BYTES = 64 * 1024
"""The largest request body /api accepts (an uploaded config.json is a few KiB)."""
MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a body may have (a config.json is three or four levels deep)."""

DEFAULT_PORT = 8000

MAX_PLAN_GPUS = 1024
"""The most GPUs one POST /api/plan may search (128 nodes of 8; ``trainmem plan`` has no such cap): a search grows
with the GPU count, and a few large ones would occupy the server."""
MAX_PLAN_SEQ = 131_072
"""The longest sequence one POST /api/plan may search (``trainmem plan`` has no such cap)."""
PLAN_TIME_BUDGET_S = 5.0
"""Seconds one POST /api/plan may search before it answers with what it found (``search.cut_short`` then says so),
where plan.run_plan takes a time budget."""
PLAN_CONCURRENCY = 2
"""Plan searches running at once; one more is answered 429 at once (estimates are never held up by them)."""


class EstimateInput(BaseModel):
    """The workload, as `trainmem estimate`'s flags name it (the defaults are the CLI's). What the CLI has and this
    does not: ``--ds-config`` and ``--hub`` (they read paths or the network), ``--units``, ``--explain`` and
    ``--plot`` (ways of printing)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = Field(None, description="A catalog model (GET /api/models).")
    config: dict[str, Any] | None = Field(None, description="An uploaded config.json, instead of model.")
    params: StrictStr | StrictInt | StrictFloat | None = Field(
        None, description="A nominal parameter count instead of a model (7e9, \"7B\"): static memory only.")
    recipe: str = "mixed-bf16"
    optimizer: str = "adamw"
    optimizer_impl: str = Field("auto", description="foreach | fused | auto (fused for mixed-* recipes).")
    batch: int = Field(1, ge=1, le=1 << 20)
    seq: int = Field(2048, ge=1, le=1 << 24)
    grad_accum: int = Field(1, ge=1, le=1 << 16)
    attention: str = "sdpa"
    checkpointing: str = "none"
    dropout: float | None = Field(None, ge=0, lt=1, description="Dropout probability (default: the config's).")
    loss: str = "standard"
    activation_k: float | None = Field(None, gt=0, le=1e6, description="Use the seed's rule b*s*h*L*k*2 bytes for "
                                       "activations.")
    optimizer_in_backward: bool = Field(False, description="Step each parameter as its gradient is made.")
    compile: bool = Field(False, description="torch.compile each decoder layer.")
    offload_activations: bool = Field(False, description="Checkpointed layers' inputs in host memory until "
                                      "backward (needs checkpointing full).")
    task: str = Field("causal-lm", description="causal-lm | masked-lm | seq-cls | seq2seq-lm: the head and loss "
                      "trained (anything but causal-lm is traced).")
    num_labels: int | None = Field(None, ge=1, le=1 << 20, description="seq-cls: the classifier's labels.")
    gpus: int = Field(1, ge=1, le=1 << 20)
    gpus_per_node: int = Field(0, ge=0, le=1 << 10, description="GPUs per node (0: 8, or gpus if fewer).")
    zero: int | None = Field(None, ge=0, le=3)
    fsdp: str | None = None
    offload: str = Field("none", description="none | optimizer | optimizer+params (ZeRO or FSDP2).")
    ddp_bucket_view: bool = Field(False, description="DDP with gradient_as_bucket_view=True.")
    fsdp_embedding_groups: bool = Field(False, description="FSDP2: the embedding and the LM head groups of their "
                                        "own, resharded after forward (torchtune's custom_sharded_layers).")
    fsdp_version: int = Field(2, ge=1, le=2, description="2: FSDP2 (fully_shard); 1: FSDP1 "
                              "(FullyShardedDataParallel, a flat parameter per decoder layer).")
    fsdp_use_orig_params: bool = Field(False, description="FSDP1's use_orig_params=True.")
    fsdp_no_sync: bool = Field(False, description="FSDP1: accumulation micro-batches in no_sync() (every unit's "
                               "unsharded gradient kept until the synced one).")
    tp: int = Field(1, ge=1, le=1 << 20, description="Tensor parallel degree.")
    sp: bool = Field(False, description="Sequence parallel on the tensor-parallel GPUs.")
    pp: int = Field(1, ge=1, le=1 << 20, description="Pipeline stages.")
    pp_schedule: str = "1f1b"
    pp_layers: str | list[int] | None = None
    virtual_stages: int = Field(1, ge=1, le=1 << 20)
    micro_batches: int = Field(0, ge=0, le=1 << 20, description="Micro-batches per step through the pipeline "
                               "(0: pp).")
    cp: int = Field(1, ge=1, le=1 << 20, description="Context parallel degree.")
    ep: int = Field(1, ge=1, le=1 << 20, description="Expert parallel degree.")
    lora: int | None = Field(None, ge=1, le=65536)
    lora_alpha: float | None = Field(None, ge=-1e6, le=1e6)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_targets: str = "q,v"
    dora: bool = False
    train_modules: str = Field("", description="Modules trained in full beside the adapters: lm_head, "
                               "embed_tokens.")
    adapter_dtype: str = Field("auto", description="auto | fp32 | bf16 | fp16.")
    qlora: bool = False
    base_quant: str | None = None
    double_quant: bool = False
    bnb_version: str | None = Field(None, max_length=40, description="The run's bitsandbytes release (before "
                                    "0.43.2 each 4-bit Linear keeps its input).")
    gpu: str | None = Field(None, description="A GPU name (GET /api/gpus): fits and max_batch answer for it.")
    gpu_memory: StrictStr | StrictInt | StrictFloat | None = Field(
        None, description="A GPU of this memory instead of (or with) a named one: text with a unit (\"48GiB\", "
        "\"80GB\") or a number of GiB.")
    headroom: float = Field(DEFAULT_HEADROOM, ge=1.0, le=10.0)
    fragmentation: float | None = Field(None, ge=0, lt=1, description="Caching-allocator overhead as a fraction "
                                        "of the dynamic memory; unset: the step replayed through the allocator "
                                        f"model (the flat {DEFAULT_FRAGMENTATION:.0%} where it cannot be).")
    alloc_conf: str | None = Field(None, max_length=500, description="PYTORCH_CUDA_ALLOC_CONF options the allocator "
                                   "replay assumes, e.g. expandable_segments:True (unset: the server's environment).")
    cuda_overhead: float = Field(DEFAULT_CUDA_OVERHEAD_MIB, ge=0, le=MAX_CUDA_OVERHEAD_BYTES / 2**20,
                                 description="CUDA context and workspaces, MiB.")
    max_batch: bool = Field(False, description="Replace batch by the largest that fits gpu.")
    max_seq: bool = Field(False, description="Replace seq by the longest that fits gpu.")


def _bound(param_type: Any, key: str) -> int | float | None:
    """A click type's lower or upper bound: IntRange and FloatRange name them min and max, cli._Whole minimum and
    maximum; None where it has none."""
    for attribute in (key, key[:3]):
        value = getattr(param_type, attribute, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None


def estimate_options() -> list[dict[str, Any]]:
    """The estimate command's options that EstimateInput takes, in the command's order, as the page's generated
    controls read them: ``name`` (the field), ``flag``, ``kind`` (bool, int, float or text), ``default`` (None where
    the command decides), ``minimum`` / ``maximum`` where the option's type bounds it, and ``help``. Read from the
    click command itself, so that the CLI's declaration is the one the page shows."""
    import click

    from .commands.estimate import estimate as command

    fields = EstimateInput.model_fields
    options = []
    for param in command.params:
        if not isinstance(param, click.Option) or param.name not in fields:
            continue
        kind = ("bool" if param.is_flag else "int" if param.type.name in ("integer", "integer range") else
                "float" if param.type.name in ("float", "float range") else "text")
        default = param.default if isinstance(param.default, (bool, int, float, str)) else None
        bounds = {key: value for key in ("minimum", "maximum") if (value := _bound(param.type, key)) is not None}
        options.append({"name": param.name, "flag": max(param.opts, key=len), "kind": kind,
                        "default": False if kind == "bool" and default is None else default, **bounds,
                        "help": " ".join((param.help or "").split())})
    return options


class PlanInput(BaseModel):
    """`trainmem plan`'s flags (the defaults are the CLI's), with a cap on the work one request may cause:
    at most MAX_PLAN_GPUS GPUs and MAX_PLAN_SEQ tokens, and a time budget where the planner takes one."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = Field(None, description="A catalog model (GET /api/models).")
    config: dict[str, Any] | None = Field(None, description="An uploaded config.json, instead of model.")
    gpu: str = Field(..., description="A GPU name (GET /api/gpus) with data-sheet throughput.")
    gpus: int | None = Field(None, ge=1, le=MAX_PLAN_GPUS)
    nodes: int | None = Field(None, ge=1, le=MAX_PLAN_GPUS)
    gpus_per_node: int = Field(8, ge=1, le=64)
    seq: int = Field(2048, ge=1, le=MAX_PLAN_SEQ)
    global_batch: int | None = Field(None, ge=1, le=1 << 24)
    recipe: str | None = None
    checkpointing: str | None = None
    mfu: float | None = Field(None, ge=1e-3, le=1)
    inter_node_gbps: float | None = Field(None, ge=1e-3, le=1e6)
    host_memory_gib: float | None = Field(None, ge=0, le=1 << 20)
    min_gpus: bool = False
    top: int = Field(10, ge=1, le=1000)


SETTINGS_FIELDS = ("recipe", "optimizer", "optimizer_impl", "batch", "seq", "grad_accum", "attention",
                   "checkpointing", "dropout", "loss", "activation_k", "optimizer_in_backward", "compile",
                   "offload_activations", "task", "num_labels")
REQUEST_FIELDS = ("params", "gpus", "gpus_per_node", "zero", "fsdp", "offload", "ddp_bucket_view",
                  "fsdp_embedding_groups", "fsdp_version", "fsdp_use_orig_params", "fsdp_no_sync", "bnb_version",
                  "lora",
                  "lora_alpha", "lora_dropout", "lora_targets", "dora", "train_modules", "adapter_dtype", "qlora",
                  "base_quant", "double_quant", "gpu", "headroom", "fragmentation", "alloc_conf", "cuda_overhead",
                  "tp", "sp", "pp", "pp_schedule", "virtual_stages", "micro_batches", "cp", "ep", "pp_layers")


MAX_BUILT_LAYERS = 512
"""An uploaded config of a model type without a hand-written description is counted by building it on the meta
device (meta_count.py, as the CLI does); one with more layers than this is refused first, since building is linear
in the layers (GPT-J at 4,096 layers took 19 s here, at 512 under 13 s with transformers' import; the largest
published models have under 200)."""
MAX_BUILT_EXPERTS = 4096
"""The most experts such a config may ask for (published MoE models have up to 512)."""
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_BUILT: dict[str, ModelSpec] = {}
"""Specs of uploaded configs counted by transformers, by their JSON text (the page sends the config with every
request; building takes a second or more)."""


def _model_of(body: EstimateInput | PlanInput) -> str | ModelSpec | None:
    """A catalog name, a nominal size, or the uploaded config as a ModelSpec: never a path or a Hub id."""
    from .catalog import catalog_names

    given = [name for name in ("model", "config", "params") if getattr(body, name, None) is not None]
    if len(given) != 1:
        raise _FieldError("model", "give a catalog model, an uploaded config or params, one of them")
    if body.config is not None:
        return _uploaded_spec(body.config)
    if getattr(body, "params", None) is not None:
        return None  # (make_request's params)
    if body.model not in catalog_names():
        raise _FieldError("model", f"unknown model {body.model!r}; accepted: the catalog (GET /api/models) or an "
                          "uploaded config")
    return body.model


def _uploaded_spec(config: dict[str, Any]) -> ModelSpec:
    """The ModelSpec of an uploaded config.json, as the CLI reads the same file (catalog.resolve_model_and_config):
    the hand-written description of its model_type, else the parameters counted by transformers."""
    import json

    from .models import UnsupportedModelType, spec_from_config

    try:
        return spec_from_config(config, name="uploaded config", source="upload")
    except UnsupportedModelType as exc:
        reason = str(exc)
    except TrainmemError as exc:
        raise _FieldError("config", str(exc)) from None
    except Exception as exc:  # JSON, but not a config's shapes: never a 500
        raise _FieldError("config", f"not a usable model config ({type(exc).__name__}: {_short(exc)})") from None
    for keys, most, what in ((_LAYER_KEYS, MAX_BUILT_LAYERS, "layers"), (_EXPERT_KEYS, MAX_BUILT_EXPERTS, "experts")):
        for key in keys:
            count = config.get(key)
            if isinstance(count, int) and not isinstance(count, bool) and not 0 <= count <= most:
                raise _FieldError("config", f"upload: config field {key!r} is {count}; a model counted by "
                                  f"transformers may have 0 to {most:,} {what} here")
    key = json.dumps(config, sort_keys=True)
    if key not in _BUILT:
        from .meta_count import spec_by_building

        try:
            spec = spec_by_building(config, name="uploaded config", source="upload", reason=reason)
        except TrainmemError as exc:
            raise _FieldError("config", str(exc)) from None
        except Exception as exc:  # whatever transformers raises on a hostile config: a 422, never a 500
            raise _FieldError("config", f"upload: transformers cannot build this config "
                              f"({type(exc).__name__}: {_short(exc)})") from None
        if len(_BUILT) >= 32:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = spec
    return _BUILT[key]


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else "no message"


def estimate_document(body: EstimateInput) -> dict[str, Any]:
    """The `trainmem estimate --json` document for one request body (EstimateInput)."""
    from .planner import estimate_searched
    from .report import json_safe, to_dict
    from .request import make_request

    model = _model_of(body)
    options = {name: getattr(body, name) for name in SETTINGS_FIELDS + REQUEST_FIELDS}
    if body.gpu_memory is not None:
        options["gpu_memory"] = _gpu_memory(body.gpu_memory)
    with _upload_guard(body):
        req = make_request(model, **options)
        est, extra = estimate_searched(req.model, req.settings, req.device, req.gpu, req.parallel, req.finetune,
                                       find_batch=body.max_batch, find_seq=body.max_seq)
        document: dict[str, Any] = json_safe(to_dict(est, req.gpu, extra))
        return document


@contextlib.contextmanager
def _upload_guard(body: EstimateInput | PlanInput) -> Iterator[None]:
    """An uploaded config is anything a JSON object can be: a value of a type its model_type never takes (a dropout
    given as text, an object where a number goes) that the parser let through and the estimator trips on is a 422
    about the config, not a 500. Requests without an upload are not guarded: a failure there is a bug to see."""
    if body.config is None:
        yield
        return
    try:
        yield
    except TrainmemError:
        raise
    except Exception as exc:
        raise _FieldError("config", f"upload: this config cannot be estimated ({type(exc).__name__}: {_short(exc)}); "
                          "a field holds a type or value its model_type does not take") from None


def _gpu_memory(value: str | float) -> str | int:
    """gpu_memory as make_request takes it: text with a unit as given, a number of GiB as bytes."""
    import inspect

    from .request import make_request

    if not isinstance(value, str) and not 0 < value <= 1 << 20:
        raise _FieldError("gpu_memory", f"gpu_memory must be from 0 to {1 << 20:,} GiB (or text such as "
                          f"\"48GiB\"), got {value!r}")
    if "gpu_memory" not in inspect.signature(make_request).parameters:
        raise _FieldError("gpu_memory", "gpu_memory is not supported by this trainmem's estimator; give a GPU name")
    return value if isinstance(value, str) else int(value * 2**30)


def _run_plan_takes_budget() -> bool:
    import inspect

    from .plan import run_plan

    return "time_budget_s" in inspect.signature(run_plan).parameters


def plan_document_for(body: PlanInput) -> dict[str, Any]:
    """The `trainmem plan --json` document for one request body (plan.run_plan, report.plan_document), searched
    for at most PLAN_TIME_BUDGET_S where the planner takes a budget: ``search.cut_short`` says when it ran out."""
    from .plan import run_plan
    from .report import json_safe, plan_document

    model = _model_of(body)
    if body.nodes is not None and body.nodes * body.gpus_per_node > MAX_PLAN_GPUS:
        raise _FieldError("nodes", f"nodes x gpus_per_node is {body.nodes * body.gpus_per_node:,} GPUs; the web "
                          f"calculator plans at most {MAX_PLAN_GPUS:,} (trainmem plan has no cap)")
    options = {k: getattr(body, k) for k in ("mfu", "inter_node_gbps", "host_memory_gib")
               if getattr(body, k) is not None}
    budget = _run_plan_takes_budget()
    if budget:
        options["time_budget_s"] = PLAN_TIME_BUDGET_S
    with _upload_guard(body):
        found, answer = run_plan(model, body.gpu, body.gpus, body.seq, body.global_batch, body.gpus_per_node,
                                 body.nodes, body.recipe, body.checkpointing, body.min_gpus, **options)
        doc: dict[str, Any] = json_safe(plan_document(found, body.top, answer))
    if budget:  # (report.plan_document says it where PlanSearch has cut_short; the web's answer always does)
        doc["search"].setdefault("cut_short", bool(getattr(found, "cut_short", False)))
    return doc


class _FieldError(ConfigError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _field_of(message: str, names: Iterable[str]) -> str | None:
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


class _Bad:
    """A JSON value the API refuses, left in the parsed body where it stood so that its path can be named."""

    def __init__(self, what: str) -> None:
        self.what = what


class _Pairs(list[tuple[str, Any]]):
    """An object's (key, value) pairs as the parser gave them (duplicates kept, so that they can be refused)."""


def _parse_float(text: str) -> float | _Bad:
    import math

    value = float(text)
    return value if math.isfinite(value) else _Bad(f"{text[:24]} is beyond a float's range; give a finite number")


def _parse_int(text: str) -> int | _Bad:
    return int(text) if len(text) <= 400 else _Bad(f"an integer of {len(text):,} digits is out of every range here")


def _parse_constant(name: str) -> _Bad:
    return _Bad(f"{name} is not a JSON number; give a finite number")


def _check_json(raw: bytes) -> tuple[list[str | int], str] | None:
    """Why a request body cannot be taken, as (its path, the message), or None: not JSON, or JSON with what the
    standard refuses (NaN, Infinity, -Infinity, a number out of a float's range such as 1e999), a string with a lone
    surrogate (no UTF-8 for it), a key given twice, or nesting deeper than MAX_JSON_DEPTH."""
    import json

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], f"the body is not UTF-8 (byte {exc.start})"
    try:
        tree = json.loads(text, parse_float=_parse_float, parse_int=_parse_int, parse_constant=_parse_constant,
                          object_pairs_hook=_Pairs)
    except RecursionError:
        return [], f"the body is nested deeper than {MAX_JSON_DEPTH} levels"
    except ValueError as exc:
        return [], f"the body is not JSON ({_short(exc)})"
    stack: list[tuple[list[str | int], Any]] = [([], tree)]
    while stack:
        path, value = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            return path[:MAX_JSON_DEPTH], f"the body is nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(value, _Bad):
            return path, value.what
        if isinstance(value, str) and _has_surrogate(value):
            return path, "a string with a lone surrogate (\\ud800-\\udfff alone is not a character)"
        if isinstance(value, _Pairs):
            seen: set[str] = set()
            for key, item in value:
                if _has_surrogate(key):
                    return path, "a key with a lone surrogate (\\ud800-\\udfff alone is not a character)"
                if key in seen:
                    return path + [key], f"the key {key!r} is given twice"
                seen.add(key)
                stack.append((path + [key], item))
        elif isinstance(value, list):
            stack.extend((path + [i], item) for i, item in enumerate(value))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _safe(text: str) -> str:
    """Text that encodes as UTF-8 (a message may quote what was sent)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _error(loc: Sequence[str | int], message: str, kind: str = "value_error", status: int = 422) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": [
        {"loc": ["body"] + [_safe(str(x)) if isinstance(x, str) else x for x in loc], "msg": _safe(message),
         "type": kind}]})


def create_app() -> FastAPI:
    """The FastAPI application (``trainmem serve`` runs it with uvicorn). /docs is Swagger UI from the files of the
    fastapi-offline package (the web extra), served here: nothing is fetched from a CDN."""
    from fastapi.exceptions import RequestValidationError

    from .report import gpus_document, models_document

    about = dict(title="trainmem", summary="How much GPU memory a training run needs, where every byte goes.",
                 version=_version())
    app: _App
    try:
        from fastapi_offline import FastAPIOffline
    except ImportError:  # (an install without the whole web extra: the API works, /docs says what is missing)
        app = FastAPI(docs_url=None, redoc_url=None, **about)

        @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
        def no_docs() -> str:
            return ("<!doctype html><title>trainmem API</title><p>The API documentation page needs the fastapi-offline "
                    "package (pip install 'trainmem[web]'); the API's description is at <a href='/openapi.json'>"
                    "/openapi.json</a>.</p>")
    else:
        app = FastAPIOffline(redoc_url=None, swagger_ui_parameters={"validatorUrl": None}, **about)
    cached: dict[str, Any] = {}

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.method in ("POST", "PUT", "PATCH"):
            declared = request.headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
                return _too_large()
            body = await request.body()  # (starlette caches it for the endpoint)
            if len(body) > MAX_BODY_BYTES:
                return _too_large()
            refused = _check_json(body)
            if refused is not None:
                path, message = refused
                named = ".".join(str(x) for x in path)
                return _error(path, f"{named}: {message}" if named else message)
        return await call_next(request)

    @app.exception_handler(TrainmemError)
    async def config_error(request: Request, exc: TrainmemError) -> JSONResponse:
        names = PlanInput.model_fields if request.url.path == "/api/plan" else EstimateInput.model_fields
        field = getattr(exc, "field", None) or _field_of(str(exc), names)
        return _error([field] if field else [], str(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        """pydantic's errors as FastAPI words them (loc, msg, type), without the input they quote."""
        return JSONResponse(status_code=422, content={"detail": [
            {"loc": [_safe(str(x)) if isinstance(x, str) else x for x in e.get("loc", ())],
             "msg": _safe(str(e.get("msg", ""))), "type": str(e.get("type", ""))} for e in exc.errors()]})

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> str:
        if "page" not in cached:
            cached["page"] = resources.files("trainmem").joinpath("static/index.html").read_text(encoding="utf-8")
        text: str = cached["page"]
        return text

    @app.get("/api/models", summary="The built-in catalog (as `trainmem models --json`).")
    def models() -> dict[str, Any]:
        if "models" not in cached:
            cached["models"] = models_document()
        document: dict[str, Any] = cached["models"]
        return document

    @app.get("/api/gpus", summary="The GPU table: names and the memory their drivers report.")
    def gpus() -> dict[str, Any]:
        return gpus_document()

    @app.get("/api/recipes", summary="Bytes per parameter of every recipe x optimizer (as `trainmem recipes --json`).")
    def recipes() -> dict[str, Any]:
        from .recipes_table import recipes_document

        return recipes_document()

    @app.get("/api/options", summary="Every estimate flag this API takes (as the CLI declares them): flag, kind, "
                                     "default, bounds, help.")
    def options() -> dict[str, Any]:
        if "options" not in cached:
            cached["options"] = {"options": estimate_options()}
        document: dict[str, Any] = cached["options"]
        return document

    @app.post("/api/estimate", summary="The document `trainmem estimate --json` prints for these inputs.")
    def estimate(body: EstimateInput) -> JSONResponse:
        return JSONResponse(estimate_document(body))

    searching = threading.BoundedSemaphore(PLAN_CONCURRENCY)
    app.state.plan_slots = searching

    @app.post("/api/plan", summary="The document `trainmem plan --json` prints for these inputs.")
    def plan(body: PlanInput) -> JSONResponse:
        if not searching.acquire(blocking=False):
            return _error([], f"{PLAN_CONCURRENCY} plan searches are running: try again when one has answered",
                          "busy", 429)
        try:
            return JSONResponse(plan_document_for(body))
        finally:
            searching.release()

    return app


def _too_large() -> JSONResponse:
    return _error([], f"the request body is larger than {MAX_BODY_BYTES // 1024} KiB", "too_large", 413)


def _version() -> str:
    from . import __version__

    return __version__


def serve(host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
    """Run the page and its API with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(), host=host, port=port, log_level="warning")

