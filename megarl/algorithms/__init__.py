"""RL math: advantage estimators, KL estimators, policy/value losses (pure tensor functions)."""
