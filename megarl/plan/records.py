"""What a memory plan is (`megarl plan`): per pipeline stage, the bytes one GPU holds in each
phase (`StagePlan`, `Row`), the model's shape they are computed from (`Shape`) and the verdict
(`Plan`). Built by `megarl.plan.memory`, printed by `megarl.plan.render`."""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config import RunConfig
from megarl.plan.formulas import PHASES

ALL = PHASES
HEADROOM = 0.95
"""The share of a GPU's memory a plan may use."""


@dataclass(frozen=True)
class Row:
    name: str
    nbytes: float
    formula: str
    phases: tuple[str, ...] = ALL


@dataclass(frozen=True)
class StagePlan:
    """What one GPU of pipeline stage `pp_rank` holds."""

    pp_rank: int
    rank: int
    layers: int
    rows: tuple[Row, ...]

    def peak(self, phase: str) -> float:
        return sum(r.nbytes for r in self.rows if phase in r.phases)

    @property
    def worst(self) -> tuple[str, float]:
        return max(((p, self.peak(p)) for p in PHASES), key=lambda x: x[1])


@dataclass(frozen=True)
class Shape:
    """Parameters on the first rank of each pipeline stage, from the meta-device build."""

    params: tuple[int, ...]
    """The model's own parameters (LoRA: the frozen base, without the adapters)."""
    expert_params: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]  # layers per model chunk, per stage
    critic: tuple[int, ...] | None
    padded_vocab: int
    critic_trained: tuple[int, ...] | None = None
    """The critic's parameters with grads and Adam state (`model.critic_lora`: adapters and
    value head; None: all of `critic`)."""
    adapters: tuple[int, ...] = ()
    """LoRA adapter parameters per stage (empty without LoRA)."""
    adapted: tuple[int, ...] = ()
    """LoRA: elements of the adapted base weights per stage (the sync's merged copies)."""
    largest_adapted: tuple[int, ...] = ()
    """LoRA: elements of the largest adapted weight per stage."""
    teacher: tuple[int, ...] | None = None
    """The distillation teacher's parameters per stage (frozen); None without one."""
    teacher_arch: object | None = None
    """The teacher's `ModelArch` (its logprob pass's size); None without one."""


@dataclass(frozen=True)
class Plan:
    config_path: str | None
    gpus: int
    gpu_mem: float
    nodes: int
    device: str
    cfg: RunConfig
    topo: object | None
    arch: object
    stages: tuple[StagePlan, ...] = ()
    problems: tuple[str, ...] = ()
    """Why this config cannot run on this cluster at all, each prefixed by what it is about
    ("layout: " errors; "LoRA: " adapters on layers that refuse them)."""
    warnings: tuple[str, ...] = ()
    advice: tuple[str, ...] = field(default=())

    @property
    def usable(self) -> float:
        return HEADROOM * self.gpu_mem

    @property
    def fits(self) -> bool:
        return not self.problems and all(s.worst[1] <= self.usable for s in self.stages)
