"""`torchrun ... -m tests.separate_worker train ...`: megarl's command line whose engine rank
skips the weight update number SKIP_SYNC (1 = the sync at start-up): it receives the bytes but
never loads them into vLLM, as an engine that missed an update would (the style of
tests/fault_worker.py: a wrapper installed before `main`; megarl reads none of this)."""

from __future__ import annotations

import os


def install() -> None:
    from megarl.rollout import separate

    receive, calls = separate._receive_weights, [0]

    def skipping(pg, engine, buckets):
        calls[0] += 1
        if calls[0] != int(os.environ["SKIP_SYNC"]):
            return receive(pg, engine, buckets)
        load = engine.load_hf_weights
        engine.load_hf_weights = lambda items: None  # the update never reaches vLLM
        try:
            return receive(pg, engine, buckets)
        finally:
            engine.load_hf_weights = load

    separate._receive_weights = skipping


if __name__ == "__main__":
    from megarl import cli

    install()
    raise SystemExit(cli.main())
