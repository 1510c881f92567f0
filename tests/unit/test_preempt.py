"""StopSignals notes the first stop signal while active and restores the handlers after;
Preempted's exit status is 128 + the signal's number."""

import os
import signal
import threading
from pathlib import Path

from moe_train.train.preempt import STOP_SIGNALS, Preempted, StopSignals


def test_the_first_signal_is_noted_and_the_handlers_restored() -> None:
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    with StopSignals() as stops:
        assert stops.received == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.received == signal.SIGUSR1
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


def test_off_the_main_thread_it_sets_no_handler() -> None:
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    seen = []

    def run() -> None:
        with StopSignals() as stops:
            seen.append({s: signal.getsignal(s) for s in STOP_SIGNALS} == before)
            seen.append(stops.received)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [True, 0]


def test_preempted_says_where_to_continue() -> None:
    stop = Preempted(signal.SIGTERM, 12, Path("ck/step_00000012"))
    assert stop.exit_status == 143
    assert str(stop) == ("SIGTERM at step 12: saved ck/step_00000012; run the same command "
                         "again to continue (train: with --resume)")
