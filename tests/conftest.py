"""Suite-wide settings."""

import os

# `megarl.distributed.launch.spawn` forks the suite's distributed jobs from one server that
# imported torch and megatron-core once (~5 s of CPU saved per launch); tests that measure a
# child's memory pass start_method="spawn"
os.environ.setdefault("MEGARL_SPAWN_METHOD", "forkserver")

# torch.compile off in the suite's processes: megarl itself runs vLLM's compiled integer helpers
# eagerly on CPU (tests/test_vllm_eager_helpers.py checks it with dynamo on), and this keeps
# megatron-core's compiled element-wise functions (`jit_fuser`: MoE expert bias, gated attention
# / DeltaNet outputs) from an inductor build of seconds in each process that reaches them;
# tests/test_real_model.py and tests/test_quickstart.py run with dynamo on, as a user's run does
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
