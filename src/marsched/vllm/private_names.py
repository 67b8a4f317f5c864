"""Every vLLM name the plugin relies on, in one list, so that a vLLM upgrade fails at once.

Scheduler internals are not a public vLLM interface. `NAMES` holds each vLLM module we import
from and each attribute we reach, private or not: (module, attribute path in it, what we use
it for, and for a callable the parameter names we pass or override). Gathered from
`marsched/vllm/*.py`, `marsched/serve/*.py` and `marsched/bench/*.py` for vLLM 0.32.
`tests/test_vllm_private_names.py` imports each module, resolves each path (an instance
attribute is found where the class's own code assigns `self.<name>`), checks the parameter
names with `inspect.signature`, checks that each method our classes in `OVERRIDES` define over
a vLLM base is listed here, and that docs/vllm-internals.md shows this same list.
`marsched.vllm.source_names` checks the list against another release's source, read from its
wheel without installing it (`tests/test_vllm_source_names.py`: vLLM 0.33.0).

This module imports nothing from vLLM: it is data.
"""

from __future__ import annotations

from typing import NamedTuple


class VllmName(NamedTuple):
    module: str  # the module we import it from
    path: str  # attribute path inside the module: "Class.member" or "function"
    use: str  # what we use it for
    params: tuple[str, ...] = ()  # a callable: the parameter names we pass or override (besides self)


_SCHED = "vllm.v1.core.sched.scheduler"
_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_QUEUE = "vllm.v1.core.sched.request_queue"
_V1_LOGITS = "vllm.v1.sample.logits_processor"
_V2_LOGITS = "vllm.v1.worker.gpu.sample.logits_processor"
_CLIENT = "vllm.v1.engine.core_client"

