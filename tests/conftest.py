"""Suite-wide settings."""

import os

# `megarl.distributed.launch.spawn` forks the suite's distributed jobs from one server that
# imported torch and megatron-core once (~5 s of CPU saved per launch); tests that measure a
# child's memory pass start_method="spawn"
os.environ.setdefault("MEGARL_SPAWN_METHOD", "forkserver")

# vLLM's sampler compiles one small helper (the rank of each sampled token among the logprobs,
# `batched_count_greater_than`) with inductor at the first generate of every engine: 2-3 s per
# process, and the suite starts engines in about a hundred processes. Here it runs eagerly (the
# same integers; megatron-core compiles nothing on these paths, checked with dynamo's frame
# counter); tests/test_real_model.py and the CI's wheel check run it compiled, as a user's
# run does
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
