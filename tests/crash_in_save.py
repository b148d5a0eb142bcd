"""`torchrun ... -m tests.crash_in_save train ...`: megarl's command line with a crash injected at
a checkpoint's commit point (after every file of the checkpoint is written, before it becomes
visible), for `test_trainer_e2e.py`'s crash-while-saving test. The fault lives here, not in
megarl: `megarl.checkpoint.training._commit` is the commit point and is replaced before `main`.

The `__main__` guard matters: megatron's checkpoint writer starts a multiprocessing manager, whose
spawned process imports this module again (unlike a package's `__main__.py`, which
multiprocessing skips), and must not start a second training run there."""


def _crash(tmp: str, final: str) -> None:
    raise RuntimeError(f"injected crash: {tmp} written, not yet committed as {final}")


if __name__ == "__main__":
    from megarl import cli
    from megarl.checkpoint import training

    training._commit = _crash
    raise SystemExit(cli.main())
