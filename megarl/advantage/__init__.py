"""`from megarl.advantage import GRPOAdvantage, RLOOAdvantage` (the Twinkle-style Advantage API).

Re-exports `megarl.algorithms.advantages` and the distributed stage; see those modules.
"""

from megarl.algorithms.advantages import (
    SCALES,
    Advantage,
    DrGRPOAdvantage,
    GAEOptions,
    GRPOAdvantage,
    ReinforcePlusPlusAdvantage,
    RLOOAdvantage,
    available_advantages,
    compute_gae,
    get_advantage,
    register_advantage,
    whiten,
)
from megarl.algorithms.distributed_advantage import (
    distributed_whiten,
    gae_advantages,
    gather_advantages,
)

__all__ = [
    "SCALES",
    "Advantage",
    "DrGRPOAdvantage",
    "GAEOptions",
    "GRPOAdvantage",
    "RLOOAdvantage",
    "ReinforcePlusPlusAdvantage",
    "available_advantages",
    "compute_gae",
    "distributed_whiten",
    "gae_advantages",
    "gather_advantages",
    "get_advantage",
    "register_advantage",
    "whiten",
]
