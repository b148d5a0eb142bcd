"""`megarl plan`: memory and layout of a run, checked before the job is queued."""

from megarl.plan.memory import Plan, plan

__all__ = ["Plan", "plan"]
