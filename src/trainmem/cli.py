"""The ``trainmem`` command: a thin layer that parses flags, calls the library and renders.

Every :class:`~trainmem.errors.TrainmemError` and every usage error becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import dataclass
from typing import Optional

import click

from . import __version__
from .errors import ConfigError, TrainmemError
from .units import DEFAULT_UNIT, parse_unit

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


def _flag(param) -> str:
    return max(param.opts, key=len) if param is not None and param.opts else "value"


def _short(text: str) -> str:
    if len(text) <= 24:
        return text
    return f"{text[:8]}...({len(text)} {'digits' if text.lstrip('-').isdigit() else 'characters'})"


class _Whole(click.ParamType):
    """A whole number up to ``maximum`` (and from ``minimum`` when given; else the command checks the lower end in
    its own words): a typo such as 10**400 is refused in one line while the flags are parsed, before any work."""

    name = "integer"

    def __init__(self, maximum: int, minimum: int | None = None) -> None:
        self.maximum, self.minimum = maximum, minimum

    def convert(self, value, param, ctx):
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


class _Real(click.ParamType):
    """A finite number from ``low`` to ``high``: nan, inf and 1e308 are refused in one line while the flags are
    parsed."""

    name = "number"

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{_flag(param)} must be a number, got {_short(str(value))!r}") from None
        if not self.low <= number <= self.high:  # (NaN fails too)
            raise ConfigError(f"{_flag(param)} must be a number from {self.low:g} to {self.high:g}, "
                              f"got {_short(str(value))}")
        return number


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="trainmem")
def app() -> None:
    """How much GPU memory a training run needs, where every byte goes, and whether it fits."""


def _console():
    from .plaintext import console  # rich's text without importing rich when stdout is not a terminal

    return console(120)


def _header(engine: str) -> dict:
    from .report import header

    return header(engine)


def _model_dict(spec) -> dict:
    from .report import model_dict

    return model_dict(spec)


def _emit_json(document: dict) -> None:
    from .report import json_safe

    sys.stdout.write(json.dumps(json_safe(document), indent=2, allow_nan=False) + "\n")


@dataclass
class _Workload:
    """What the workload flags describe: the validated request and the output unit."""

    spec: object
    config: dict | None
    """The model's config.json (None for --params)."""
    settings: object
    device: object
    gpu: object
    unit: str
    parallel: object = None
    finetune: object = None


SETTING_FLAGS = ("recipe", "optimizer", "optimizer_impl", "grad_accum", "attention", "checkpointing", "dropout",
                 "loss", "activation_k", "optimizer_in_backward", "compile", "offload_activations", "task",
                 "num_labels")
LAYOUT_FLAGS = ("tp", "sp", "pp", "pp_schedule", "virtual_stages", "micro_batches", "cp", "ep", "pp_layers")
"""Model-parallel flags (modelparallel.py), passed to the request as they are."""
_FLAG_WORDS = ("headroom", "fragmentation", "cuda-overhead", "gpu", "params", "num-labels", "zero", "fsdp", "offload",
               "gpus_per_node", "tp", "pp", "cp", "ep", "pp-schedule", "virtual-stages", "micro-batches", "sp",
               "bnb-version")
"""Request fields whose messages name a flag: the CLI prints them as --flag."""


def _workload(options: dict, batch: int, seq: int, need_config: str = "", gpus: int | None = None,
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


def _one_process(w: _Workload, command: str) -> None:
    if w.parallel is not None and (w.parallel.engine != "single" or w.parallel.is_model_parallel):
        raise ConfigError(f"{command} runs one process: --gpus above 1, --zero, --fsdp, --tp, --pp, --cp and --ep "
                          "are for estimate and sweep")


_gpu_memory_option = click.option(
    "--gpu-memory", help="The GPU's memory: 48GiB, 80GB, 49140MiB or bytes. With --gpu it replaces that card's; alone "
    "it is a custom card.")
"""estimate's and sweep's (trace and measure run no GPU-fit check, so they do not take it)."""


def _workload_options(f):
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
                          "decoder layer and one for the rest), with --fsdp full or grad-op."),
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


@app.command()
@_workload_options
@_gpu_memory_option
@click.option("--batch", type=_Whole(_MAX_STEP), default=1, show_default=True, help="Micro-batch size per GPU.")
@click.option("--seq", type=_Whole(_MAX_STEP), default=2048, show_default=True, help="Sequence length in tokens.")
@click.option("--max-batch", is_flag=True, help="Find the largest micro-batch that fits --gpu (none: says \"does not fit, "
              "not even batch 1\"; exit code 0).")
@click.option("--max-seq", is_flag=True, help="Find the longest sequence that fits --gpu, up to the model's position "
              "limit unless RoPE scaling extends it (none: says so; exit code 0).")
@click.option("--explain", is_flag=True, help="List every saved tensor of a layer.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG: each phase's bytes by category, with "
              "the bytes needed and GPU capacities as lines (with --explain-reserved, also NAME-reserved.png: "
              "allocated vs reserved through the replay).")
@click.option("--alloc-conf", default=None, metavar="TEXT",
              help="PYTORCH_CUDA_ALLOC_CONF options the allocator replay assumes, e.g. expandable_segments:True "
                   "(default: the environment's PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF, else torch's).")
@click.option("--explain-reserved", is_flag=True, help="The allocator replay behind the reserved line: the segments "
              "at the peak and allocated vs reserved through two steps.")
