"""trainmem's per-GPU model states against DeepSpeed's own estimators, for the table in docs/accuracy.md.

DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and ``estimate_zero3_model_states_mem_needs``
(deepspeed/runtime/zero/stage_1_and_2.py, stage3.py) count model states only: no activations, no buffers. trainmem's
figure here is the largest of its optimizer-phase and backward-phase model states plus the engine's buffers (its
activations left out, to compare like with like). Needs deepspeed importable (a CPU install works:
``pip install --no-deps deepspeed`` and its small dependencies); prints a markdown table.

Run: python benchmarks/deepspeed_estimators.py
"""

from trainmem.catalog import catalog_spec
from trainmem.stepmodel import estimate_model
from trainmem.settings import make_settings
from trainmem.sharding import Parallel

CASES = [("llama-2-7b", 8, 1), ("llama-3-70b", 64, 8), ("mixtral-8x7b", 16, 2)]
GB = 1e9


def _largest_module(spec) -> int:
    """DeepSpeed's largest_layer_params: the largest single module's own parameters (an embedding or a Linear)."""
    return max(t.numel for g in spec.param_groups for t in g.tensors)


def main() -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    print("| model | GPUs | ZeRO | offload | DeepSpeed GPU (GB) | trainmem states at step (GB) | trainmem + buffers (GB) "
          "| DeepSpeed CPU per node (GB) | trainmem host per node (GB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, gpus, nodes in CASES:
        spec = catalog_spec(name)
        p = spec.num_parameters
        for stage in (2, 3):
            for offload in ("none", "optimizer") + (("optimizer+params",) if stage == 3 else ()):
                if stage == 2:
                    cpu, gpu = estimate_zero2_model_states_mem_needs(p, gpus // nodes, nodes, offload != "none")
                else:
                    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                        p, _largest_module(spec), gpus // nodes, nodes, offload != "none",
                        offload == "optimizer+params")
                est = estimate_model(spec, make_settings(recipe="mixed-bf16"),
                                     parallel=Parallel(gpus=gpus, gpus_per_node=gpus // nodes, zero=stage,
                                                       offload=offload))
                states = est.static_bytes
                step = states + sum(b.bytes for b in est.rank.buffers if "optimizer" in b.phases)
                backward = states + sum(b.bytes for b in est.rank.buffers
                                        if any(ph.startswith("backward") for ph in b.phases))
                host = est.rank.host_bytes_per_rank * (gpus // nodes)
                print(f"| {name} | {gpus} | {stage} | {offload} | {gpu / GB:.2f} | {step / GB:.2f} | "
                      f"{max(step, backward) / GB:.2f} | {cpu / GB:.1f} | {host / GB:.1f} |")


if __name__ == "__main__":
    main()
