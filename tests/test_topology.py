"""Topology validation: bad layouts fail before any process group exists, naming the rule."""

import subprocess
import sys

import pytest

from megarl.distributed import ParallelConfig, Topology, TopologyError

MODEL = dict(num_layers=8, num_attention_heads=16, num_query_groups=8)


def _create(world, model=MODEL, **parallel):
    return Topology.create(ParallelConfig(**parallel), world, **model)


@pytest.mark.parametrize(
    "world,parallel,model,expected",
    [
        (
            6,
            dict(tensor_parallel=4),
            MODEL,
            "world size 6 is not divisible by TP x PP x CP = 4 x 1 x 1",
        ),
        (6, dict(tensor_parallel=3), MODEL, "num_attention_heads=16 is not divisible by TP=3"),
        (
            12,
            dict(tensor_parallel=3),
            dict(num_layers=8, num_attention_heads=24, num_query_groups=8),
            "num_query_groups=8 (KV heads) is not divisible by TP=3",
        ),
        (
            2,
            dict(sequence_parallel=True),
            MODEL,
            "sequence_parallel=True requires tensor_parallel > 1",
        ),
        (
            4,
            dict(pipeline_parallel=3),
            MODEL,
            "world size 4 is not divisible by TP x PP x CP = 1 x 3 x 1",
        ),
        (3, dict(pipeline_parallel=3), MODEL, "num_layers=8 is not divisible by PP x VPP = 3 x 1"),
        (
            4,
            dict(pipeline_parallel=2, virtual_pipeline_parallel=3),
            MODEL,
            "num_layers=8 is not divisible by PP x VPP = 2 x 3 = 6",
        ),
        (2, dict(virtual_pipeline_parallel=2), MODEL, "requires pipeline_parallel > 1"),
        (
            4,
            dict(pipeline_parallel=2, pipeline_layers=(3, 4)),
            MODEL,
            "pipeline_layers=[3, 4] must have PP=2 entries summing to num_layers=8",
        ),
        (4, dict(expert_parallel=2), MODEL, "needs a MoE model"),
        (
            4,
            dict(expert_parallel=4),
            {**MODEL, "num_experts": 6},
            "num_experts=6 is not divisible by expert_parallel=4",
        ),
        (
            4,
            dict(tensor_parallel=2, expert_parallel=4),
            {**MODEL, "num_experts": 8},
            "ETP x EP = 2 x 4 = 8 must divide TP x CP x DP = 2 x 1 x 2 = 4",
        ),
        (
            2,
            dict(tensor_parallel=2, sequence_parallel=True, expert_tensor_parallel=1),
            {**MODEL, "num_experts": 4},
            "expert_tensor_parallel=1 != tensor_parallel=2 needs expert_parallel > 1",
        ),
        (4, dict(tensor_parallel=0), MODEL, "parallel.tensor_parallel=0 must be >= 1"),
    ],
)
def test_bad_layouts_are_rejected_with_the_arithmetic(world, parallel, model, expected):
    with pytest.raises(TopologyError) as e:
        _create(world, model, **parallel)
    assert expected in str(e.value)


def test_good_layouts_derive_dp():
    assert _create(8, tensor_parallel=2, pipeline_parallel=2).dp == 2
    assert _create(16, tensor_parallel=2, pipeline_parallel=2, virtual_pipeline_parallel=2).dp == 4
    assert _create(4, {**MODEL, "num_experts": 4}, expert_parallel=4).dp == 4
    assert _create(4, pipeline_parallel=2, pipeline_layers=(3, 5)).dp == 2


def test_import_needs_no_vllm_te_or_gpu():
    """`import megarl` (and the config/model-description layers) must not import vLLM or TE."""
    code = (
        "import sys, megarl, megarl.models.hf_config, megarl.distributed, megarl.advantage;"
        "bad = [m for m in ('vllm', 'transformer_engine') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_training_a_moe_model_at_tp2_needs_sequence_parallel():
    from megarl.models.hf_config import arch_from_hf
    from tests.tiny import TINY_QWEN3_MOE

    arch = arch_from_hf(TINY_QWEN3_MOE)
    topo = Topology.for_model(ParallelConfig(tensor_parallel=2), 2, arch)  # inference: fine
    with pytest.raises(TopologyError, match="tensor_parallel=2 with a MoE model") as e:
        topo.check_training(arch)
    assert "needs sequence_parallel=true to train" in str(e.value)
    sp = ParallelConfig(tensor_parallel=2, sequence_parallel=True)
    Topology.for_model(sp, 2, arch).check_training(arch)
