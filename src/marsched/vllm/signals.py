"""Make the engine core act on SIGTERM/SIGINT whichever of its threads the kernel hands them to.

vLLM stops an engine-core process with SIGTERM. Its handler (`run_engine_core`) asks the busy
loop to shut down; the loop then aborts what is left and the scheduler's `shutdown()` writes the
trace's `end` event. Python runs signal handlers in the main thread only, and only when that
thread next runs Python code. The kernel may deliver a process-directed signal to any thread
that does not block it (the engine core has dozens: torch, gloo, vLLM's socket threads), and an
idle engine's main thread sleeps in `input_queue.get()`: when another thread takes the signal
the handler never runs, and vLLM kills the process when its timeout ends, before `end` is
written.

CPython's C-level handler writes the signal's number to the wakeup fd from whatever thread runs
it. A thread here reads it and puts a WAKEUP on the engine's input queue, as vLLM's own signal
callback does once its handler has run: the main thread returns to Python and runs the pending
handler.
"""

from __future__ import annotations

import queue
import signal
import socket
import sys
import threading

from vllm.v1.engine import EngineCoreRequestType

_SHUTDOWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
_FRAMES_SEARCHED = 8


def engine_input_queue() -> queue.Queue | None:
    """The input queue of the engine-core process building the caller (`EngineCoreProc` makes it
    before it builds its scheduler); None when the engine core runs in-process (no queue, no
    signals)."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES_SEARCHED):
        if frame is None:
            break
        found = getattr(frame.f_locals.get("self"), "input_queue", None)
        if isinstance(found, queue.Queue):
            return found
        frame = frame.f_back
    return None


def wake_engine_on_shutdown_signals(input_queue: queue.Queue) -> bool:
    """Start the thread that wakes the engine's main thread on SIGTERM/SIGINT (main thread only;
    False, and nothing changed, where that cannot be done)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # set_wakeup_fd requires it; a full buffer just drops bytes
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:
        previous = None
    if previous != -1:  # failed, or someone else's fd: leave theirs in place
        if previous is not None:
            signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return False
    threading.Thread(target=_wake_on_signals, args=(reader, writer, input_queue), daemon=True,
                     name="marsched-signal-wakeup").start()
    return True


def _wake_on_signals(reader: socket.socket, writer: socket.socket, input_queue: queue.Queue) -> None:
    """Runs for the life of the process; `writer` (the wakeup fd) stays open while it runs."""
    while True:
        try:
            received = reader.recv(64)
        except OSError:
            return
        if not received:
            return
        if any(number in _SHUTDOWN_SIGNALS for number in received):
            # A WAKEUP is a no-op for the busy loop; the pending handler runs once it is back in Python.
            wake_engine(input_queue)


def wake_engine(input_queue: queue.Queue) -> None:
    """Make an idle engine core look at its scheduler again (`has_requests`)."""
    input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
