"""Fault isolation in the scheduler: a fault of ours while handling one request ends that request.

An exception in marsched's code or in the policy while handling one request (metadata that
slipped past the front end's check, a policy error for its values) ends that request, not the
engine: it is logged, the request is finished with `FINISHED_ERROR` at the start of the next step
(vLLM answers its client with an error, like a grammar or KV-load failure) and its memory is
freed. Faults outside any one request's handling still propagate.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from marsched.vllm.metadata import MetadataError

logger = init_logger(__name__)


class FaultIsolation:
    """Mixed into `MarsSchedulerMixin`: `_failed` and `_error_outputs` are set up there."""

    def _fail(self, request: Request, error: BaseException, where: str) -> None:
        """A fault of ours while handling one request: it ends with an error at the next step."""
        rid = request.request_id
        if rid not in self._failed:
            if isinstance(error, MetadataError):
                logger.error("marsched: request %s: %s: %s; ending it with an error", rid, where, error)
            else:
                logger.error("marsched: %s failed for request %s; ending it with an error (the engine goes on)",
                             where, rid, exc_info=error)
        self._failed[rid] = request

    def _fail_tracked(self, tracked: Any, error: BaseException, where: str) -> None:
        """`_fail` for the lifecycle driver, which knows the request by its tracked state."""
        request = self.requests.get(tracked.progress.request_id)
        if request is not None:
            self._fail(request, error, where)

    def _end_failed(self) -> None:
        """Finish every request that faulted (FINISHED_ERROR frees its blocks and host copy)."""
        if not self._failed:
            return
        failed, self._failed = self._failed, {}
        for rid, request in failed.items():
            if request.is_finished():  # it ended on its own since (its client has its answer)
                continue
            if self.requests.get(rid) is request:
                self.finish_requests(rid, RequestStatus.FINISHED_ERROR)
            else:  # it never got past arrival: vLLM does not hold it
                self._forget(request)
            self._error_outputs.append(request)

    def _forget(self, request: Request) -> None:
        rid = request.request_id
        self.waiting.remove_requests([request])
        self.kv_holding_waiting.remove_requests([request])
        tracked = self._tracked.pop(rid, None)
        if tracked is not None:
            self._left_call(tracked)
        self._keeper.forget(rid)
        self.lifecycle.paused_preserved.pop(rid, None)
        self._swap_inflight.pop(rid, None)
        if self._swapper is not None:
            self._swapper.drop(rid)

    def _tell_errors(self, result: dict[int, Any]) -> dict[int, Any]:
        """Answer each request ended for a fault with an error output, as vLLM does for its own."""
        ended, self._error_outputs = self._error_outputs, []
        for request in ended:
            output = EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                      finish_reason=FinishReason.ERROR)
            outputs = result.get(request.client_index)
            if outputs is None:
                outputs = result[request.client_index] = EngineCoreOutputs(outputs=[])
            outputs.outputs.append(output)
            if self.finished_req_ids_dict is not None:
                outputs.finished_requests = (outputs.finished_requests or set()) | {request.request_id}
        return result