NAMES: tuple[VllmName, ...] = (
    # --- the scheduler: MarsScheduler = MarsSchedulerMixin + AsyncScheduler (vllm/scheduler.py)
    VllmName("vllm.v1.core.sched.async_scheduler", "AsyncScheduler", "base class of MarsScheduler"),
    VllmName(_SCHED, "Scheduler", "base class of bench's step-timed stock scheduler (bench/steps.py) and of "
             "stock vLLM's step meter (vllm/step_meter.py)"),
    VllmName("vllm.v1.core.sched.async_scheduler", "AsyncScheduler.__init__",
             "override: replace the waiting queue, build the policy"),
    VllmName(_SCHED, "Scheduler.__init__", "override (bench's step timer, the step meter): open the step log, "
             "start the fit"),
    VllmName(_SCHED, "Scheduler.schedule", "override: sync, rank, promote, order running before vLLM's step"),
    VllmName(_SCHED, "Scheduler.update_from_output", "override: swap-outs done, first tokens, error outputs",
             ("scheduler_output", "model_runner_output")),
    VllmName(_SCHED, "Scheduler.add_request", "override: a request's arrival and each later input chunk", ("request",)),
    VllmName(_SCHED, "Scheduler._handle_stopped_request", "override: an API call begins (request paused)",
             ("request",)),
    VllmName(_SCHED, "Scheduler._update_request_as_session", "override: an API call returns (next chunk)",
             ("session", "update")),
    VllmName(_SCHED, "Scheduler._preempt_request", "override: trace the preemption, keep the strategy",
             ("request", "timestamp", "drop_stale_output")),
    VllmName(_SCHED, "Scheduler._free_request", "override: keep a conversation turn's KV before vLLM frees it",
             ("request", "delay_free_blocks")),
    VllmName(_SCHED, "Scheduler.finish_requests",
             "override and call: aborts carry conversation releases and stop-string ends; "
             "end a faulted request with FINISHED_ERROR", ("request_ids", "finished_status")),
    VllmName(_SCHED, "Scheduler.has_requests", "override: keep stepping while a swap-out or an expiry is due"),
    VllmName(_SCHED, "Scheduler.has_unfinished_requests", "the step meter writes its fit when the last request is done"),
    VllmName(_SCHED, "Scheduler.shutdown", "override: close the event trace and the kept conversations"),
    VllmName(_SCHED, "Scheduler._free_request_blocks", "Discard at the call; free after a swap-out's copy",
             ("request",)),
    VllmName(_SCHED, "Scheduler.waiting", "replaced by RankedRequestQueue (the policy's order)"),
    VllmName(_SCHED, "Scheduler.kv_holding_waiting", "paused requests that still hold blocks; moved out on resume"),
    VllmName(_SCHED, "Scheduler.running", "sorted so that vLLM's victim (the last) is the policy's"),
    VllmName(_SCHED, "Scheduler.requests", "request by internal id"),
    VllmName(_SCHED, "Scheduler.kv_cache_manager", "block ids, free blocks, usage"),
    VllmName(_SCHED, "Scheduler.connector", "the HostSwapConnector's scheduler side"),
    VllmName(_SCHED, "Scheduler.cache_config", "block size, prefix caching"),
    VllmName(_SCHED, "Scheduler.vllm_config", "the marsched entry of additional_config"),
    VllmName(_SCHED, "Scheduler.max_num_scheduled_tokens", "the policy's token budget"),
    VllmName(_SCHED, "Scheduler.num_waiting_for_streaming_input", "paused requests, for /marsched/state"),
    VllmName(_SCHED, "Scheduler.finished_req_ids_dict", "whether an error output must list finished ids"),
    # --- requests and their states
    VllmName("vllm.v1.request", "Request", "the scheduler's request"),
    VllmName("vllm.v1.request", "Request.request_id", "internal id"),
    VllmName("vllm.v1.request", "Request.status", "paused, finished how"),
    VllmName("vllm.v1.request", "Request.num_computed_tokens", "KV held; reset to 0 for Discard and Swap resumes"),
    VllmName("vllm.v1.request", "Request.num_tokens", "context length"),
    VllmName("vllm.v1.request", "Request.num_prompt_tokens", "prompt length at arrival"),
    VllmName("vllm.v1.request", "Request.num_output_tokens", "tokens generated"),
    VllmName("vllm.v1.request", "Request.prompt_token_ids", "a conversation turn's prompt, matched to the kept one"),
    VllmName("vllm.v1.request", "Request.all_token_ids", "a finished turn's tokens, kept for its follow-up"),
    VllmName("vllm.v1.request", "Request.sampling_params", "marsched metadata in extra_args"),
    VllmName("vllm.v1.request", "Request.max_tokens", "a segment's planned length"),
    VllmName("vllm.v1.request", "Request.skip_reading_prefix_cache", "a faithful Discard recompute"),
    VllmName("vllm.v1.request", "Request.client_index", "where an error output goes"),
    VllmName("vllm.v1.request", "Request.is_finished", "a faulted request that ended by itself"),
    VllmName("vllm.v1.request", "RequestStatus.WAITING_FOR_STREAMING_REQ", "a resumable request paused: an API call"),
    VllmName("vllm.v1.request", "RequestStatus.FINISHED_STOPPED", "a turn that ended normally (kept)"),
    VllmName("vllm.v1.request", "RequestStatus.FINISHED_LENGTH_CAPPED", "a turn that ended normally (kept)"),
    VllmName("vllm.v1.request", "RequestStatus.FINISHED_ABORTED", "status in the trace's finish event"),
    VllmName("vllm.v1.request", "RequestStatus.FINISHED_ERROR", "ending a request for a fault of ours"),
    VllmName("vllm.v1.request", "StreamingUpdate", "the next chunk of a resumable request"),
    VllmName("vllm.v1.request", "StreamingUpdate.from_request", "None: the session's closing message", ("request",)),
    VllmName("vllm.v1.request", "StreamingUpdate.prompt_token_ids", "the chunk: [last token] + tool result"),
    VllmName(_QUEUE, "RequestQueue", "base class of RankedRequestQueue"),
    VllmName(_QUEUE, "RequestQueue.add_request", "override: push by the policy's key", ("request",)),
    VllmName(_QUEUE, "RequestQueue.prepend_request", "override: a preempted or skipped request, ranked again",
             ("request",)),
    VllmName(_QUEUE, "RequestQueue.prepend_requests", "override: the same, for several", ("requests",)),
    VllmName(_QUEUE, "RequestQueue.peek_request", "override: the policy's head (promoted first)"),
    VllmName(_QUEUE, "RequestQueue.pop_request", "override: take the head"),
    VllmName(_QUEUE, "RequestQueue.remove_request", "override: a request that left (aborted, resumed)", ("request",)),
    VllmName(_QUEUE, "RequestQueue.remove_requests", "override: the same, for several", ("requests",)),
    VllmName(_QUEUE, "RequestQueue.__bool__", "override: vLLM's admission loop tests it (and we gate admission)"),
    VllmName(_QUEUE, "RequestQueue.__len__", "override"),
    VllmName(_QUEUE, "RequestQueue.__iter__", "override: in the policy's order"),
    # --- engine-core outputs and inputs
    VllmName("vllm.v1.engine", "EngineCoreOutput", "an error output for a request ended by a fault",
             ("request_id", "new_token_ids", "finish_reason")),
    VllmName("vllm.v1.engine", "EngineCoreOutputs", "the step's outputs per client", ("outputs",)),
    VllmName("vllm.v1.engine", "EngineCoreOutputs.outputs", "first-token times; error outputs appended"),
    VllmName("vllm.v1.engine", "EngineCoreOutputs.finished_requests", "error outputs' ids"),
    VllmName("vllm.v1.engine", "EngineCoreOutput.request_id", "whose output"),
    VllmName("vllm.v1.engine", "EngineCoreOutput.new_token_ids", "a request's first token"),
    VllmName("vllm.v1.engine", "FinishReason.ERROR", "the finish reason of a request ended by a fault"),
    VllmName("vllm.v1.engine", "EngineCoreRequestType.WAKEUP", "wakes an idle engine core (signals, retention expiry)"),
    VllmName("vllm.v1.engine.core", "EngineCoreProc.input_queue", "found from the frame that builds the scheduler"),
    VllmName("vllm.v1.core.sched.output", "SchedulerOutput.num_scheduled_tokens", "admissions' prefill, step context"),
    VllmName("vllm.v1.core.sched.output", "SchedulerOutput.total_num_scheduled_tokens", "the step's tokens (trace)"),
    VllmName("vllm.v1.core.sched.output", "SchedulerOutput.kv_connector_metadata", "the SwapMeta of the step"),
    # --- the KV cache
    VllmName("vllm.v1.core.kv_cache_manager", "KVCacheManager.block_pool", "free and total blocks"),
    VllmName("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots",
             "wrapped: kept turns give their blocks up where an allocation fails", ("request",)),
    VllmName("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_block_ids", "blocks to swap out, blocks freed",
             ("request_id",)),
    VllmName("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_blocks", "a finishing turn's blocks",
             ("request_id",)),
    VllmName("vllm.v1.core.kv_cache_manager", "KVCacheManager.usage", "device_usage in /marsched/state"),
    VllmName("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.blocks", "a turn's blocks per KV group"),
    VllmName("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids", "the swap-in target blocks"),
    VllmName("vllm.v1.core.block_pool", "BlockPool.num_gpu_blocks", "device capacity (null block included)"),
    VllmName("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks", "admission, trace, state"),
    VllmName("vllm.v1.core.block_pool", "BlockPool.touch", "pin a kept turn's blocks (Preserve retention)",
             ("blocks",)),
    VllmName("vllm.v1.core.block_pool", "BlockPool.free_blocks", "unpin them", ("ordered_blocks",)),
    VllmName("vllm.v1.core.block_pool", "BlockPool.evict_blocks", "drop swapped turns from the prefix cache",
             ("block_ids",)),
    VllmName("vllm.v1.core.kv_cache_utils", "KVCacheBlock.block_id", "ids to copy"),
    VllmName("vllm.v1.core.kv_cache_utils", "KVCacheBlock.block_hash", "only hashed blocks are found by a prefix lookup"),
    VllmName("vllm.v1.core.kv_cache_utils", "KVCacheBlock.ref_cnt", "blocks a release frees"),
    # --- the Swap connector: HostSwapConnector (vllm/kv_swap.py)
    VllmName(_BASE, "KVConnectorBase_V1", "base class of HostSwapConnector"),
    VllmName(_BASE, "KVConnectorMetadata", "base class of SwapMeta"),
    VllmName(_BASE, "KVConnectorRole", "scheduler or worker side"),
    VllmName(_BASE, "KVConnectorBase_V1.__init__", "override", ("vllm_config", "role", "kv_cache_config")),
    VllmName(_BASE, "KVConnectorBase_V1.requires_kv_delivery", "override: False, we hand KV to no other engine"),
    VllmName(_BASE, "KVConnectorBase_V1.has_pending_push_work", "override: a queued swap-out keeps the engine stepping"),
    VllmName(_BASE, "KVConnectorBase_V1.get_num_new_matched_tokens", "override: a swapped request's saved tokens",
             ("request", "num_computed_tokens")),
    VllmName(_BASE, "KVConnectorBase_V1.update_state_after_alloc", "override: the swap-in's target blocks",
             ("request", "blocks", "num_external_tokens")),
    VllmName(_BASE, "KVConnectorBase_V1.build_connector_meta", "override: the step's swap-outs, swap-ins, drops",
             ("scheduler_output",)),
    VllmName(_BASE, "KVConnectorBase_V1.request_finished", "override: drop a finished request's host copy",
             ("request", "block_ids")),
    VllmName(_BASE, "KVConnectorBase_V1.register_kv_caches", "override: the worker's KV tensors", ("kv_caches",)),
    VllmName(_BASE, "KVConnectorBase_V1.start_load_kv", "override: the copies, before the forward pass",
             ("forward_context",)),
    VllmName(_BASE, "KVConnectorBase_V1.wait_for_layer_load", "override: nothing (loads are synchronous)",
             ("layer_name",)),
    VllmName(_BASE, "KVConnectorBase_V1.save_kv_layer", "override: nothing",
             ("layer_name", "kv_layer", "attn_metadata")),
    VllmName(_BASE, "KVConnectorBase_V1.wait_for_save", "override: nothing"),
    VllmName(_BASE, "KVConnectorBase_V1.shutdown", "override: stop the copy streams"),
    VllmName(_BASE, "KVConnectorBase_V1._get_connector_metadata", "the worker reads the step's SwapMeta"),
    VllmName("vllm.distributed.kv_transfer", "get_kv_transfer_group", "the worker's connector (MarsWorkerExtension)"),
    VllmName("vllm.distributed.kv_transfer", "has_kv_transfer_group", "whether one is loaded"),
    VllmName("vllm.config", "KVTransferConfig", "loads HostSwapConnector by module path",
             ("kv_connector", "kv_role", "kv_connector_module_path", "kv_connector_extra_config")),
    VllmName("vllm.config", "KVTransferConfig.kv_connector_extra_config", "the Swap connector's per-step budget"),
    VllmName(_BASE, "KVConnectorRole.SCHEDULER", "the budget is the scheduler side's"),
    VllmName("vllm.v1.kv_cache_interface", "KVCacheConfig.num_blocks", "find the block dimension of each KV tensor"),
    VllmName("vllm.v1.kv_cache_interface", "KVCacheConfig.kv_cache_groups", "bytes per block, for a budget in bytes"),
    VllmName("vllm.v1.kv_cache_interface", "KVCacheGroupSpec.kv_cache_spec", "the same"),
    VllmName("vllm.v1.kv_cache_interface", "KVCacheGroupSpec.layer_names", "the same"),
    VllmName("vllm.v1.kv_cache_interface", "KVCacheSpec.page_size_bytes", "the same"),
    VllmName("vllm.config", "get_layers_from_vllm_config", "each layer's attention backend, for the KV layout",
             ("vllm_config", "layer_type", "layer_names")),
    VllmName("vllm.model_executor.layers.attention_layer_base", "AttentionLayerBase", "the layers to look up"),
    VllmName("vllm.model_executor.layers.attention_layer_base", "AttentionLayerBase.get_attn_backend",
             "the backend whose KV cache shape gives the block dimension"),
    # --- the host prefix tier: HostPrefixTierConnector (vllm/prefix_tier.py), on stock vLLM's scheduler
    VllmName(_BASE, "KVConnectorBase_V1.get_kv_connector_stats",
             "override: the Swap copies' measured times, for the cost model serve learns"),
    VllmName(_BASE, "KVConnectorBase_V1.build_kv_connector_stats",
             "override: the Swap copies' stats rebuilt on the scheduler side", ("data",)),
    VllmName("vllm.distributed.kv_transfer.kv_connector.v1.metrics", "KVConnectorStats",
             "base class of SwapCopyStats"),
    VllmName(_BASE, "KVConnectorBase_V1.get_finished", "override: a finished request's save is done, free its blocks",
             ("finished_req_ids",)),
    VllmName("vllm.v1.request", "Request.block_hashes", "the prefix cache's chained block hashes: the tier's keys"),
    VllmName("vllm.v1.request", "Request.num_in_flight_tokens", "tokens whose KV is not written yet: not saved"),
    VllmName("vllm.v1.kv_cache_interface", "KVCacheConfig.hash_block_size", "one hash per block, checked"),
    # --- front end: request checks (vllm/validate.py)
    VllmName(_V1_LOGITS, "LogitsProcessor", "base of MarsRequestValidator (V1 runner)"),
    VllmName(_V1_LOGITS, "LogitsProcessor.validate_params",
             "override: check the marsched fields in the front end", ("sampling_params",)),
    VllmName(_V1_LOGITS, "LogitsProcessor.__init__", "override", ("vllm_config",)),
    VllmName(_V1_LOGITS, "LogitsProcessor.is_argmax_invariant", "override: True"),
    VllmName(_V1_LOGITS, "LogitsProcessor.update_state", "override: nothing", ("batch_update",)),
    VllmName(_V1_LOGITS, "LogitsProcessor.apply", "override: logits unchanged", ("logits",)),
    VllmName(_V2_LOGITS, "LogitsProcessor", "base of MarsRequestValidator (V2 runner)"),
    VllmName(_V2_LOGITS, "LogitsProcessor.__init__", "override", ("vllm_config",)),
    VllmName(_V2_LOGITS, "LogitsProcessor.validate_params", "override: the same check", ("sampling_params",)),
    VllmName(_V2_LOGITS, "LogitsProcessor.add_request", "override: applies to no request",
             ("req_idx", "sampling_params")),
    VllmName(_V2_LOGITS, "LogitsProcessor.apply", "override: logits unchanged", ("logits",)),
    VllmName("vllm.exceptions", "VLLMValidationError", "HTTP 400 naming the field", ("parameter",)),
    VllmName("vllm.sampling_params", "SamplingParams.extra_args", "where vllm_xargs and our chunk metadata travel"),
    VllmName("vllm.logger", "init_logger", "the scheduler's logger"),
    # --- the Python API: AugmentedEngine (vllm/runtime.py)
    VllmName("vllm", "SamplingParams", "each chunk's parameters",
             ("max_tokens", "stop_token_ids", "output_kind", "extra_args")),
    VllmName("vllm.sampling_params", "RequestOutputKind.DELTA", "streamed chunks"),
    VllmName("vllm.engine.arg_utils", "AsyncEngineArgs", "the engine, with the plug-in points",
             ("model", "scheduler_cls", "worker_extension_cls", "additional_config", "kv_transfer_config",
              "enable_prefix_caching", "distributed_executor_backend")),
    VllmName("vllm.engine.protocol", "StreamingInput", "one input chunk of a resumable request",
             ("prompt", "sampling_params")),
    VllmName("vllm.inputs", "TokensPrompt", "a chunk's tokens", ("prompt_token_ids",)),
    VllmName("vllm.v1.engine.async_llm", "AsyncLLM.from_engine_args", "start the engine",
             ("engine_args", "stat_loggers")),
    VllmName("vllm.v1.engine.async_llm", "AsyncLLM.generate", "a resumable request from an input generator",
             ("prompt", "sampling_params", "request_id")),
    VllmName("vllm.v1.engine.async_llm", "AsyncLLM.abort", "a client's abort"),
    VllmName("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc", "MarsWorkerExtension.mars_state", ("method", "args")),
    VllmName("vllm.v1.engine.async_llm", "AsyncLLM.shutdown", "stop the engine core, with a timeout", ("timeout",)),
    VllmName("vllm.v1.engine.async_llm", "AsyncLLM.errored", "bench: did the engine die"),
    VllmName("vllm.v1.engine.async_llm", "AsyncLLM.model_config", "vocabulary size, max model length"),
    VllmName("vllm.v1.engine.async_llm", "AsyncLLM.tokenizer", "decode prompts for the learned predictor"),
    VllmName("vllm.v1.engine.async_llm", "AsyncLLM.vllm_config", "bench: the engine's KV capacity"),
    VllmName("vllm.v1.engine.async_llm", "AsyncLLM.engine_core", "conversation releases bypass AsyncLLM.abort"),
    VllmName("vllm.v1.engine.async_llm", "AsyncLLM.output_processor", "stop-string ends are marked as finishes"),
    VllmName("vllm.v1.engine.output_processor", "OutputProcessor.process_outputs",
             "wrapped: its stop-string aborts carry marsched-stopped ids"),
    VllmName("vllm.v1.engine.output_processor", "OutputProcessorOutput.reqs_to_abort",
             "the requests a stop string ended, which the API server aborts in the engine core"),
    VllmName("vllm.v1.engine.core_client", "EngineCoreClient.abort_requests_async", "send a release id",
             ("request_ids",)),
    VllmName(_CLIENT, "MPClient.core_engines", "the data-parallel ranks' engine cores, in rank order"),
    VllmName(_CLIENT, "MPClient.resources", "BackgroundResources.engine_dead: no abort to a dead engine"),
    VllmName(_CLIENT, "BackgroundResources.engine_dead", "the same"),
    VllmName(_CLIENT, "AsyncMPClient.call_utility_all_async", "ask every rank's mars_state (collective_rpc)",
             ("method", "args")),
    VllmName(_CLIENT, "AsyncMPClient.client_count", "several API servers: conversations placed by a hash"),
    VllmName(_CLIENT, "DPLBAsyncMPClient.reqs_in_flight", "the rank of a request, for its stop-string end"),
    VllmName(_CLIENT, "DPLBAsyncMPClient.abort_requests_async",
             "wrapped: stop-string ends go to their request's rank (it drops ids it did not place)", ("request_ids",)),
    VllmName(_CLIENT, "DPLBAsyncMPClient._abort_requests", "a release to each rank; a mark to its request's rank",
             ("request_ids", "engine")),
    VllmName("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest",
             "the request a completion's text is parsed as, for its tool call (serve/completion_tools.py)"),
    VllmName("vllm.parser.engine.adapters", "ParserEngineToolAdapter",
             "a parser whose tool calls come from the engine: no completion text to read"),
    VllmName("vllm.entrypoints.generate.base.serving", "GenerateBaseServing._get_data_parallel_rank",
             "reads the X-data-parallel-rank header the affinity middleware sets", ("raw_request",)),
    VllmName("vllm.config", "VllmConfig.additional_config", "the marsched configuration"),
    VllmName("vllm.config", "VllmConfig.cache_config", "block size and count"),
    VllmName("vllm.config", "VllmConfig.parallel_config", "the data-parallel rank"),
    VllmName("vllm.config", "ParallelConfig.data_parallel_index", "each data-parallel rank writes its own trace"),
    VllmName("vllm.config", "VllmConfig.scheduler_config", "bench: max_num_seqs, max_num_batched_tokens"),
    VllmName("vllm.config", "VllmConfig.model_config", "bench: max model length"),
    VllmName("vllm.config", "CacheConfig.block_size", "tokens per block"),
    VllmName("vllm.config", "CacheConfig.num_gpu_blocks", "bench: device blocks"),
    VllmName("vllm.config", "CacheConfig.enable_prefix_caching", "warn: Preserve retention needs it"),
    VllmName("vllm.config", "SchedulerConfig.max_num_seqs", "bench: the running cap"),
    VllmName("vllm.config", "SchedulerConfig.max_num_batched_tokens", "bench: the token budget"),
    VllmName("vllm.config", "SchedulerConfig.scheduler_reserve_full_isl",
             "calibrate: whether a waiting request needs room for its whole prompt"),
    VllmName("vllm.config", "ModelConfig.max_model_len", "bench: the longest context"),
    VllmName("vllm.config", "ModelConfig.get_vocab_size", "token ids in range"),
    # --- the server (serve/*.py) and the measurements (bench/*.py)
    VllmName("vllm.entrypoints.launchers.api_server.entry", "main", "the server marsched serve runs as a module"),
    VllmName("vllm.entrypoints.launchers.api_server.app_state", "init_app_state",
             "puts the engine client in app.state.engine_client, which the middlewares read"),
    VllmName("vllm", "LLM", "calibrate: an in-process engine (other options go on to EngineArgs)", ("model",)),
    VllmName("vllm.engine.arg_utils", "EngineArgs", "the options calibrate and bench give LLM and AsyncLLM",
             ("dtype", "enforce_eager", "block_size", "seed", "max_model_len", "num_gpu_blocks_override",
              "scheduler_cls", "kv_transfer_config")),
    VllmName("vllm", "LLM.generate", "calibrate: a grid point", ("prompts", "sampling_params", "use_tqdm")),
    VllmName("vllm", "LLM.llm_engine", "calibrate: its config and engine core"),
    VllmName("vllm.v1.engine.llm_engine", "LLMEngine.vllm_config", "calibrate: the KV capacity"),
    VllmName("vllm.v1.engine.llm_engine", "LLMEngine.engine_core", "calibrate: shut the engine core down"),
    VllmName("vllm.v1.engine.core_client", "EngineCoreClient.shutdown", "calibrate: stop it before the swap timing"),
    VllmName("vllm", "__version__", "calibrate: recorded in the profile"),
    VllmName("vllm.platforms", "current_platform", "bench: eager mode on the CPU platform only"),
    VllmName("vllm.platforms.interface", "Platform.is_cpu", "the same"),
)

