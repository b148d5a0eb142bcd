"""`megarl plan`: memory and layout of a run, checked before the job is queued."""

from megarl.plan.memory import plan
from megarl.plan.records import Plan
from megarl.plan.render import describe

__all__ = ["Plan", "describe", "plan"]
