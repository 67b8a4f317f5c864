"""Front-end validation of the marsched fields a client sends, through a vLLM hook.

vLLM runs every configured logits processor's `validate_params(sampling_params)` in
the front end (`InputProcessor`, in the API-server process) before a request is sent
to the engine core, and answers a `ValueError` from it with HTTP 400. That is the hook
for checking `SamplingParams.extra_args` (`vllm_xargs` over HTTP) in one place for every
endpoint (completions, chat, responses) and for the Python API alike:

    --logits-processors marsched.vllm.validate:MarsRequestValidator

`MarsRequestValidator` checks `extra_args["marsched"]` with `marsched.vllm.metadata.parse`
(and that `kv_transfer_params` / `ec_transfer_params`, which vLLM reads as objects, are
objects; and, on vLLM's CPU engine, that there is no `seed`, which crashes it), and changes
no logits (`apply` returns them as they are): it is argmax-invariant for vLLM's V1 model
runner (not called for greedy batches) and declines every request (`add_request` returns
False) in the V2 model runner. It implements both interfaces (V1: CPU, and GPUs without
Triton; V2: GPUs by default), because which one vLLM loads depends on the model runner.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor

from marsched.vllm.metadata import KEY, MetadataError, parse

try:  # the V2 model runner's interface (import-light, but absent from older layouts)
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor
except ImportError:  # pragma: no cover - vLLM 0.32 has it
    V2LogitsProcessor = object  # type: ignore[misc,assignment]

VALIDATOR = f"{__name__}:MarsRequestValidator"


# Keys of `extra_args` that vLLM itself reads as objects (`.get(...)`), in the front end and in the
# engine core; the top-level `kv_transfer_params` / `ec_transfer_params` fields of a request land
# there too. Over HTTP a `vllm_xargs` value is never an object, so one of these in `vllm_xargs` is
# always malformed (vLLM 0.32 answers it with a 500 from its output processor).
OBJECT_KEYS = ("kv_transfer_params", "ec_transfer_params")


# vLLM's CPU model runner kills its engine core on a seeded request whose prefill is chunked
# ("CPU Generator does not use offset"; stock vLLM 0.32 too), which would end every request.
SEED_ON_CPU = ("seed is not supported on vLLM's CPU engine: a seeded request whose prompt is "
               "prefilled in chunks crashes it ('CPU Generator does not use offset'); leave seed out")


def check_sampling_params(sampling_params: Any, on_cpu: bool | None = None) -> None:
    """Raise `VLLMValidationError` (HTTP 400) naming the field if the marsched metadata is bad, or if
    the request has a `seed` on vLLM's CPU engine (`on_cpu`; None: the platform's)."""
    if getattr(sampling_params, "seed", None) is not None and (_on_cpu() if on_cpu is None else on_cpu):
        raise VLLMValidationError(SEED_ON_CPU, parameter="seed")
    extra = getattr(sampling_params, "extra_args", None)
    if not extra:
        return
    for key in OBJECT_KEYS:
        if key in extra and not isinstance(extra[key], dict):
            raise VLLMValidationError(f"{key} must be an object (the request's top-level {key!r} field), "
                                      f"not a vllm_xargs entry", parameter=f"vllm_xargs.{key}")
    if KEY not in extra:
        return
    try:
        parse(extra[KEY])
    except MetadataError as error:
        raise VLLMValidationError(f"vllm_xargs.{error}", parameter=f"vllm_xargs.{error.field}") from None


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class MarsRequestValidator(V1LogitsProcessor, V2LogitsProcessor):  # type: ignore[misc]
    """A logits processor that only validates (see the module docstring)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        check_sampling_params(sampling_params)

    # --- V1 interface: argmax-invariant and stateless ----------------------------------

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        pass

    def apply(self, logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return logits

    # --- V2 interface: applies to no request ---------------------------------------------

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        return False
