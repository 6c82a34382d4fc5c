"""Uneven pipeline splits (--pp-layers): explicit layers per stage, and torchtitan's split
(torchtitan/distributed/pipeline_parallel.py, generate_llm_fqn_per_model_part, input_weight = output_weight = 1)."""

import json

import pytest

from trainmem.catalog import catalog_spec
from trainmem.modelparallel import pipeline_split, stage_spec
from trainmem.sharding import Parallel


def torchtitan_split(layers: int, stages: int) -> list[int]:
    """torchtitan's loop, written out: L + 2 effective layers, the remainder to the first stages, the embedding and
    the output taking one layer's place on the first and the last."""
    each, extra = divmod(layers + 2, stages)
    out, left = [], layers
    for s in range(stages):
        n = each + (1 if s < extra else 0) - (1 if s in (0, stages - 1) else 0)
        n = min(n, left) if s < stages - 1 else left
        out.append(n)
        left -= n
    return out


@pytest.mark.parametrize("layers, stages", [(126, 8), (32, 4), (80, 8), (61, 4), (28, 3), (30, 16)])
def test_torchtitans_split(layers, stages):
    assert list(pipeline_split(layers, stages, "torchtitan")) == torchtitan_split(layers, stages)


def test_llama_405b_over_8_stages_is_15_16_15():
    assert pipeline_split(126, 8, "torchtitan") == (15, 16, 16, 16, 16, 16, 16, 15)


def test_each_stage_holds_its_layers_with_the_embedding_first_and_the_head_last():
    spec = catalog_spec("llama-3.1-405b")
    split = pipeline_split(126, 8, "torchtitan")
    parallel = Parallel(gpus=8, pp=8, pp_layers=split)
    layer = next(g.numel_each for g in spec.param_groups if g.is_layer)
    embedding = spec.vocab_size * spec.hidden_size
    stages = [stage_spec(spec, parallel, s) for s in range(8)]
    assert [s.num_layers for s in stages] == list(split)
    assert stages[0].num_parameters == embedding + 15 * layer
    assert stages[3].num_parameters == 16 * layer
    assert stages[7].num_parameters == 15 * layer + embedding + spec.hidden_size  # LM head and final norm


def test_an_even_split_given_explicitly_is_the_default_split(run_cli):
    args = ("estimate", "llama-3-70b", "--gpus", "16", "--tp", "2", "--pp", "8", "--json")
    default = json.loads(run_cli(*args)[1])
    given = json.loads(run_cli(*args, "--pp-layers", ",".join(["10"] * 8))[1])
    assert given["peak"] == default["peak"] and given["parallel"]["pp_layers"] == [10] * 8


@pytest.mark.parametrize("args, says", [
    (("--gpus", "8", "--pp", "8", "--pp-layers", "16,16"), "each of the 8 stages"),
    (("--gpus", "8", "--pp", "8", "--pp-layers", "16,16,16,16,16,16,16,16"), "adds up to 128 layers"),
    (("--pp-layers", "63,63"), "give --pp 2 or more"),
    (("--gpus", "8", "--pp", "8", "--pp-layers", "a,b"), "such as 15,16,16,15"),
    (("--gpus", "8", "--pp", "8", "--pp-layers", "0,16,16,16,16,16,16,30"), "each 1 or more"),
    (("--gpus", "8", "--pp", "8"), "or give --pp-layers"),
])
def test_bad_splits_get_one_line(run_cli, args, says):
    code, _, err = run_cli("estimate", "llama-3.1-405b", *args)
    assert code == 2 and says in err and err.count("\n") == 1, err