def estimate(batch, seq, max_batch, max_seq, explain, plot, explain_reserved, **options) -> None:
    """Estimate the memory of training MODEL: a catalog name (trainmem models), a Hub repo id, or a path to a
    config.json or its folder.

    \b
    Example: trainmem estimate meta-llama/Llama-2-7b-hf --recipe mixed-bf16 --optimizer adamw
             trainmem estimate llama-3-8b --batch 4 --seq 4096 --checkpointing full --gpu H100-80GB
             trainmem estimate llama-2-7b --gpu A100-80GB --max-batch
             trainmem estimate llama-3.1-8b --lora 8 --checkpointing full --gpu RTX-4090 --headroom 1
             trainmem estimate llama-3.2-1b --gpu-memory 48GiB
             trainmem estimate --params 7e9 --recipe pure-bf16 --units GB
             trainmem estimate llama-3-8b --checkpointing full --plot memory.png
    """
    from .planner import estimate_searched
    from .report import gpu_verdict, render_estimate, to_dict

    if plot is not None:
        from .outputs import check_output_file

        plot_path = check_output_file(plot, "--plot", ".png")
    w = _workload(options, batch, seq)
    unit, target, as_json = w.unit, w.gpu, options["as_json"]
    if explain_reserved and w.device.fragmentation is not None:
        raise ConfigError("--explain-reserved shows the allocator replay, which --fragmentation replaces: give one")
    est, extra = estimate_searched(w.spec, w.settings, w.device, target, w.parallel, w.finetune, max_batch, max_seq)
    if explain_reserved and est.allocator is None:
        raise ConfigError("--explain-reserved: this estimate has no allocator replay (it needs a layer-by-layer step: "
                          "a model config, no --activation-k, one GPU or a data-parallel engine)")
    if plot is not None:
        from .outputs import replacing

        from .plots import plot_estimate

        with replacing(plot_path) as temporary:
            plot_estimate(est, temporary, unit, target)
        if explain_reserved:
            from .plots import plot_reserved

            reserved_path = plot_path.with_name(f"{plot_path.stem}-reserved.png")
            with replacing(reserved_path) as temporary:
                plot_reserved(est.allocator, temporary, unit, f"{est.model.name}: caching allocator replay")
    if as_json:
        _emit_json(to_dict(est, target, extra))
    else:
        console = _console()
        for key in ("max_batch", "max_seq"):
            if key not in extra:
                continue
            what, value = ("micro-batch" if key == "max_batch" else "sequence length"), extra[key]
            if not value:  # an answer, not an error: exit code 0
                least = "batch 1" if key == "max_batch" else f"a sequence of 1 token at batch {est.settings.batch}"
                console.print(f"[bold red]{target.name}: does not fit, not even {least}[/bold red] (the estimate "
                              f"below is at batch {est.settings.batch}, seq {est.settings.seq:,})", highlight=False,
                              soft_wrap=True)
            elif key == "max_seq" and extra["max_seq_is_position_limit"]:
                console.print(f"[bold]sequence length {value:,} fits {target.name}: the model's "
                              f"max_position_embeddings, the longest it takes[/bold] (shown below)")
            else:
                console.print(f"[bold]largest {what} that fits {target.name}: {value:,}[/bold] (shown below)")
        verdict = gpu_verdict(est, target) if target is not None else None
        render_estimate(est, unit, console, target, explain, verdict)
        if explain_reserved:
            from .replay import explain_reserved_lines

            for line in explain_reserved_lines(est, unit):
                console.print(line, highlight=False, soft_wrap=True)
        if plot:
            console.print(f"plot written to {plot}")
            if explain_reserved:
                console.print(f"allocator timeline written to {plot_path.with_name(plot_path.stem + '-reserved.png')}")


@app.command()
@_workload_options
@click.option("--batch", type=_Whole(_MAX_STEP), default=1, show_default=True, help="Micro-batch size per GPU.")
@click.option("--seq", type=_Whole(_MAX_STEP), default=2048, show_default=True, help="Sequence length in tokens.")
@click.option("--no-round", is_flag=True, help="Keep raw tensor sizes (CUDA rounds each allocation to 512 B).")
@click.option("--allocator", "replay_allocator", is_flag=True,
              help="Replay two steps' allocations through a model of CUDA's caching allocator: max_memory_reserved, "
                   "fragmentation at the peak, largest inactive split, and the first allocation that fails on --gpu.")
@click.option("--alloc-conf", default=None, metavar="TEXT",
              help="PYTORCH_CUDA_ALLOC_CONF options for --allocator, e.g. expandable_segments:True (default: the "
                   "environment's PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF).")
@click.option("--factory", default=None, metavar="PKG.MODULE:FUNCTION",
              help="Trace your own model (not a transformers one): the function that builds the torch.nn.Module, "
                   "called under FakeTensorMode; instead of MODEL (recipe fp32 unless --recipe says otherwise).")
@click.option("--batch-fn", default=None, metavar="PKG.MODULE:FUNCTION",
              help="--factory: make_batch(batch, seq) returns the forward's input (a tensor, a tuple or a dict); "
                   "default: input_ids below the model's vocab_size.")
@click.option("--at", "at_sizes", default=None, metavar="BxS,...",
              help="--factory: also record the step at four sizes around --seq and estimate it at these micro-batch "
                   "x sequence sizes, e.g. 8x4096,16x2048.")
def trace(batch, seq, no_round, replay_allocator, alloc_conf, factory, batch_fn, at_sizes, **options) -> None:
    """Run one real training step of MODEL's transformers implementation under FakeTensorMode on the CPU
    (no GPU, no memory), count every allocation, and compare with the estimate. With --gpus N --fsdp full, one rank
    of FSDP2 on a fake process group; with --gpus N --tp N [--sp], one rank of DTensor tensor parallelism.

    \b
    Example: trainmem trace llama-2-7b --batch 1 --seq 2048 --recipe mixed-bf16
             trainmem trace llama-3-8b --gpus 8 --fsdp full --recipe mixed-bf16
             trainmem trace llama-3.2-1b --gpus 8 --fsdp full --lora 16
             trainmem trace llama-3-8b --gpus 2 --tp 2 --sp --recipe pure-bf16-bf16states
             trainmem trace llama-3.2-1b --allocator --alloc-conf expandable_segments:True --gpu L4
    """
    from .step import check_runnable

    if factory is not None or batch_fn is not None or at_sizes is not None:
        return _trace_factory(factory, batch_fn, at_sizes, batch, seq, no_round, options)
    if alloc_conf is not None and not replay_allocator:
        raise ConfigError("--alloc-conf sets the allocator that --allocator replays: give --allocator too")
    w = _workload(options, batch, seq, need_config="trace")
    if w.finetune is not None and w.finetune.base_quant:
        raise ConfigError("trace runs LoRA on a full-precision base: bitsandbytes' quantized kernels cannot run on "
                          "fake tensors (the stored bytes are checked against bitsandbytes in the tests)")
    tensor_parallel = w.parallel is not None and w.parallel.is_model_parallel
    sharded = w.parallel is not None and w.parallel.engine != "single" and not tensor_parallel
    if sharded and w.parallel.engine != "fsdp2":
        raise ConfigError("trace runs one GPU, one rank of FSDP2 (--gpus N --fsdp full|grad-op) or of tensor "
                          "parallelism (--gpus N --tp N [--sp]); DDP and DeepSpeed are estimated only, as is FSDP1")
    if replay_allocator and (tensor_parallel or sharded):
        raise ConfigError("trace --allocator replays the one-GPU trace; not with --fsdp or --tp yet")
    if replay_allocator:
        from .allocator import config_from_environment, parse_alloc_conf

        alloc_config = parse_alloc_conf(alloc_conf) if alloc_conf is not None else config_from_environment()
        # the card's memory less what is not PyTorch's (--cuda-overhead: the CUDA context and libraries)
        capacity = w.gpu.memory_bytes - w.device.cuda_overhead_bytes if w.gpu is not None else None
        if capacity is not None and capacity <= 0:
            raise ConfigError(f"--cuda-overhead leaves nothing of {w.gpu.name}'s memory to the caching allocator")
    if tensor_parallel:
        from .trace import check_tp_traceable

        check_tp_traceable(w.settings, w.parallel, w.spec)
    elif sharded:
        from .trace import check_fsdp_traceable

        check_fsdp_traceable(w.settings, w.parallel)
    else:
        check_runnable(w.settings)
    from .meta_count import check_transformers_config

    check_transformers_config(w.config, w.spec.source or w.spec.name)  # (what transformers would refuse mid-trace)

    from .stepmodel import estimate_model
    from .report import render_trace, trace_to_dict
    from .trace import trace_fsdp_step, trace_step

    spec, settings, unit, as_json = w.spec, w.settings, w.unit, options["as_json"]
    config = w.config
    est = estimate_model(spec, settings, w.device, w.parallel, w.finetune)
    from .progress import Progress

    with Progress(f"tracing one step of {spec.name} on fake tensors", as_json=as_json):
        if tensor_parallel:
            from .trace import trace_tp_step

            result = trace_tp_step(config, settings, w.parallel, spec, round_to_cuda=not no_round)
        elif sharded:
            result = trace_fsdp_step(config, settings, w.parallel, spec, round_to_cuda=not no_round,
                                     finetune=w.finetune)
        else:
            result = trace_step(config, settings, spec, round_to_cuda=not no_round, finetune=w.finetune,
                                record_allocations=replay_allocator)
    replayed = None
    if replay_allocator:
        from .allocator import render_lines, replay

        replayed = replay(result.allocations, alloc_config, capacity=capacity,
                          device_total=w.gpu.memory_bytes if w.gpu is not None else None)
    if as_json:
        document = trace_to_dict(est, result.phases, result.seconds, result.rounded, result.host_bytes)
        if replayed is not None:
            document["trace"]["allocator"] = {**replayed.to_dict(),
                                              "traced_max_allocated_bytes": result.peak.allocated_bytes}
        _emit_json(document)
    else:
        console = _console()
        render_trace(est, result.phases, result.seconds, unit, console, result.host_bytes)
        if replayed is not None:
            for line in render_lines(replayed, result.peak.allocated_bytes, unit):
                console.print(line, markup=False, highlight=False)


