"""megarl: Megatron-core RL trainer (PPO, GRPO) with colocated vLLM rollouts."""

__version__ = "0.1.0"
