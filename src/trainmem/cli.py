"""The ``trainmem`` command: a thin layer that parses flags, calls the library and renders.

Every :class:`~trainmem.errors.TrainmemError` and every usage error becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import click

from . import __version__
from .errors import ConfigError, TrainmemError
from .units import DEFAULT_UNIT, parse_unit

if TYPE_CHECKING:  # (names for the annotations only: the commands import these modules when they run)
    from .estimate import DeviceOptions
    from .hardware import GPU
    from .lora import FineTune
    from .models import ModelSpec
    from .settings import TrainingSettings
    from .sharding import Parallel

    _IntType = click.ParamType[int]
    _FloatType = click.ParamType[float]
else:  # (click's ParamType is generic from 8.4 on: the plain class at run time, for click 8.1 too)
    _IntType = _FloatType = click.ParamType

_F = TypeVar("_F", bound=Callable[..., Any])

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


def _flag(param: click.Parameter | None) -> str:
    return max(param.opts, key=len) if param is not None and param.opts else "value"


def _short(text: str) -> str:
    if len(text) <= 24:
        return text
    return f"{text[:8]}...({len(text)} {'digits' if text.lstrip('-').isdigit() else 'characters'})"


class _Whole(_IntType):
    """A whole number up to ``maximum`` (and from ``minimum`` when given; else the command checks the lower end in
    its own words): a typo such as 10**400 is refused in one line while the flags are parsed, before any work."""

    name = "integer"

    def __init__(self, maximum: int, minimum: int | None = None) -> None:
        self.maximum, self.minimum = maximum, minimum

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            try:
                value = int(str(value).strip())
            except ValueError:  # (also Python's 4,300-digit limit on int())
                raise ConfigError(f"{_flag(param)}: {_short(str(value))!r} is not a valid integer (a whole number "
                                  f"up to {self.maximum:,})") from None
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"{_flag(param)} must be a whole number from {self.minimum:,} to {self.maximum:,}, "
                              f"got {_short(str(value))}")
        if value > self.maximum:
            raise ConfigError(f"{_flag(param)} must be at most {self.maximum:,}, got {_short(str(value))}")
        return value


_MAX_STEP = 1 << 24
"""settings.MAX_BATCH, MAX_SEQ and MAX_GRAD_ACCUM (the settings check the lower end, in the API's words)."""
_MAX_GPUS = 1 << 20
"""sharding.MAX_GPUS, the bound of every parallel degree."""


class _Real(_FloatType):
    """A finite number from ``low`` to ``high``: nan, inf and 1e308 are refused in one line while the flags are
    parsed."""

    name = "number"

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{_flag(param)} must be a number, got {_short(str(value))!r}") from None
        if not self.low <= number <= self.high:  # (NaN fails too)
            raise ConfigError(f"{_flag(param)} must be a number from {self.low:g} to {self.high:g}, "
                              f"got {_short(str(value))}")
        return number


COMMANDS = {
    "estimate": "trainmem.commands.estimate:estimate",
    "trace": "trainmem.commands.trace:trace",
    "sweep": "trainmem.commands.sweep:sweep",
    "measure": "trainmem.commands.measure:measure",
    "dtypes": "trainmem.commands.dtypes:dtypes",
    "precision-check": "trainmem.commands.precision_check:precision_check",
    "amp-demo": "trainmem.commands.amp_demo:amp_demo",
    "validate": "trainmem.commands.validate:validate",
    "models": "trainmem.commands.models:models",
    "recipes": "trainmem.commands.recipes:recipes",
    "plan": "trainmem.commands.plan:plan",
    "serve": "trainmem.commands.serve:serve",
    "diff": "trainmem.commands.diff:diff",
}
"""Each command's name and where it is defined ("module:attribute", a click command). A command's module is
imported only when that command runs (or for ``trainmem --help``, which lists every command's short help), so
``trainmem estimate`` imports the estimate's modules and not those of plan, validate, trace or serve. A new command:
a module under trainmem/commands/ defining a ``@click.command()``, and its line here (``@app.command()`` in this
module works too, but is then imported with every command)."""


class LazyGroup(click.Group):
    """A click group whose subcommands are imported when asked for (click's documentation, "Complex Applications":
    lazily loading subcommands)."""

    def __init__(self, *args: Any, lazy_subcommands: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_subcommands = dict(lazy_subcommands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_subcommands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_subcommands:
            return self.lazy_command(cmd_name)
        return super().get_command(ctx, cmd_name)

    def lazy_command(self, cmd_name: str) -> click.Command:
        """Import ``cmd_name``'s module and register the command (the next look-up finds it at once)."""
        import importlib

        module, _, attribute = self.lazy_subcommands.pop(cmd_name).partition(":")
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{module}:{attribute} is not a click command")
        self.add_command(command, cmd_name)
        return command


@click.group(cls=LazyGroup, lazy_subcommands=COMMANDS, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="trainmem")
def app() -> None:
    """How much GPU memory a training run needs, where every byte goes, and whether it fits."""


def __getattr__(name: str) -> click.Command | None:
    """``from trainmem.cli import estimate`` (the command objects by their function names) still works: the
    command's module is imported then."""
    for cmd_name, where in COMMANDS.items():
        if where.partition(":")[2] == name:
            return app.get_command(click.Context(app), cmd_name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _console() -> Any:
    from .plaintext import console  # rich's text without importing rich when stdout is not a terminal

    return console(120)


def _header(engine: str) -> dict[str, Any]:
    from .report import header

    return header(engine)


def _model_dict(spec: ModelSpec) -> dict[str, Any]:
    from .report import model_dict

    return model_dict(spec)


def _emit_json(document: dict[str, Any]) -> None:
    from .report import json_safe

    sys.stdout.write(json.dumps(json_safe(document), indent=2, allow_nan=False) + "\n")


@dataclass
class _Workload:
    """What the workload flags describe: the validated request and the output unit."""

    spec: ModelSpec
    config: dict[str, Any] | None
    """The model's config.json (None for --params)."""
    settings: TrainingSettings
    device: DeviceOptions
    gpu: GPU | None
    unit: str
    parallel: Parallel
    finetune: FineTune | None = None

    @property
    def model_config(self) -> dict[str, Any]:
        """The config.json of a command that asked for one (``need_config``: make_request refuses --params)."""
        assert self.config is not None, "a command that reads the config passes need_config to _workload"
        return self.config


SETTING_FLAGS = ("recipe", "optimizer", "optimizer_impl", "grad_accum", "attention", "checkpointing", "dropout",
                 "loss", "activation_k", "optimizer_in_backward", "compile", "offload_activations", "task",
                 "num_labels")
LAYOUT_FLAGS = ("tp", "sp", "pp", "pp_schedule", "virtual_stages", "micro_batches", "cp", "ep", "pp_layers")
"""Model-parallel flags (modelparallel.py), passed to the request as they are."""
_FLAG_WORDS = ("headroom", "fragmentation", "cuda-overhead", "gpu", "params", "num-labels", "zero", "fsdp", "offload",
               "gpus_per_node", "tp", "pp", "cp", "ep", "pp-schedule", "virtual-stages", "micro-batches", "sp",
               "bnb-version")
"""Request fields whose messages name a flag: the CLI prints them as --flag."""


def _workload(options: dict[str, Any], batch: int, seq: int, need_config: str = "", gpus: int | None = None,
              zero: int | None = None) -> _Workload:
    """Turn the shared flags into a validated request (request.py, where the API's keywords are checked too).
    ``need_config`` names a command that cannot run on ``--params`` alone; ``gpus`` and ``zero`` replace the flags'
    (sweep's axes)."""
    from .request import make_request

    unit = parse_unit(options["units"])
    if gpus is None:
        gpus = _one_int(options["gpus"], "--gpus")
    if zero is None and options["zero"] is not None:
        zero = _one_int(options["zero"], "--zero", minimum=0)
    try:
        req = make_request(options["model"], params=options["params"], gpu=options["gpu"],
                           gpu_memory=options.get("gpu_memory"),
                           headroom=options["headroom"], fragmentation=options["fragmentation"],
                           alloc_conf=options.get("alloc_conf"),
                           cuda_overhead=options["cuda_overhead"], hub=options["hub"], need_config=need_config,
                           gpus=gpus, gpus_per_node=options["gpus_per_node"], zero=zero, fsdp=options["fsdp"],
                           offload=options["offload"], ddp_bucket_view=options["ddp_bucket_view"],
                           fsdp_embedding_groups=options.get("fsdp_embedding_groups", False),
                           fsdp_version=options.get("fsdp_version", 2),
                           fsdp_use_orig_params=options.get("fsdp_use_orig_params", False),
                           fsdp_no_sync=options.get("fsdp_no_sync", False),
                           ds_config=options["ds_config"], accelerate_config=options["accelerate_config"],
                           torchtitan_config=options["torchtitan_config"], lora=options["lora"],
                           lora_alpha=options["lora_alpha"],
                           lora_targets=options["lora_targets"], lora_dropout=options["lora_dropout"],
                           dora=options["dora"], train_modules=options["train_modules"],
                           adapter_dtype=options["adapter_dtype"],
                           base_quant=options["base_quant"], double_quant=options["double_quant"],
                           qlora=options["qlora"], bnb_version=options.get("bnb_version"), batch=batch, seq=seq,
                           **{k: options[k] for k in SETTING_FLAGS}, **{k: options[k] for k in LAYOUT_FLAGS})
    except ConfigError as exc:
        message = str(exc)
        if message.startswith(_FLAG_WORDS):
            word, _, rest = message.partition(" ")
            raise ConfigError(f"--{word.replace('_', '-')} {rest}") from None
        raise
    return _Workload(req.model, req.config, req.settings, req.device, req.gpu, unit, req.parallel, req.finetune)


def _one_int(text: str, flag: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} must be a whole number, got {_short(str(text))!r}") from None
    if value < minimum:
        raise ConfigError(f"{flag} must be at least {minimum}, got {value}")
    return value


def _int_list(text: str, flag: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: {_short(text)!r} is not a comma-separated list of integers, e.g. 1,2,4") from None
    if not values or any(v < minimum for v in values):
        raise ConfigError(f"{flag}: values must be integers of at least {minimum}, got {_short(text)!r}")
    return values


MEASURE_IGNORES = ("gpu", "headroom", "fragmentation", "cuda_overhead", "gpus_per_node",
                   "ddp_bucket_view", "fsdp_embedding_groups", "fsdp_version", "fsdp_use_orig_params", "fsdp_no_sync")
"""Workload flags that change only the estimate's device-side figures or a multi-GPU layout: measure, which runs
one process and compares allocated bytes, refuses them in one line rather than ignore them."""


def _refuse_fit_only_flags(what: str) -> None:
    """measure's and diff's one-line refusal of the MEASURE_IGNORES flags given on the command line; ``what`` says
    what the command does, the rest of the line is the same."""
    ctx = click.get_current_context()
    given = [name for name in MEASURE_IGNORES
             if ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)]
    if given:
        raise ConfigError(f"{what}: {', '.join('--' + name.replace('_', '-') for name in given)} only change what "
                          "estimate says fits a GPU (use trainmem estimate for that)")


def _one_process(w: _Workload, command: str) -> None:
    if w.parallel is not None and (w.parallel.engine != "single" or w.parallel.is_model_parallel):
        raise ConfigError(f"{command} runs one process: --gpus above 1, --zero, --fsdp, --tp, --pp, --cp and --ep "
                          "are for estimate and sweep")


_gpu_memory_option = click.option(
    "--gpu-memory", help="The GPU's memory: 48GiB, 80GB, 49140MiB or bytes. With --gpu it replaces that card's; alone "
    "it is a custom card.")
"""estimate's and sweep's (trace and measure run no GPU-fit check, so they do not take it)."""


def _workload_options(f: _F) -> _F:
    """The flags estimate and sweep share."""
    from .hardware import DEFAULT_CUDA_OVERHEAD_MIB, DEFAULT_FRAGMENTATION
    from .estimate import DEFAULT_HEADROOM

    options = [
        click.argument("model", required=False),
        click.option("--params", help="Nominal parameter count instead of a model: 7e9, 7B."),
        click.option("--recipe", default="mixed-bf16", show_default=True, help="Precision recipe (trainmem recipes)."),
        click.option("--optimizer", default="adamw", show_default=True, help="Optimizer (trainmem recipes)."),
        click.option("--optimizer-impl", default="auto", show_default=True,
                     help="foreach | fused | auto (fused for mixed-* recipes)."),
        click.option("--grad-accum", type=_Whole(_MAX_STEP), default=1, show_default=True,
                     help="Gradient accumulation steps."),
        click.option("--attention", default="sdpa", show_default=True, help="eager | sdpa | flash."),
        click.option("--checkpointing", default="none", show_default=True,
                     help="none | selective (every second decoder layer, torchtitan's layer SAC) | op (torchtitan's "
                          "per-op SAC of every layer) | full (every one)."),
        click.option("--dropout", type=float, default=None, help="Dropout probability (default: the config's)."),
        click.option("--loss", default="standard", show_default=True,
                     help="standard | chunked (Liger's fused linear CE) | chunked-output (torchtune's 8-slice CE)."),
        click.option("--activation-k", type=float, default=None,
                     help="Use the seed's rule b*s*h*L*k*2 bytes for activations."),
        click.option("--optimizer-in-backward", is_flag=True,
                     help="Step each parameter as its gradient is made, then free it (torchtune's optimizer_in_bwd)."),
        click.option("--compile", is_flag=True,
                     help="torch.compile each decoder layer (and torchtune's per-slice loss): what the partitioner "
                          "saves."),
        click.option("--offload-activations", is_flag=True,
                     help="Checkpointed layers' inputs in host memory until backward (torchtune's activation "
                          "offloading; needs --checkpointing full)."),
        click.option("--task", default="causal-lm", show_default=True,
                     help="causal-lm | masked-lm | seq-cls | seq2seq-lm: the transformers head and loss trained "
                          "(anything but causal-lm is traced: BERT, RoBERTa, ModernBERT, T5, BART)."),
        click.option("--num-labels", type=_Whole(1 << 20), default=None,
                     help="--task seq-cls: the classifier's labels (default: the config's num_labels)."),
        click.option("--gpu", help="GPU to check (the table lists all; H100 is the SXM card): a verdict line says "
                     "whether it fits, the margin and the largest micro-batch."),
        click.option("--headroom", type=float, default=DEFAULT_HEADROOM, show_default=True,
                     help="Safety factor multiplying the device total, on top of the fragmentation and CUDA "
                          "allowances: required = device total x headroom; 1 gives the plain answer."),
        click.option("--fragmentation", type=float, default=None,
                     help="Caching-allocator overhead as a fraction of the dynamic memory, instead of replaying the "
                          "step through the allocator model (where there is no replay: "
                          f"{DEFAULT_FRAGMENTATION:g})."),
        click.option("--cuda-overhead", type=float, default=DEFAULT_CUDA_OVERHEAD_MIB, show_default=True,
                     help="CUDA context and workspaces, MiB."),
        click.option("--units", default=DEFAULT_UNIT, show_default=True, help="GiB, GB, MiB, ..."),
        click.option("--hub", is_flag=True, help="Allow fetching a Hub model's config.json from the network (by "
                     "default only the catalog, local files and the local Hub cache are read)."),
        click.option("--gpus", default="1", show_default=True,
                     help="Data-parallel GPUs (world size); figures are then per GPU. sweep: a list, e.g. 1,2,4,8."),
        click.option("--gpus-per-node", type=_Whole(_MAX_GPUS), default=0,
                     help="GPUs per node (default: 8, or --gpus if fewer)."),
        click.option("--zero", default=None, help="DeepSpeed ZeRO stage 0|1|2|3. sweep: a list, e.g. 0,1,2,3."),
        click.option("--fsdp", default=None, help="PyTorch FSDP2: full | grad-op | hybrid | no-shard."),
        click.option("--offload", default="none", show_default=True,
                     help="none | optimizer | optimizer+params (to host memory; ZeRO or FSDP2)."),
        click.option("--ddp-bucket-view", is_flag=True,
                     help="DDP with gradient_as_bucket_view=True (no second copy of the gradients)."),
        click.option("--fsdp-embedding-groups", is_flag=True,
                     help="FSDP2: the token embedding and the LM head are groups of their own, resharded after "
                          "forward (torchtune's custom_sharded_layers), not in the gathered root."),
        click.option("--fsdp-version", type=click.IntRange(1, 2), default=2, show_default=True,
                     help="2: FSDP2 (fully_shard); 1: FSDP1 (FullyShardedDataParallel: a flat parameter per "
                          "decoder layer and one for the rest), with --fsdp full, grad-op or no-shard."),
        click.option("--fsdp-use-orig-params", is_flag=True,
                     help="FSDP1's use_orig_params=True (Fabric's default): with LoRA a layer's flat gradient covers "
                          "its frozen weights too."),
        click.option("--fsdp-no-sync", is_flag=True,
                     help="FSDP1: the accumulation micro-batches run in no_sync() (Fabric's no_backward_sync), "
                          "keeping every unit's unsharded gradient until the synced one."),
        click.option("--ds-config", type=click.Path(dir_okay=False),
                     help="A DeepSpeed config: its stage, buckets, offload, bf16/fp16 mode, micro-batch and "
                          "accumulation apply where the flags are at their defaults."),
        click.option("--accelerate-config", type=click.Path(dir_okay=False),
                     help="An accelerate config YAML (trainmem plan --out writes one): its processes, machines, "
                          "FSDP2 / DeepSpeed layout, mixed precision and checkpointing apply likewise."),
        click.option("--torchtitan-config", type=click.Path(dir_okay=False),
                     help="The torchtitan.json trainmem plan --out writes: its batch, dtypes, degrees and "
                          "checkpointing apply likewise."),
        click.option("--tp", type=_Whole(_MAX_GPUS), default=1, show_default=True,
                     help="Tensor parallel: heads, MLP width and vocabulary split across TP GPUs."),
        click.option("--sp", is_flag=True, help="Sequence parallel on the tensor-parallel GPUs (needs --tp)."),
        click.option("--pp", type=_Whole(_MAX_GPUS), default=1, show_default=True, help="Pipeline stages."),
        click.option("--pp-schedule", default="1f1b", show_default=True, help="1f1b | interleaved."),
        click.option("--pp-layers", default=None, help="Layers per pipeline stage where they do not split evenly "
                     "(15,16,16,15), or torchtitan (its split: the embedding and the output count as a layer)."),
        click.option("--virtual-stages", type=_Whole(_MAX_GPUS), default=1, show_default=True,
                     help="Model chunks per GPU with --pp-schedule interleaved."),
        click.option("--micro-batches", type=_Whole(_MAX_GPUS), default=0,
                     help="Micro-batches per step through the pipeline (default: --pp)."),
        click.option("--cp", type=_Whole(_MAX_GPUS), default=1, show_default=True,
                     help="Context parallel: the sequence split."),
        click.option("--ep", type=_Whole(_MAX_GPUS), default=1, show_default=True,
                     help="Expert parallel: routed experts split."),
        click.option("--lora", type=_Whole(65536), default=None, help="Train LoRA adapters of this rank on a frozen "
                     "base (the step is modelled for Llama-style, GPT-2 and OPT layers with SDPA; elsewhere the static "
                     "memory)."),
        click.option("--lora-alpha", type=float, default=None, help="LoRA alpha (scales the adapters; no bytes)."),
        click.option("--lora-dropout", type=float, default=0.0, show_default=True,
                     help="Dropout on each adapter's input (peft's lora_dropout)."),
        click.option("--lora-targets", default="q,v", show_default=True,
                     help="q,k,v,o,gate,up,down,lm_head, peft module names (q_proj, c_attn, ...) or all-linear."),
        click.option("--dora", is_flag=True, help="DoRA (peft's use_dora): LoRA plus a trained magnitude per output "
                     "feature of each adapted Linear."),
        click.option("--train-modules", default="", help="Modules trained in full beside the adapters (peft's "
                     "modules_to_save): lm_head, embed_tokens."),
        click.option("--adapter-dtype", default="auto", show_default=True,
                     help="auto (fp32 over a half base, as peft does) | fp32 | bf16 | fp16."),
        click.option("--base-quant", default=None, help="Quantize the frozen base: nf4 | fp4 | int8 (bitsandbytes)."),
        click.option("--double-quant", is_flag=True, help="4-bit base with double quantization of the constants."),
        click.option("--qlora", is_flag=True, help="QLoRA's base: --base-quant nf4 --double-quant."),
        click.option("--bnb-version", default=None, help="The run's bitsandbytes release (e.g. 0.42.0; default: "
                     "0.50.2's rules): before 0.43.2 each 4-bit Linear keeps its input for backward."),
        click.option("--json", "as_json", is_flag=True, help="Print the versioned JSON document (bytes as integers)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


OPTIONAL_PACKAGES = {"torch": "trace", "transformers": "trace", "safetensors": "trace", "matplotlib": "plot",
                     "huggingface_hub": "hub", "peft": "finetune", "bitsandbytes": "finetune",
                     "fastapi": "web", "uvicorn": "web", "pydantic": "web"}
"""Packages the optional commands import, and the extra that installs each."""


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: one line and exit 2 for any bad input, never a traceback."""
    from .progress import quiet_libraries

    quiet_libraries()  # the libraries' warnings and log notes are not the command's answer
    try:
        code = app.main(args=argv, prog_name="trainmem", standalone_mode=False)
        if isinstance(code, int):  # click returns a raised Exit's code here instead of exiting
            return code
    except TrainmemError as exc:
        print(f"trainmem: error: {exc}", file=sys.stderr)
        return 2
    except click.exceptions.UsageError as exc:
        where = f"{exc.ctx.command_path}: " if exc.ctx and exc.ctx.parent else ""
        print(f"trainmem: error: {where}{exc.format_message()}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        extra = OPTIONAL_PACKAGES.get(package)
        if extra is None:
            raise
        print(f"trainmem: error: this command needs {package}, which is not installed; "
              f"pip install 'trainmem[{extra}]'", file=sys.stderr)
        return 2
    except click.exceptions.Abort:
        print("trainmem: aborted", file=sys.stderr)
        return 130
    except click.exceptions.Exit as exc:
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