_FACTORY_FLAGS = ("recipe", "optimizer", "optimizer_impl", "grad_accum", "checkpointing", "loss", "compile",
                  "offload_activations", "optimizer_in_backward", "task")
"""The settings a --factory trace takes (factory.check_module_settings refuses the ones it does not run); every
other workload flag, changed from its default, is refused in one line."""


def _at_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        b, sep, s = part.lower().partition("x")
        if not sep or not b.isdigit() or not s.isdigit() or int(b) < 1 or int(s) < 1:
            raise ConfigError(f"--at {_short(text)!r}: give micro-batch x sequence sizes such as 8x4096,16x2048")
        sizes.append((int(b), int(s)))
    if not sizes:
        raise ConfigError("--at needs at least one size such as 8x4096")
    return sizes


def _trace_factory(factory, batch_fn, at_sizes, batch, seq, no_round, options) -> None:
    """trace --factory: a user's own module traced under FakeTensorMode (factory.py)."""
    from .factory import check_module_settings, load_factory, record_module, trace_module
    from .settings import make_settings

    if factory is None:
        raise ConfigError("--batch-fn and --at go with --factory pkg.module:build_model")
    if options["model"] is not None or options["params"] is not None:
        raise ConfigError("give a MODEL (a transformers config) or --factory (your own module), not both")
    context = click.get_current_context()
    extra = sorted(k for k in options if k not in (*_FACTORY_FLAGS, "model", "params", "units", "as_json")
                   and context.get_parameter_source(k) not in (click.core.ParameterSource.DEFAULT, None))
    if extra:
        raise ConfigError(f"trace --factory traces one GPU's step of your module; {', '.join('--' + k.replace('_', '-') for k in extra)} "
                          "are for transformers models")
    values = {k: options[k] for k in _FACTORY_FLAGS}
    if context.get_parameter_source("recipe") == click.core.ParameterSource.DEFAULT:
        values["recipe"] = "fp32"  # (estimate's default, mixed-bf16, keeps masters a user's module does not have)
    settings = make_settings(batch=batch, seq=seq, **values)
    check_module_settings(settings)
    sizes = _at_sizes(at_sizes) if at_sizes is not None else []
    build = load_factory(factory)
    make_batch = load_factory(batch_fn, "--batch-fn") if batch_fn is not None else None
    from .progress import Progress

    with Progress(f"tracing {factory} on fake tensors", as_json=options["as_json"]):
        result = trace_module(build, settings, make_batch, round_to_cuda=not no_round)
        program = record_module(build, settings, make_batch, seq=seq) if sizes else None
    _print_factory(factory, settings, result, program, sizes, parse_unit(options["units"]), options["as_json"])


def _print_factory(factory, settings, result, program, sizes, unit, as_json) -> None:
    from .units import format_bytes

    estimated = [(b, s, program.phases(b, s)) for b, s in sizes] if program is not None else []
    if as_json:
        _emit_json({**_header("trace"), "factory": factory, "settings": settings.as_dict(),
                    "phases": [{"name": p.name, **p.by_category(), "allocated_bytes": p.allocated_bytes}
                               for p in result.phases],
                    "estimated": [{"batch": b, "seq": s, "peak_phase": max(ph, key=lambda p: p.allocated_bytes).name,
                                   "peak_bytes": max(p.allocated_bytes for p in ph)} for b, s, ph in estimated]})
        return
    console = _console()
    console.print(f"{factory}: one step traced under FakeTensorMode at micro-batch {settings.batch}, sequence "
                  f"{settings.seq} ({settings.recipe}, {settings.optimizer}) in {result.seconds:.1f} s",
                  markup=False, highlight=False)
    for p in result.phases:
        parts = ", ".join(f"{k} {format_bytes(v, unit)}" for k, v in p.by_category().items() if v)
        console.print(f"  {p.name:<14} {format_bytes(p.allocated_bytes, unit):>12}  ({parts})", markup=False,
                      highlight=False)
    console.print(f"  peak: {result.peak.name}, {format_bytes(result.peak.allocated_bytes, unit)}", markup=False,
                  highlight=False)
    for b, s, ph in estimated:
        top = max(ph, key=lambda p: p.allocated_bytes)
        console.print(f"  estimated at {b} x {s}: peak {format_bytes(top.allocated_bytes, unit)} ({top.name}; "
                      f"recorded at 1 x {settings.seq}, 1 x {2 * settings.seq}, 1 x {3 * settings.seq}, "
                      f"2 x {settings.seq}, fitted c0 + b*q(s))", markup=False, highlight=False)


@app.command()
@_workload_options
@_gpu_memory_option
@click.option("--batch", "batches", default="1,2,4,8", show_default=True, help="Micro-batch sizes, comma-separated.")
@click.option("--seq", "seqs", default="1024,2048,4096", show_default=True, help="Sequence lengths, comma-separated.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG: the bytes needed against the batch or the "
              "sequence, with GPU capacities and where each runs out.")