# Our classes built on vLLM classes: (our module, our class, vLLM module, vLLM class). Every method
# that our classes in its MRO (mixins included) define over one of the vLLM class's own must be in
# NAMES, and take the parameters vLLM passes.
OVERRIDES: tuple[tuple[str, str, str, str], ...] = (
    ("marsched.vllm.scheduler", "MarsScheduler", "vllm.v1.core.sched.async_scheduler", "AsyncScheduler"),
    ("marsched.bench.steps", "StepTimedScheduler", _SCHED, "Scheduler"),
    ("marsched.vllm.step_meter", "MeteredScheduler", _SCHED, "Scheduler"),
    ("marsched.vllm.kv_swap", "HostSwapConnector", _BASE, "KVConnectorBase_V1"),
    ("marsched.vllm.prefix_tier", "HostPrefixTierConnector", _BASE, "KVConnectorBase_V1"),
    ("marsched.vllm.ranked_queue", "RankedRequestQueue", "vllm.v1.core.sched.request_queue", "RequestQueue"),
    ("marsched.vllm.validate", "MarsRequestValidator", _V1_LOGITS, "LogitsProcessor"),
    ("marsched.vllm.validate", "MarsRequestValidator", _V2_LOGITS, "LogitsProcessor"),
)


def markdown_table() -> str:
    """The list as the Markdown table docs/vllm-internals.md shows (between its marker comments)."""
    lines = ["| module | name | what we use it for | parameters we pass |", "| --- | --- | --- | --- |"]
    for name in NAMES:
        params = ", ".join(f"`{p}`" for p in name.params)
        lines.append(f"| `{name.module}` | `{name.path}` | {name.use} | {params} |")
    return "\n".join(lines)
