"""A turn that a stop string ended finished; vLLM tells its engine core it was aborted.

vLLM checks stop strings in the API server's output processor, and ends such a request in the
engine core through the abort path (`OutputProcessorOutput.reqs_to_abort`), the one a client's
disconnect takes: the scheduler sees `FINISHED_ABORTED` either way, and a conversation's turn
that ended on a stop string would never keep its KV. In the API server, `mark_stop_string_ends`
makes each such abort carry a second id, `marsched-stopped:<request id>`, in the same message;
`MarsScheduler.finish_requests` finishes those requests as stopped (`conversation_steps.py`).
A client's abort does not pass through the output processor, so it stays an abort. Under data
parallelism each mark goes with its request to the request's rank (`abort_routing.py`).
"""

from __future__ import annotations

from typing import Any

from marsched.vllm.abort_routing import route_marks_with_their_requests

STOPPED_PREFIX = "marsched-stopped:"
_MARK = "_marsched_marks_stop_strings"


def mark_stop_string_ends(engine_client: Any) -> bool:
    """Make the front end's stop-string aborts carry their `STOPPED_PREFIX` ids (once per engine
    client; True if it was done now). An engine client without an output processor is left alone."""
    processor = getattr(engine_client, "output_processor", None)
    if processor is None or getattr(processor, _MARK, False):
        return False
    process_outputs = processor.process_outputs

    def marking_process_outputs(*args: Any, **kwargs: Any) -> Any:
        result = process_outputs(*args, **kwargs)
        ended = result.reqs_to_abort
        if ended:
            ended.extend([STOPPED_PREFIX + rid for rid in ended])
        return result

    processor.process_outputs = marking_process_outputs
    setattr(processor, _MARK, True)
    route_marks_with_their_requests(getattr(engine_client, "engine_core", None), STOPPED_PREFIX)
    return True


def split_marked(request_ids: list[str], prefix: str) -> tuple[list[str], list[str]]:
    """An abort message's ids without those that start with `prefix`, and what follows the prefix
    in those, in order. vLLM's abort path carries two kinds of marks besides request ids: this
    module's `STOPPED_PREFIX` and the conversation releases' `retention.RELEASE_PREFIX`."""
    return ([rid for rid in request_ids if not rid.startswith(prefix)],
            [rid[len(prefix):] for rid in request_ids if rid.startswith(prefix)])
