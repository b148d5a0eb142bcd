"""vLLM in this process: start (`engine.RolloutEngine`, the checks made first: `checks`),
generate from token ids in a batch or continuously (`sampling`: each request's parameters and
seeds), sleep / wake, and the weights (`weights.EngineWeights`: the state and the only ways to
write them; `cpu_repack`, `vllm_lora`). `pieces`, `vllm_layout` and `moe_layout` describe where
each HF tensor lands in vLLM's parameters; `routes` captures the experts each token was routed
to; every patch of vLLM is in `vllm_patches`. Knows no placement and no other component's
settings.
"""
