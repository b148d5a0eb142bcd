"""Agents written against the `openai` client as the environment of their trajectories: the
OpenAI-compatible endpoint (`endpoint`, serving any `Session`) and the agent's trajectory and
session (`agent`), built on `megarl.rollout.multi_turn`.
"""
