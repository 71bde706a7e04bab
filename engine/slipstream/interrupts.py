"""SIGINT and SIGTERM end a run after the current batch, with a checkpoint.

The first signal asks the run to stop (status ``interrupted``); the loop finishes
the batch, the checkpointer writes it, and the CLI exits with 128 + the signal's
number (130 for Ctrl-C, 143 for a scheduler's SIGTERM), so nothing that watches
the exit code mistakes it for success. A second signal aborts at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from slipstream.state import State

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Aborted(KeyboardInterrupt):
    """A second SIGINT or SIGTERM: the run stops where it is, without a checkpoint."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"aborted by a second {signal.Signals(signum).name}")


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by ``signum``.

    >>> exit_code(signal.SIGINT), exit_code(signal.SIGTERM)
    (130, 143)
    """
    return 128 + int(signum)


def stop_on_signals(state: State, verbose: bool = True) -> Callable[[], None]:
    """From now on, SIGINT and SIGTERM stop ``state``'s run after the current batch;
    returns the function that puts the previous handlers back. Python lets only the
    main thread install handlers, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handle(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if state.stop_status == "interrupted":
            # The summary written on the way out must not promise the checkpoint the
            # first signal asked for.
            state.stop_reason = (
                f"aborted by a second {name} at step {state.timestamp.batch}, before the batch "
                "in progress ended: no checkpoint was written for it"
            )
            raise Aborted(signum)
        # The run's last step is known only when the batch in progress ends: the
        # trainer completes this reason then (interrupted_reason).
        state.request_stop("interrupted", f"interrupted by {name}")
        state.summary["interrupted_by"] = name
        if verbose:
            print(
                f"\nslipstream: {name} received: finishing this batch and saving a checkpoint "
                f"(send it again, or press Ctrl-C again, to abort at once)",
                file=sys.stderr,
                flush=True,
            )

    previous = {signum: signal.signal(signum, handle) for signum in SIGNALS}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


def interrupted_reason(name: str, step: int, checkpointed: bool) -> str:
    """What an interrupted run says once it has stopped, at ``step``."""
    if checkpointed:
        return f"interrupted by {name}: stopped after step {step}, with a checkpoint of it"
    return (
        f"interrupted by {name}: stopped after step {step}, without a checkpoint "
        "(trainer.checkpoint_interval is off)"
    )