def sweep(batches, seqs, plot, **options) -> None:
    """Estimate a grid of micro-batch sizes x sequence lengths.

    \b
    Example: trainmem sweep llama-2-7b --batch 1,2,4,8 --seq 1024,2048,4096 --gpu A100-80GB
             trainmem sweep llama-3-8b --batch 1,2,4,8,16,32 --seq 2048 --plot batch.png
    """
    from .planner import sweep as run_sweep
    from .report import render_sweep, to_dict

    from dataclasses import replace

    from .settings import check_grid

    batch_list, seq_list = _int_list(batches, "--batch"), _int_list(seqs, "--seq")
    check_grid(batch_list, seq_list, names=("--batch", "--seq"))
    if plot is not None:
        from .outputs import check_output_file

        plot_path = check_output_file(plot, "--plot", ".png")
        if len(set(batch_list)) < 2 and len(set(seq_list)) < 2:
            raise ConfigError("--plot draws memory against the batch or the sequence: give more than one --batch or "
                              "--seq value")
    gpu_list = _int_list(options["gpus"], "--gpus")
    zero_list = [None] if options["zero"] is None else _int_list(options["zero"], "--zero", minimum=0)
    sharded = next((g for g in gpu_list if g > 1), None)
    w = _workload(options, batch_list[0], seq_list[0], gpus=sharded or 1, zero=zero_list[0] if sharded else None)
    spec, settings, device, target, unit, as_json = w.spec, w.settings, w.device, w.gpu, w.unit, options["as_json"]
    layouts = []
    for g in gpu_list:
        for z in zero_list:
            try:  # (one GPU has nothing to shard: its row is the single-GPU one, once)
                layout = replace(w.parallel, gpus=g, zero=z if g > 1 else None,
                                 fsdp=w.parallel.fsdp if g > 1 else None, offload=w.parallel.offload if g > 1 else
                                 "none", gpus_per_node=min(w.parallel.gpus_per_node, g))
            except ConfigError as exc:
                raise ConfigError(f"--gpus {g} --zero {z}: {exc}") from None
            if layout not in layouts:
                layouts.append(layout)
    check_grid(batch_list, seq_list, len(layouts), names=("--batch", "--seq"))
    estimates = run_sweep(spec, settings, batch_list, seq_list, device, layouts, w.finetune)
    if any(e.peak is None for e in estimates):
        why = ("this LoRA set-up's activations are not modelled yet" if w.finetune
               else "give a model config, not --params")
        raise ConfigError(f"a sweep needs activations: {why}")
    if plot is not None:
        from .outputs import replacing
        from .plots import plot_sweep

        with replacing(plot_path) as temporary:
            plot_sweep(estimates, temporary, unit, target)
    if as_json:
        _emit_json({**_header("sweep"), "sweep": [to_dict(e, target, search_batch=False) for e in estimates]})
    else:
        render_sweep(estimates, unit, _console(), target)
        if plot:
            _console().print(f"plot written to {plot}")


@app.command()
@_workload_options
@click.option("--batch", type=_Whole(_MAX_STEP), default=1, show_default=True, help="Micro-batch size per GPU.")
@click.option("--seq", type=_Whole(_MAX_STEP), default=512, show_default=True, help="Sequence length in tokens.")
@click.option("--device", default="auto", show_default=True, help="cuda, cuda:N, cpu or auto.")
@click.option("--steps", type=_Whole(1000), default=2, show_default=True,
              help="Steps to run; the last one is measured.")
@click.option("--snapshot", type=click.Path(dir_okay=False), help="CUDA only: write a memory snapshot for "
              "pytorch.org/memory_viz.")
