"""The `algorithm` section: which stage runs (RL: grpo, ppo; offline: sft, dpo, rm) and the
knobs of its advantages, losses, KL and batching. Names are checked against the registries of
`megarl.algorithms` (advantages, policy losses, preference losses).

The YAML keys are flat (`algorithm.clip_low`, ...); the math takes them grouped per family,
built here: `policy_loss_options`, `value_loss_options`, `kl_options`, `gae_options`,
`preference_options` (frozen dataclasses defined next to the functions that read them).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.algorithms.advantages import GAEOptions, available_advantages
from megarl.algorithms.kl import KL_PLACEMENT, KLOptions
from megarl.algorithms.losses import (
    AGG_MODES,
    PolicyLossOptions,
    ValueLossOptions,
    available_policy_losses,
)
from megarl.algorithms.off_policy import OFF_POLICY_CORRECTIONS, OffPolicyOptions
from megarl.algorithms.preference import (
    PreferenceOptions,
    available_preference_losses,
    get_preference_loss,
)
from megarl.errors import ConfigError

ALGORITHMS = ("grpo", "ppo", "distill", "sft", "dpo", "rm")
RL_ALGORITHMS = ("grpo", "ppo", "distill")
OFFLINE_ALGORITHMS = ("sft", "dpo", "rm")
"""Trained on a fixed dataset by `megarl.trainer.offline`: no rollout engine, no rewards."""
MAX_ROUNDS = 1024
"""Most rounds of dynamic sampling per step (`megarl.trainer.seeds.round_seed` spaces them)."""


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    name: str = "grpo"
    """grpo (no critic; group-relative advantages), ppo (critic + GAE), distill (on-policy
    distillation: each sampled token's advantage is the teacher's logprob of it less the
    student's, from teacher.model; no reward needed), or an offline stage on
    a fixed dataset: sft (supervised fine-tuning), dpo (preference pairs; variants in
    algorithm.dpo_loss) or rm (a reward model from preference pairs, Bradley-Terry)."""
    advantage: str = "grpo"
    """Advantage estimator for grpo-style runs: grpo, rloo, dr_grpo, reinforce++."""
    scale: str = "group"
    """Advantage scaling: group, batch or none (see megarl.advantage)."""
    policy_loss: str = "ppo"
    """A registered policy loss (megarl.algorithms.losses): ppo (token-level ratio), gspo
    (sequence-level ratio) or cispo (MiniMax-M1: the clipped importance weight, detached, on
    every token's logprob gradient)."""
    clip_low: float = 0.2
    """PPO clip range below 1 (ratio >= 1 - clip_low); ppo and gspo."""
    clip_high: float = 0.2
    """PPO clip range above 1; > clip_low is DAPO's clip-higher; ppo and gspo."""
    dual_clip: float | None = None
    """Dual-clip constant c (> 1) for negative advantages; null = off; ppo and gspo."""
    cispo_clip_low: float = 1.0
    """Lower bound of CISPO's importance weight: 1 - cispo_clip_low (0 to 1); the default 1
    sets none, as MiniMax-M1 does. policy_loss=cispo only."""
    cispo_clip_high: float = 4.0
    """Upper bound of CISPO's importance weight: 1 + cispo_clip_high (> 0); the default caps
    it at 5. policy_loss=cispo only."""
    agg_mode: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean or
    seq-mean-token-sum-norm (see megarl.algorithms.losses)."""
    kl_coef: float = 0.0
    """KL-to-reference coefficient; 0 disables the reference model."""
    kl_kind: str = "k3"
    """KL estimator: k1, k2, k3, abs."""
    kl_in: str = "loss"
    """Where the KL goes: loss (a loss term) or reward (a per-token reward penalty)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (the entropy of softmax(logits / rollout.sampling.temperature))."""
    off_policy_correction: str = "none"
    """Importance weights against the sampler's (vLLM's) logprobs: none, tis (truncated),
    icepop (two-sided token mask), mis (sequence-level masked) or decoupled (decoupled PPO's
    behaviour weight); formulas in megarl.algorithms.off_policy."""
    is_low: float = 0.5
    """Lower bound of icepop's band of token ratios (0 <= is_low < 1)."""
    is_high: float = 2.0
    """The importance-weight cap (> 1): tis truncates at it, icepop / mis / decoupled drop
    tokens (mis: sequences) above it."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per epoch: the rollout batch is split into this many mini-batches, drawn
    over the global batch (the same samples at any DP size: docs/algorithms.md)."""
    micro_batch_size: int = 8
    """Most sequences per forward/backward micro-batch (gradient accumulation inside a
    mini-batch). Sequences are grouped by length, longest first; the two sequences of a
    preference pair always share a micro-batch."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of a micro-batch: unpacked, close a micro-batch before its padded size
    (sequences x longest) would exceed it; packed, its real tokens. null = no budget beyond
    micro_batch_size (packed: micro_batch_size x the step's longest sequence). Changes no loss
    or gradient, only the grouping."""
    pack_sequences: bool = True
    """Pack each micro-batch's sequences into one row (first-fit decreasing under the token
    budget; attention kept within each sequence), so no forward or backward pass multiplies
    padding. Same logprobs and gradients as unpacked (docs/algorithms.md#sequence-packing);
    `train/pad_share` logs the padding left."""
    balance_dp_tokens: bool = False
    """Re-deal each step's samples over the DP ranks after scoring so every rank holds the same
    number of samples and near-equal tokens (`megarl.trainer.balance`); no effect at DP 1."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (grpo only): drop the groups whose samples all got the same
    reward (their group-relative advantage is zero: no gradient, only cost) and generate further
    rounds of data.prompts_per_step prompts until that many groups with a reward spread are kept
    (`megarl.trainer.dynamic_sampling`)."""
    dynamic_sampling_max_rounds: int = 8
    """Most rounds of generation per step with dynamic_sampling (1 to 1024); a step that still
    has fewer than data.prompts_per_step kept groups trains on those and logs a warning."""
    distill_coef: float = 0.0
    """grpo / ppo: weight of the on-policy distillation term (teacher logprob - student logprob
    per sampled token, from teacher.model) added to each token's advantage; 0 = off. With
    name=distill the advantage is that term alone."""
    distill_clip: float | None = None
    """Bound c on the distillation term: clipped to [-c, c] per token (> 0); null = unclipped."""
    gamma: float = 1.0
    """PPO discount."""
    lam: float = 0.95
    """PPO GAE lambda."""
    value_clip: float | None = 0.2
    """PPO value-loss clip; null = off."""
    value_coef: float = 1.0
    """Weight of the critic's loss (the critic has its own optimizer)."""
    dpo_loss: str = "sigmoid"
    """Preference loss of algorithm.name=dpo: sigmoid (DPO), ipo, hinge (SLiC), or simpo
    (reference-free, length-normalised); formulas in megarl.algorithms.preference."""
    dpo_beta: float = 0.1
    """DPO's beta: the strength of the implicit KL to the reference (SimPO: the reward scale)."""
    dpo_label_smoothing: float = 0.0
    """cDPO: the assumed fraction of flipped preference labels, 0 <= eps < 0.5 (sigmoid and
    simpo only)."""
    dpo_length_norm: bool = False
    """Compare mean token logprobs of the responses instead of their sums (always on for
    simpo)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (dpo_loss=simpo)."""

    def __post_init__(self):
        if self.name not in ALGORITHMS:
            raise ConfigError(f"algorithm.name={self.name!r}; accepted: {ALGORITHMS}")
        self._check_preference()
        if self.kl_in not in KL_PLACEMENT:
            raise ConfigError(f"algorithm.kl_in={self.kl_in!r}; accepted: {KL_PLACEMENT}")
        if self.kl_in == "reward" and self.kl_coef > 0 and self.name != "ppo":
            # group-relative advantages take one reward per sample: a per-token penalty has no
            # place in them (PPO's GAE takes per-token rewards)
            raise ConfigError(
                f"algorithm.kl_in=reward needs algorithm.name=ppo (per-token rewards into GAE); "
                f"with algorithm.name={self.name} accepted: algorithm.kl_in=loss"
            )
        for k in ("ppo_epochs", "mini_batches", "micro_batch_size"):
            if getattr(self, k) < 1:
                raise ConfigError(f"algorithm.{k}={getattr(self, k)} must be >= 1")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ConfigError(
                f"algorithm.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}; "
                "accepted: null or >= 1"
            )
        if self.advantage not in available_advantages():
            raise ConfigError(
                f"algorithm.advantage={self.advantage!r}; accepted: {available_advantages()}"
            )
        if self.policy_loss not in available_policy_losses():
            raise ConfigError(
                f"algorithm.policy_loss={self.policy_loss!r}; accepted: {available_policy_losses()}"
            )
        self._check_cispo()
        self._check_dynamic_sampling()
        self._check_distill()
        if self.scale not in ("group", "batch", "none"):
            raise ConfigError(f"algorithm.scale={self.scale!r}; accepted: group, batch, none")
        if self.agg_mode not in AGG_MODES:
            raise ConfigError(f"algorithm.agg_mode={self.agg_mode!r}; accepted: {AGG_MODES}")
        if self.off_policy_correction not in OFF_POLICY_CORRECTIONS:
            raise ConfigError(
                f"algorithm.off_policy_correction={self.off_policy_correction!r}; accepted: "
                f"{OFF_POLICY_CORRECTIONS}"
            )
        if not 0.0 <= self.is_low < 1.0 < self.is_high:
            raise ConfigError(
                f"algorithm.is_low={self.is_low}, algorithm.is_high={self.is_high}; accepted: "
                "0 <= is_low < 1 < is_high"
            )
        if self.kl_kind not in ("k1", "k2", "k3", "abs"):
            raise ConfigError(f"algorithm.kl_kind={self.kl_kind!r}; accepted: k1, k2, k3, abs")

    def _check_cispo(self) -> None:
        if not 0.0 <= self.cispo_clip_low <= 1.0:
            raise ConfigError(
                f"algorithm.cispo_clip_low={self.cispo_clip_low}; accepted: 0 <= cispo_clip_low "
                "<= 1 (1 = no lower bound on the importance weight)"
            )
        if self.cispo_clip_high <= 0.0:
            raise ConfigError(f"algorithm.cispo_clip_high={self.cispo_clip_high}; accepted: > 0")
        if self.policy_loss == "cispo" and self.dual_clip is not None:
            raise ConfigError(
                f"algorithm.dual_clip={self.dual_clip} with algorithm.policy_loss=cispo; the dual "
                "clip caps PPO's clipped surrogate, which CISPO does not have: set "
                "algorithm.dual_clip to null"
            )

    def _check_dynamic_sampling(self) -> None:
        if not 1 <= self.dynamic_sampling_max_rounds <= MAX_ROUNDS:
            raise ConfigError(
                f"algorithm.dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds}; "
                f"accepted: 1 to {MAX_ROUNDS}"
            )
        if self.dynamic_sampling and self.name != "grpo":
            # PPO's advantages come from a critic: equal rewards do not make them zero
            raise ConfigError(
                f"algorithm.dynamic_sampling=true with algorithm.name={self.name}: a group with "
                "equal rewards has no gradient only under group-relative advantages; accepted: "
                "algorithm.name=grpo, or algorithm.dynamic_sampling=false"
            )

    def _check_distill(self) -> None:
        if self.distill_coef < 0:
            raise ConfigError(f"algorithm.distill_coef={self.distill_coef}; accepted: >= 0")
        if self.distill_coef and self.name not in ("grpo", "ppo"):
            raise ConfigError(
                f"algorithm.distill_coef={self.distill_coef:g} with algorithm.name={self.name}: "
                "the term is added to grpo / ppo advantages (distill uses it alone); accepted: "
                "algorithm.distill_coef=0"
            )
        if self.distill_clip is not None and self.distill_clip <= 0:
            raise ConfigError(
                f"algorithm.distill_clip={self.distill_clip}; accepted: > 0, or null (unclipped)"
            )

    def _check_preference(self) -> None:
        if self.dpo_loss not in available_preference_losses():
            raise ConfigError(
                f"algorithm.dpo_loss={self.dpo_loss!r}; accepted: {available_preference_losses()}"
            )
        if self.dpo_beta <= 0:
            raise ConfigError(f"algorithm.dpo_beta={self.dpo_beta}; accepted: > 0")
        if not 0.0 <= self.dpo_label_smoothing < 0.5:
            raise ConfigError(
                f"algorithm.dpo_label_smoothing={self.dpo_label_smoothing}; accepted: "
                "0 <= eps < 0.5"
            )
        if self.dpo_label_smoothing and not get_preference_loss(self.dpo_loss).label_smoothing:
            raise ConfigError(
                f"algorithm.dpo_label_smoothing={self.dpo_label_smoothing} with "
                f"algorithm.dpo_loss={self.dpo_loss!r}; label smoothing applies to sigmoid and "
                "simpo only: set it to 0"
            )

    @property
    def needs_reference(self) -> bool:
        """Whether the run builds the frozen reference model: for the KL term of an RL run
        (kl_coef > 0), or for a reference-based preference loss (dpo, all but simpo)."""
        if self.name == "dpo":
            return get_preference_loss(self.dpo_loss).reference
        return self.name in RL_ALGORITHMS and self.kl_coef > 0

    @property
    def uses_teacher(self) -> bool:
        """Whether the run builds the teacher (teacher.model): distill, or a distillation term
        in grpo / ppo."""
        return self.name == "distill" or self.distill_coef > 0

    @property
    def offline(self) -> bool:
        """Trained on a fixed dataset (no rollout engine): `OFFLINE_ALGORITHMS`."""
        return self.name in OFFLINE_ALGORITHMS

    @property
    def kl_options(self) -> KLOptions:
        """kl_coef, kl_kind and kl_in as `megarl.algorithms.kl.KLOptions`."""
        return KLOptions(coef=self.kl_coef, kind=self.kl_kind, placement=self.kl_in)

    @property
    def policy_loss_options(self) -> PolicyLossOptions:
        """clip_low, clip_high, dual_clip, cispo_clip_low, cispo_clip_high, agg_mode, the
        off-policy correction, entropy_coef and the KL term (its coefficient only when
        kl_in=loss) as
        `megarl.algorithms.losses.PolicyLossOptions`; the ratio level comes with the loss
        `policy_loss` names (`get_policy_loss`)."""
        kl = self.kl_options
        return PolicyLossOptions(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
            cispo_clip_low=self.cispo_clip_low,
            cispo_clip_high=self.cispo_clip_high,
            agg_mode=self.agg_mode,
            off_policy=self.off_policy_options,
            entropy_coef=self.entropy_coef,
            kl_coef=kl.coef if kl.in_loss else 0.0,
            kl_kind=kl.kind,
        )

    @property
    def off_policy_options(self) -> OffPolicyOptions:
        """off_policy_correction, is_low and is_high as
        `megarl.algorithms.off_policy.OffPolicyOptions`."""
        return OffPolicyOptions(kind=self.off_policy_correction, low=self.is_low, high=self.is_high)

    @property
    def value_loss_options(self) -> ValueLossOptions:
        """value_clip and agg_mode as `megarl.algorithms.losses.ValueLossOptions` (value_coef
        weighs the loss in the trainer)."""
        return ValueLossOptions(clip=self.value_clip, agg_mode=self.agg_mode)

    @property
    def gae_options(self) -> GAEOptions:
        """gamma and lam as `megarl.algorithms.advantages.GAEOptions`."""
        return GAEOptions(gamma=self.gamma, lam=self.lam)

    @property
    def preference_options(self) -> PreferenceOptions:
        """dpo_loss, dpo_beta, dpo_label_smoothing, simpo_gamma and dpo_length_norm as
        `megarl.algorithms.preference.PreferenceOptions`."""
        return PreferenceOptions(
            kind=self.dpo_loss,
            beta=self.dpo_beta,
            label_smoothing=self.dpo_label_smoothing,
            gamma=self.simpo_gamma,
            length_norm=self.dpo_length_norm,
        )
