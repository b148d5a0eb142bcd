"""What every weight sync reports (`SyncStats`) and how one fails (`SyncError`)."""

from __future__ import annotations

from dataclasses import dataclass


class SyncError(RuntimeError):
    """A sync that stopped part-way or delivered other weights than the trainer's; `.param`
    names the vLLM parameter, HF tensor or adapted module it was at."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SyncStats:
    """One sync's figures, this rank's (seconds are wall time on this rank)."""

    mode: str
    """How the bytes moved: colocated "broadcast" / "all_to_all" (the reshard exchange between
    trainer ranks), "separate" (broadcast to engine ranks) or "adapters" (LoRA only)."""
    bytes: int
    """Bytes written into each engine."""
    seconds: float
    transfer_s: float | None = None
    """Colocated: the exchange between trainer ranks (adapters: gathering them whole);
    separate: the broadcast's time after the last bucket was packed."""
    gather_s: float | None = None
    """Separate: waiting for the tensors to be made whole from the other ranks' pieces."""
    checksum_s: float | None = None
    """Separate: packing the buckets and the sender's checksums; adapters: reading the
    engine's adapters back and comparing them."""
    floor_s: float | None = None
    """Separate: a raw broadcast of the same bytes, timed at the first sync."""
    load_s: float | None = None
    """Colocated: writing into vLLM (after the exchange)."""
    bytes_received: int | None = None
    """Colocated: bytes this rank received from the others in the exchange."""
    families_verified: int | None = None
    """Separate: tensor families whose checksums the engines' answers are compared with."""
    version: int | None = None
    """Separate: the policy version the engines hold after this sync."""
    base: SyncStats | None = None
    """Adapter syncs: the base weights' sync, when it was written too."""

    def time_detail(self) -> dict[str, float]:
        """`time_s.sync_detail` in metrics.jsonl: the parts of the sync's time that were
        measured (transfer, gather, checksum, floor)."""
        parts = {
            "transfer": self.transfer_s,
            "gather": self.gather_s,
            "checksum": self.checksum_s,
            "floor": self.floor_s,
        }
        return {k: v for k, v in parts.items() if v is not None}