def measure(batch, seq, device, steps, snapshot, **options) -> None:
    """Build MODEL for real (random weights), run training steps on a device and report each phase's peak:
    torch.cuda.max_memory_allocated()/max_memory_reserved() on CUDA, the allocator's own events on the CPU.

    \b
    Example: trainmem measure gpt2 --batch 2 --seq 256 --recipe fp32 --device cpu
    """
    from click.core import ParameterSource

    from .stepmodel import estimate_model
    from .measure import measure_steps, recipe_for_cpu, refuse_unmeasurable, resolve_device
    from .units import format_bytes

    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    ctx = click.get_current_context()
    given = {name for name in ctx.params if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)}
    ignored = [f"--{name.replace('_', '-')}" for name in MEASURE_IGNORES if name in given]
    if ignored:
        raise ConfigError(f"measure runs the step and compares allocated bytes: {', '.join(ignored)} only change "
                          "what estimate says fits a GPU (use trainmem estimate for that)")
    snapshot_path = None
    if snapshot is not None:
        from .outputs import check_output_file

        snapshot_path = check_output_file(snapshot, "--snapshot")
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not device.startswith("cuda"):
            raise ConfigError("--snapshot records the CUDA caching allocator's history: it needs --device cuda "
                              f"(here the device is {device})")
    w = _workload(options, batch, seq, need_config="measure")
    from .models import check_learned_positions

    check_learned_positions(w.spec, w.settings.seq, "measure")
    refuse_unmeasurable(w.finetune)
    for flag, on in (("--optimizer-in-backward", w.settings.optimizer_in_backward), ("--compile", w.settings.compile),
                     ("--offload-activations", w.settings.offload_activations)):
        if on:
            raise ConfigError(f"measure does not run {flag} yet (trace does)")
    _one_process(w, "measure")
    from .step import check_runnable

    check_runnable(w.settings, device)
    from .meta_count import check_transformers_config

    check_transformers_config(w.config, w.spec.source or w.spec.name)
    from rich.console import Console

    errors = Console(stderr=True, highlight=False, soft_wrap=True)  # progress on stderr: --json keeps stdout
    device = resolve_device(device)
    settings, changed = recipe_for_cpu(w.settings, device, "recipe" in given)
    if changed:
        errors.print(f"measure: {changed}")
    spec, unit, as_json = w.spec, w.unit, options["as_json"]
    config = w.config
    est = estimate_model(spec, settings, w.device, finetune=w.finetune)
    from .outputs import replacing

    def progress(step: int, total: int, seconds: float | None) -> None:
        if step == 0 and seconds is None:
            what = (f"building {spec.name} ({spec.num_parameters:,} parameters, random weights) on {device}, "
                    f"{settings.recipe}, batch {settings.batch} x seq {settings.seq:,} ...")
        elif step == 0:
            what = f"built in {seconds:.1f} s"
        else:
            what = f"step {step} of {total} ({'measured' if step == total else 'warm-up'}) " + (
                "..." if seconds is None else f"done in {seconds:.1f} s")
        errors.print(f"measure: {what}")

    try:
        with replacing(snapshot_path) if snapshot_path else contextlib.nullcontext() as temporary:
            result = measure_steps(config, settings, device, steps, temporary and str(temporary),
                                   finetune=w.finetune, progress=progress)
    except (RuntimeError, ValueError) as exc:  # device not available, out of memory, unsupported recipe
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"measure failed on {device}: {first[:300]}") from None
    estimated = {p.name: p.allocated_bytes for p in est.phases}
    if as_json:
        doc = result.as_dict()
        for row in doc["phases"]:
            row["estimate_allocated_bytes"] = estimated.get(row["name"])
        lora = {"finetune": w.finetune.as_dict(spec)} if w.finetune is not None else {}
        _emit_json({**_header("measure"), "model": _model_dict(spec), "settings": settings.as_dict(), **lora, **doc})
        return
    from rich.table import Table

    table = Table(title=f"{spec.name}: measured on {result.device} vs estimate ({unit})")
    for col in ("phase", "measured allocated", "measured reserved", "estimate", "error"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for p in result.phases:
        e = estimated.get(p.name)
        table.add_row(p.name, format_bytes(p.allocated_bytes, unit),
                      format_bytes(p.reserved_bytes, unit) if p.reserved_bytes is not None else "-",
                      format_bytes(e, unit) if e is not None else "",
                      f"{(e - p.allocated_bytes) / p.allocated_bytes:+.2%}" if e and p.allocated_bytes else "")
    console = _console()
    console.print(table)
    if snapshot and result.device == "cuda":
        console.print(f"snapshot written to {snapshot} (open it at pytorch.org/memory_viz)")


@app.command()
@click.option("--value", type=float, help="Show how this number is stored in each format.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def dtypes(value: Optional[float], as_json: bool) -> None:
    """Floating-point formats computed from their bit layouts: range, precision, bytes.

    \b
    Example: trainmem dtypes --value 1e-8
    """
    from .dtypes import FORMATS, describe

    rows = [{"format": f.name, "sign": 1, "exponent_bits": f.exponent_bits, "mantissa_bits": f.mantissa_bits,
             "max": f.max, "smallest_normal": f.smallest_normal, "smallest_subnormal": f.smallest_subnormal,
             "eps": f.eps, "decimal_digits": f.decimal_digits, "bytes": f.storage_bytes} for f in FORMATS.values()]
    stored = describe(value) if value is not None else None
    if as_json:
        _emit_json({**_header("dtypes"), "formats": rows, **({"value": value, "stored": stored} if stored else {})})
        return
    from rich.table import Table

    table = Table(title="Floating-point formats (computed from sign/exponent/mantissa bits)")
    for col in ("format", "s/e/m bits", "max", "smallest normal", "smallest subnormal", "eps", "digits", "bytes"):
        table.add_column(col, justify="left" if col == "format" else "right")
    for r in rows:
        table.add_row(r["format"], f"1/{r['exponent_bits']}/{r['mantissa_bits']}", f"{r['max']:.6g}",
                      f"{r['smallest_normal']:.4g}", f"{r['smallest_subnormal']:.4g}", f"{r['eps']:.4g}",
                      str(r["decimal_digits"]), str(r["bytes"]))
    console = _console()
    console.print(table)
    if stored:
        t = Table(title=f"{value!r} stored in each format")
        for col in ("format", "stored value", "relative error", "outcome"):
            t.add_column(col, justify="left" if col in ("format", "outcome") else "right")
        for r in stored:
            err = "" if r["relative_error"] is None else f"{r['relative_error']:.3e}"
            t.add_row(r["format"], f"{r['stored']:.10g}", err, r["outcome"])
        console.print(t)


def _runnable_config(config: dict, name: str, seq: int, build: bool = True) -> None:
    """A config precision-check can build and run at ``seq``: read by its parser (a model_type without one: checked
    as meta_count does), no longer than a learned position table, and (``build``) built by transformers on the meta
    device."""
    from .meta_count import check_buildable, check_transformers_config
    from .models import UnsupportedModelType, check_learned_positions, spec_from_config

    try:
        spec = spec_from_config(config, name=name, source=name)
    except UnsupportedModelType:
        spec = None
        check_buildable(config, name)
    if spec is not None:
        check_learned_positions(spec, seq, "precision-check")
    if build:
        check_transformers_config(config, name)


def _checked_model(config: dict, name: str, source: str, net) -> dict:
    """The model object of estimate's document for the (resized) model precision-check ran; a family without an
    analytic parser gets the counted parameters and what its config says."""
    from .errors import TrainmemError
    from .models import spec_from_config

    try:
        return _model_dict(spec_from_config(config, name=name, source=source))
    except TrainmemError:
        count = sum(p.numel() for p in net.parameters())
        return {"name": name, "model_type": str(config.get("model_type")), "source": source, "parameters": count,
                "active_parameters": count, "largest_layer_parameters": max(p.numel() for p in net.parameters()),
                "num_layers": config.get("num_hidden_layers"), "hidden_size": config.get("hidden_size"),
                "vocab_size": config.get("vocab_size"), "analytic": False}


@app.command(name="precision-check")
@click.argument("model")
@click.option("--layers", type=_Whole(10_000), help="Scale down to this many layers (default: the config's).")
@click.option("--hidden", type=_Whole(1 << 31), help="Scale down to this hidden size, keeping the head size.")
@click.option("--weights", type=click.Path(exists=True, dir_okay=False), help="A local .safetensors checkpoint.")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), help="A local text file (bytes as tokens).")
@click.option("--batch", type=_Whole(4096), default=4, show_default=True)
@click.option("--seq", type=_Whole(1 << 24), default=128, show_default=True)
@click.option("--steps", type=_Whole(10_000), default=3, show_default=True,
              help="Training steps; the last is analysed.")
