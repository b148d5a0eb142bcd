"""`torchrun ... -m tests.separate_worker train ...`: megarl's command line whose engine rank
skips the weight update number SKIP_SYNC (1 = the sync at start-up): it receives the bytes but
never loads them into vLLM, as an engine that missed an update would (SKIP_ADAPTERS: the LoRA
adapters of that sync, with `model.lora.merge: false`) (the style of
tests/fault_worker.py: a wrapper installed before `main`; megarl reads none of this)."""

from __future__ import annotations

import os


def install() -> None:
    from megarl.rollout.sync import receiver

    write, calls = receiver._write, [0]

    def skipping(engine, *args):
        calls[0] += 1
        if calls[0] != int(os.environ["SKIP_SYNC"]):
            return write(engine, *args)
        # the update never reaches vLLM, whichever way the engine writes it
        engine.weights.load_hf = engine.weights.write_repacked = lambda *a, **k: None
        try:
            return write(engine, *args)
        finally:
            del engine.weights.load_hf, engine.weights.write_repacked  # the class's again

    receiver._write = skipping
    if "SKIP_ADAPTERS" in os.environ:  # the adapters of that sync never reach vLLM
        from megarl.rollout.engine.weights import EngineWeights

        load, loads = EngineWeights.load_adapter, [0]

        def skipping_load(self, tensors, config):
            loads[0] += 1
            if loads[0] != int(os.environ["SKIP_ADAPTERS"]):
                load(self, tensors, config)

        EngineWeights.load_adapter = skipping_load


if __name__ == "__main__":
    from megarl import cli

    install()
    raise SystemExit(cli.main())
