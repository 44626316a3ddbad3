"""rlkube.core.startup: SIGTERM and SIGINT set the role's stop event (and are logged) instead of killing the process."""

from __future__ import annotations

import logging
import os
import signal

import pytest
from rlkube.core.startup import stop_on_signals


@pytest.fixture
def restore_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in saved:  # a handler left out by stop_on_signals fails the assertion instead of killing pytest
        signal.signal(sig, lambda *_: None)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sets_the_stop_event_and_is_logged(sig, restore_handlers, caplog):
    caplog.set_level("INFO", logger="rlkube.test-role")
    stop = stop_on_signals("test-role", logging.getLogger("rlkube.test-role"), "finishing up")
    assert not stop.is_set()
    os.kill(os.getpid(), sig)  # Python runs the handler before the next bytecode: the process is still here
    assert stop.wait(5)
    assert f"signal {int(sig)}: finishing up" in caplog.text