@click.option("--lr", type=float, default=1e-4, show_default=True, help="AdamW learning rate for the updates.")
@click.option("--loss-scale", type=float, default=1024.0, show_default=True, help="The scale to evaluate.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write the gradient histogram as a PNG.")
@click.option("--hub", is_flag=True, help="Allow fetching a Hub model's config.json from the network.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def precision_check(model, layers, hidden, weights, data, batch, seq, steps, lr, loss_scale, plot, hub,
                    as_json) -> None:
    """Run real fp32 training steps of MODEL on the CPU and measure whether fp16 or bf16 would lose its gradients,
    activations or weight updates.

    \b
    Example: trainmem precision-check llama-2-7b --layers 2 --hidden 256
    """
    from .catalog import load_config
    from .outputs import check_output_file, replacing
    from .precision import check_arguments, check_resize, plot_gradients, precision_check as run_check, \
        resize_config, text_batches
    from .settings import make_settings

    for flag, v in (("--batch", batch), ("--seq", seq), ("--steps", steps), ("--layers", layers),
                    ("--hidden", hidden)):
        if v is not None and v <= 0:
            raise ConfigError(f"{flag} must be a positive integer, got {v}")
    check_arguments(steps=steps, lr=lr, loss_scale=loss_scale, batch=batch, flags=True)
    make_settings(seq=seq)  # (the sequence's bounds)
    plot_path = check_output_file(plot, "--plot", ".png") if plot is not None else None
    import os
    import stat

    for flag, path in (("--weights", weights), ("--data", data)):
        if path is not None:
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise ConfigError(f"{flag} {path!r} is not a regular file")
    config, name, source = load_config(model, hub)
    _runnable_config(config, name, seq, build=False)  # read before it is resized (no torch yet)
    check_resize(config, hidden, layers, name)
    config = resize_config(config, hidden, layers)
    _runnable_config(config, name, seq)  # the resized model, built on the meta device

    import torch

    from .probe import build_model
    from .recipes import get_recipe

    torch.manual_seed(0)
    net = build_model(config, get_recipe("fp32"), "sdpa", None)
    if weights:
        from safetensors.torch import load_file

        try:
            missing, unexpected = net.load_state_dict(load_file(weights), strict=False)
        except Exception as exc:  # noqa: BLE001 (safetensors' SafetensorError, a shape mismatch's RuntimeError)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise ConfigError(f"--weights {weights!r}: cannot load it into {name} ({first})") from None
        if unexpected:
            raise ConfigError(f"{weights}: {len(unexpected)} tensors do not belong to {name} "
                              f"(first: {unexpected[0]})")
    vocab = int(config.get("vocab_size"))
    try:
        batches = text_batches(torch, data, vocab, batch, seq, steps)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    from .progress import Progress

    with Progress(f"precision-check: fp32 steps of {name}", total=steps, as_json=as_json) as bar:
        report = run_check(net, batches, steps=steps, lr=lr, loss_scale=loss_scale, on_step=lambda _: bar.advance())
    raw, scaled = report.gradient_stats(torch), report.gradient_stats(torch, loss_scale)
    low, high = report.scale_range(torch)
    per_type = {k: {"gradients": report.gradient_stats(torch, 1.0, {k: d}),
                    "bf16_lost_updates": report.bf16_lost_updates(torch, {k: report.update_ratio[k]})
                    if k in report.update_ratio else None}
                for k, d in sorted(report.gradients.items())}
    verdict = report.verdict(torch)
    if plot_path is not None:
        with replacing(plot_path) as temporary:
            plot_gradients(torch, report, str(temporary))
    doc = {**_header("precision-check"), "model": _checked_model(config, name, source, net),
           "parameters": sum(p.numel() for p in net.parameters()),
           "losses": report.losses,
           "gradients": raw, "gradients_scaled": {"scale": loss_scale, **scaled},
           "loss_scale_range": {"smallest": low, "largest": high},
           "activations": {"max": report.max_activation(torch), "overflow_fp16": report.activation_overflow(torch)},
           "bf16_lost_updates": report.bf16_lost_updates(torch), "by_layer_type": per_type,
           "verdict": [{"recipe": r, "ok": ok, "why": why} for r, ok, why in verdict]}
    if as_json:
        _emit_json(doc)
        return
    from rich.table import Table

    console = _console()
    console.print(f"[bold]{name}[/bold]: {doc['parameters']:,} parameters, {steps} fp32 steps on the CPU, "
                  f"losses {', '.join(f'{x:.3f}' for x in report.losses)}")
    t = Table(title="Gradients in fp16, by layer type (fractions of all gradient values)")
    for col in ("layer type", "values", "zero in fp32", "flush to 0 (no scaling)", "subnormal", "max |g|",
                f"flush to 0 (scale {loss_scale:g})", "bf16 lost updates"):
        t.add_column(col, justify="left" if col == "layer type" else "right")
    for k, d in sorted(report.gradients.items()):
        g, gs = report.gradient_stats(torch, 1.0, {k: d}), report.gradient_stats(torch, loss_scale, {k: d})
        lost = per_type[k]["bf16_lost_updates"]
        t.add_row(k, f"{g['count']:,}", f"{g['zero_in_fp32']:.3%}", f"{g['underflow_to_zero']:.3%}",
                  f"{g['subnormal']:.3%}", f"{g['max']:.3g}", f"{gs['underflow_to_zero']:.3%}",
                  "" if lost is None else f"{lost:.2%}")
    t.add_row("all", f"{raw['count']:,}", f"{raw['zero_in_fp32']:.3%}", f"{raw['underflow_to_zero']:.3%}",
              f"{raw['subnormal']:.3%}", f"{raw['max']:.3g}", f"{scaled['underflow_to_zero']:.3%}",
              f"{doc['bf16_lost_updates']:.2%}", style="bold")
    console.print(t)
    console.print(f"loss scales from {low:g} (2^{math.log2(low):.0f}) keep {0.999:.1%} of non-zero gradients "
                  f"representable; up to {high:g} (2^{math.log2(high):.0f}) keep the largest finite. "
                  f"Largest activation {doc['activations']['max']:.4g} "
                  f"({doc['activations']['overflow_fp16']:.4%} above 65504).")
    v = Table(title="Verdict")
    v.add_column("recipe")
    v.add_column("usable", justify="center")
    v.add_column("why")
    for r, ok, why in verdict:
        v.add_row(r, "[green]yes[/green]" if ok else "[red]no[/red]", why)
    console.print(v)
    if plot:
        console.print(f"histogram written to {plot}")


@app.command(name="amp-demo")
@click.option("--steps", type=_Whole(100_000), default=200, show_default=True)
@click.option("--batch", type=_Whole(4096), default=8, show_default=True)
@click.option("--grad-scale-down", type=_Real(1e-12, 1e12), default=1.0, show_default=True,
              help="Shrink the gradients fp16 sees by this factor (e.g. 1e-6) to reproduce a deep model's regime.")
@click.option("--runs", default=",".join(("fp32", "fp16-autocast", "fp16-autocast+scaler", "bf16-autocast",
                                           "pure-bf16", "pure-bf16+master")), show_default=True)
