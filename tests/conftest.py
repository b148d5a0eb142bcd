"""Suite-wide settings."""

import os

# `megarl.distributed.launch.spawn` forks the suite's distributed jobs from one server that
# imported torch and megatron-core once (~5 s of CPU saved per launch); tests that measure a
# child's memory pass start_method="spawn"
os.environ.setdefault("MEGARL_SPAWN_METHOD", "forkserver")