@click.option("--plot", type=click.Path(dir_okay=False), help="Write the loss curves as a PNG.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def amp_demo(steps, batch, grad_scale_down, runs, plot, as_json) -> None:
    """Train a tiny GPT on a text shipped with trainmem under fp32, fp16 autocast (with and without GradScaler),
    bf16 autocast, pure bf16 and bf16 with fp32 master weights, on the CPU, and compare.

    \b
    Example: trainmem amp-demo --grad-scale-down 1e-6 --plot amp.png
    """
    from .amp_demo import RUNS, plot as plot_runs, run_all

    names = [r.strip() for r in runs.split(",") if r.strip()]
    if not names:
        raise ConfigError(f"--runs is empty; accepted: {', '.join(RUNS)}")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise ConfigError(f"unknown run {unknown[0]!r}; accepted: {', '.join(RUNS)}")
    if steps <= 0 or batch <= 0 or not grad_scale_down > 0:
        raise ConfigError("--steps, --batch and --grad-scale-down must be positive")
    if plot is not None:
        from .outputs import check_output_file, replacing

        plot_path = check_output_file(plot, "--plot", ".png")
    from .progress import Progress

    with Progress("amp-demo", total=steps * len(names), as_json=as_json) as bar:
        results, seconds = run_all(steps=steps, grad_scale_down=grad_scale_down, runs=names, batch=batch,
                                   on_step=lambda name, _: bar.advance(description=f"amp-demo: {name}"))
    reference = next((r for r in results if r.name == "fp32"), None)
    if plot is not None:
        with replacing(plot_path) as temporary:
            plot_runs(results, str(temporary))
    if as_json:
        _emit_json({**_header("amp-demo"), "steps": steps, "grad_scale_down": grad_scale_down,
                    "seconds": round(seconds, 1), "runs": [
            {"name": r.name, "losses": r.losses, "final_loss": r.final_loss, "zero_grad_fraction": r.zero_grad_fraction,
             "skipped_steps": r.skipped_steps,
             "gap_to_fp32": None if reference is None else r.final_loss - reference.final_loss} for r in results]})
        return
    from rich.table import Table

    marks = sorted({0, steps // 4, steps // 2, 3 * steps // 4, steps - 1})
    table = Table(title=f"Tiny GPT, {steps} steps, gradients fp16 sees x{grad_scale_down:g} "
                        f"({seconds:.0f} s on the CPU)")
    table.add_column("run")
    for m in marks:
        table.add_column(f"loss @{m}", justify="right")
    for col in ("final (last 10)", "gap to fp32", "zero gradients", "skipped steps"):
        table.add_column(col, justify="right")
    for r in results:
        gap = "" if reference is None else f"{r.final_loss - reference.final_loss:+.3f}"
        table.add_row(r.name, *(f"{r.losses[m]:.3f}" for m in marks), f"{r.final_loss:.3f}", gap,
                      f"{r.zero_grad_fraction:.2%}", str(r.skipped_steps))
    console = _console()
    console.print(table)
    if plot:
        console.print(f"loss curves written to {plot}")


@app.command()
@click.option("--quick", is_flag=True, help="The reduced matrix CI runs (two rows per model type).")
@click.option("--full-size", is_flag=True, help="The real configs up to 9B instead of scaled-down ones (112 rows, "
              "8-80 s each).")
@click.option("--random", "random_cases", type=_Whole(10_000), default=None,
              help="Instead of a matrix, N random models and set-ups (the differential test; every phase scored).")
@click.option("--seed", type=_Whole(2**64 - 1), default=None,
              help="Seed of --random (default 0): the same seed draws the "
              "same cases.")
@click.option("--lora", is_flag=True, help="The LoRA matrix: peft's adapters on the families whose LoRA step is "
              "modelled (with --quick: one row per family).")
@click.option("--compile", "compiled", is_flag=True, help="The --compile matrix: layers compiled with "
              "aot_eager_decomp_partition on the families whose compiled layers are modelled (with --quick: two rows "
              "per family).")
@click.option("--jobs", "-j", type=_Whole(1024), default=1, show_default=True,
              help="Rows traced in parallel processes.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default="docs/accuracy.md", show_default=True,
              help="Markdown report to write; its other sections (the other matrix, benchmark results) are kept.")
def validate(quick: bool, full_size: bool, random_cases: int | None, seed: int | None, lora: bool, compiled: bool,
             jobs: int, output: str) -> None:
    """Trace and estimate a matrix of model types x recipes x attention x checkpointing x dropout (or random
    models with --random) and write the comparison as Markdown. Exit code 1 when a row is outside its tolerance.

    \b
    Example: trainmem validate --quick -o /tmp/accuracy.md
             trainmem validate --random 200 --seed 7 --jobs 2
             trainmem validate --lora --jobs 2
             trainmem validate --compile --jobs 2
    """
    from .outputs import check_output_file, read_existing_text, write_text
    from .validate import COMPILE_HEADING, LORA_HEADING, RANDOM_HEADING, compile_section, lora_section, markdown, \
        random_section, replace_sections, validate as run_validate, validate_compile, validate_lora, validate_random

    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {jobs}")
    if (quick + full_size + (random_cases is not None) > 1 or lora + compiled > 1
            or (lora or compiled) and (full_size or random_cases is not None)):
        raise ConfigError("--quick, --full-size, --random, --lora and --compile are different runs: give one "
                          "(--lora and --compile take --quick)")
    if random_cases is not None and random_cases < 1:
        raise ConfigError(f"--random must be at least 1, got {random_cases}")
    if seed is not None and random_cases is None:
        raise ConfigError("--seed chooses the cases of --random; the matrices have no randomness: give --random N")
    seed = seed or 0
    output_path = check_output_file(output, "--output")
    existing = read_existing_text(output_path, "--output")
    console = _console()

    def show_row(r) -> None:
        bar.advance()
        verdict = "ok" if r.within_tolerance else "OUT OF TOLERANCE (worst phase %s %+.2f%%)" % (
            r.worst_phase[0], 100 * r.worst_phase[1])
        bar.print(console, f"{r.family:12s} {r.recipe:20s} {r.attention:5s} ckpt={r.checkpointing:4s} "
                  f"dropout={r.dropout} {r.batch}x{r.seq:<4d} {r.phase:9s} total {r.total_error:+.2%} {verdict}")

    from .progress import Progress
    from .validate import compile_matrix, lora_matrix, matrix

    rows_to_run = (random_cases if random_cases is not None else len(list(
        lora_matrix(quick) if lora else compile_matrix(quick) if compiled else matrix(quick, full_size))))
    with Progress("validate: rows traced", total=rows_to_run) as bar:
        if lora or compiled:
            run, section, heading = ((validate_lora, lora_section, LORA_HEADING) if lora
                                     else (validate_compile, compile_section, COMPILE_HEADING))
            rows = run(quick=quick, progress=show_row, jobs=jobs)
            text = replace_sections(existing, {heading: section(rows, quick)})
            bad = sum(not r.within_tolerance for r in rows)
            total = len(rows)
        elif random_cases is not None:
            def show(r) -> None:
                bar.advance()
                if r.ok:
                    phase, error = r.row.worst_phase
                    bar.print(console, f"case {r.index:<4d} {r.config['model_type']:12s} worst phase {phase} "
                                  f"{error:+.2%} ok")
                else:
                    bar.print(console, r.describe(), markup=False, highlight=False)

            results = validate_random(random_cases, seed, jobs, progress=show)
            text = replace_sections(existing, {RANDOM_HEADING: random_section(results, seed)})
            bad = sum(not r.ok for r in results)
            total = len(results)
        else:
            rows = run_validate(quick=quick, full_size=full_size, jobs=jobs, progress=show_row)
            text = markdown(rows, full_size=full_size, quick=quick, existing=existing)
            bad = sum(not r.within_tolerance for r in rows)
            total = len(rows)
    write_text(output_path, text)  # (a temporary file renamed: an interrupted run never leaves half a report)
    console.print(f"wrote {output}: {total - bad} of {total} within tolerance")
    if bad:
        raise click.exceptions.Exit(1)


@app.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def models(as_json: bool) -> None:
    """List the built-in catalog with exact parameter counts.

    \b
    Example: trainmem models
    """
    from .report import models_document, render_models

    document = models_document()
    if as_json:
        _emit_json(document)
    else:
        render_models([tuple(m.values()) for m in document["models"]], _console())


@app.command()
@click.option("--optimizer", help="Show one optimizer only.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def recipes(optimizer: Optional[str], as_json: bool) -> None:
    """Bytes per parameter of each component for every recipe and optimizer.

    \b
    Example: trainmem recipes --optimizer adamw
    """
    from .recipes_table import recipes_document, render_recipes

    document = recipes_document(optimizer)
    if as_json:
        _emit_json(document)
    else:
        render_recipes(document["recipes"], _console())


@app.command()
@click.argument("model")
@click.option("--gpu", required=True, help="GPU type (trainmem estimate --help lists them).")
@click.option("--gpus", type=int, default=None, help="How many GPUs (default: --nodes x --gpus-per-node, or 8).")
@click.option("--nodes", type=int, default=None, help="Nodes; with --gpus-per-node gives --gpus.")
@click.option("--gpus-per-node", type=int, default=8, show_default=True, help="GPUs per node.")
@click.option("--seq", type=int, default=2048, show_default=True, help="Sequence length in tokens.")
@click.option("--global-batch", type=int, default=None, help="Sequences per optimizer step (default: one per GPU).")
@click.option("--recipe", default=None, help="Search only this recipe (default: mixed-bf16, amp-bf16 and "
              "pure-bf16-bf16states, as the engines write them).")
@click.option("--checkpointing", default=None, help="Search only none or full (default: both; selective is no "
              "engine's setting).")
@click.option("--mfu", type=float, default=None, help="Fraction of peak FLOPS the time model assumes (default 0.4).")
@click.option("--inter-node-gbps", type=float, default=None, help="Node-to-node GB/s per GPU (default 50).")
@click.option("--host-memory-gib", type=float, default=None, help="Host memory per node for offload (default 2048).")
@click.option("--min-gpus", is_flag=True, help="Answer the fewest GPUs of this type that can train the model at all.")
@click.option("--time-budget", type=float, default=None,
              help="Stop the search after this many seconds and show what it found (the answer says so).")
@click.option("--top", type=click.IntRange(1, 1000), default=10, show_default=True, help="Layouts to show.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Write the best layout's files into this "
              "folder: ds_config.json (ZeRO), accelerate.yaml (DeepSpeed, FSDP2, DDP), torchtitan.json with "
              "torchtitan_plan.py (torchtitan 0.3.0), and launch.sh.")
@click.option("--units", default=DEFAULT_UNIT, show_default=True, help="GiB, GB, MiB, ...")
@click.option("--hub", is_flag=True, help="Allow fetching a config from the Hugging Face Hub.")
@click.option("--lora", type=_Whole(65536), default=None, help="Search LoRA adapters of this rank on a frozen base "
              "(data parallelism: DDP, ZeRO 1-3, FSDP2).")
@click.option("--lora-targets", default="q,v", show_default=True, help="Linears with adapters (as estimate takes).")
@click.option("--dora", is_flag=True, help="DoRA adapters (peft's use_dora).")
@click.option("--qlora", is_flag=True, help="QLoRA's base: nf4 with double quantization.")
@click.option("--json", "as_json", is_flag=True, help="Print the versioned JSON document (bytes as integers).")
def plan(model, gpu, gpus, nodes, gpus_per_node, seq, global_batch, recipe, checkpointing, mfu, inter_node_gbps,
         host_memory_gib, min_gpus, time_budget, top, out_dir, units, hub, lora, lora_targets, dora, qlora,
         as_json) -> None:
    """Search the layouts of MODEL on GPU that fit and rank them by a stated time model: data parallelism (DDP,
    ZeRO 1-3, FSDP2 full / grad-op / hybrid) x recipe x checkpointing x offload x micro-batch, with tensor (and
    sequence), pipeline, context (from 16k tokens) and expert parallelism; only layouts some engine's files run as
    planned are offered (--out writes them). What is not searched is listed in the answer.

    \b
    Example: trainmem plan llama-3-70b --gpu H100-80GB --gpus 8 --seq 4096 --global-batch 64
             trainmem plan llama-3-8b --gpu A100-80GB --nodes 2 --global-batch 256 --out plan/
             trainmem plan llama-3.1-405b --gpu H100-80GB --seq 4096 --min-gpus
    """
    from .plan import run_plan
    from .report import plan_document, render_plan

    unit = parse_unit(units)
    if min_gpus and out_dir is not None:
        raise ConfigError("--min-gpus answers a GPU count (one sequence per GPU): it takes no --global-batch or --out")
    if lora is not None and out_dir is not None:
        raise ConfigError("--out writes full fine-tuning's engine files; with --lora plan answers the layouts only")
    if lora is None and (dora or qlora):
        raise ConfigError("--dora and --qlora need --lora RANK")
    if out_dir is not None:  # (checked before the search; '' is refused, not taken as "no --out")
        from .outputs import check_output_dir

        out_dir = check_output_dir(out_dir, "--out")
    options = {key: value for key, value in (("mfu", mfu), ("inter_node_gbps", inter_node_gbps),
                                             ("host_memory_gib", host_memory_gib)) if value is not None}
    if lora is not None:
        options["lora"] = dict(lora=lora, lora_targets=lora_targets, dora=dora, qlora=qlora)
    from .progress import Progress

    with Progress(f"searching the fewest {gpu} for {model}", as_json=as_json or not min_gpus):
        found, answer = run_plan(model, gpu, gpus, seq, global_batch, gpus_per_node, nodes, recipe, checkpointing,
                                 min_gpus, hub, time_budget_s=time_budget, **options)
    if out_dir:
        if not found.plans:
            raise ConfigError("nothing fits, so --out has no layout to write")
        from .engine_configs import write_configs

        written = write_configs(found.plans[0].layout, seq, found.model.name, out_dir)
    if as_json:
        _emit_json(plan_document(found, top, answer))
    else:
        console = _console()
        if answer is not None:
            console.print(f"[bold]the fewest {found.gpu.name} that train {found.model.name} at {seq:,} tokens: "
                          f"{answer:,}[/bold] (the layouts below)")
        render_plan(found, top, unit, console, answer)
        if out_dir:
            console.print("wrote " + ", ".join(str(p) for p in written))
    if not found.plans:
        raise click.exceptions.Exit(1)


@app.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="Port to listen on.")
def serve(host: str, port: int) -> None:
    """Serve the web calculator and its API (/docs) on HOST:PORT until interrupted (needs the web extra).

    \b
    Example: trainmem serve              # then open http://127.0.0.1:8000
    """
    from .web import serve as run

    _console().print(f"trainmem: http://{host}:{port} (API documentation: /docs); Ctrl-C stops")
    run(host, port)


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
        extra = OPTIONAL_PACKAGES.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"trainmem: error: this command needs {exc.name.split('.')[0]}, which is not installed; "
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
