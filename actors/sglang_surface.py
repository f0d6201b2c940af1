"""The part of SGLang's API pivot's SGLang backend uses, as one table: the pinned version,
the calls it makes (which class defines them, their parameters, sync or async), the request
fields it sets, the ``Engine`` keywords (``ServerArgs`` fields) it passes, the keys it reads
from results, the memory tags it names and the attributes it reads.

Three readers keep the backend honest without a GPU: the backend imports its names from
``MODULES`` (``pivot.actors.sglang_engine.real_api``); the test kit's fake SGLang
(``pivot.actors.fake_sglang``) mirrors exactly these signatures (``tests/unit/
test_sglang_engine.py`` checks it against this table); ``scripts/check_sglang_api.py``
checks this table against the source of the pinned SGLang wheel, read without importing it.
To move to a new SGLang version: change ``PIN``, run the script, and fix what it names.
Pure data: importing it imports nothing of SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the SGLang version the backend is written against (the ``gpu`` extra pins the same)
PIN = "0.5.23"


@dataclass(frozen=True)
class Call:
    """A method the backend calls: defined in ``module`` on ``owner`` (or a base of it),
    taking ``params`` (after ``self``), a coroutine (or async generator) when ``is_async``."""

    module: str
    owner: str
    name: str
    params: tuple[str, ...]
    is_async: bool


_ENGINE = "sglang.srt.entrypoints.engine"
_TM = "sglang.srt.managers.tokenizer_manager"
_IO = "sglang.srt.managers.io_struct"

#: where the backend imports each name it takes from SGLang
MODULES: dict[str, str] = {
    "Engine": _ENGINE,
    "GenerateReqInput": _IO,
    "PauseGenerationReqInput": _IO,
    "ContinueGenerationReqInput": _IO,
    "ReleaseMemoryOccupationReqInput": _IO,
    "ResumeMemoryOccupationReqInput": _IO,
    "UpdateWeightsFromTensorReqInput": _IO,
    "BeginWeightUpdateReqInput": _IO,
    "EndWeightUpdateReqInput": _IO,
    "MultiprocessingSerializer": "sglang.srt.utils.common",
}

#: the calls, each on the class the backend holds (TokenizerManager has its control
#: coroutines from a mixin: the check follows the bases)
CALLS: tuple[Call, ...] = (
    Call(_ENGINE, "Engine", "shutdown", (), False),
    Call(_TM, "TokenizerManager", "generate_request", ("obj", "request"), True),
    Call(_TM, "TokenizerManager", "abort_request", ("rid", "abort_all"), False),
    Call(_TM, "TokenizerManager", "pause_generation", ("obj",), True),
    Call(_TM, "TokenizerManager", "continue_generation", ("obj",), True),
    Call(_TM, "TokenizerManager", "flush_cache", ("timeout_s",), True),
    Call(_TM, "TokenizerManager", "release_memory_occupation", ("obj", "request"), True),
    Call(_TM, "TokenizerManager", "resume_memory_occupation", ("obj", "request"), True),
    Call(_TM, "TokenizerManager", "update_weights_from_tensor", ("obj", "request"), True),
    Call(_TM, "TokenizerManager", "begin_weight_update", ("obj", "request"), True),
    Call(_TM, "TokenizerManager", "end_weight_update", ("obj", "request"), True),
    Call(_TM, "TokenizerManager", "get_internal_state", (), True),
    Call(
        "sglang.srt.utils.common",
        "MultiprocessingSerializer",
        "serialize",
        ("obj", "output_str"),
        False,
    ),
)

#: request classes and the fields the backend sets on them (keywords of their constructor)
REQUESTS: dict[str, tuple[str, ...]] = {
    "GenerateReqInput": ("rid", "input_ids", "sampling_params", "return_logprob", "stream"),
    "PauseGenerationReqInput": ("mode",),
    "ContinueGenerationReqInput": (),
    "ReleaseMemoryOccupationReqInput": ("tags",),
    "ResumeMemoryOccupationReqInput": ("tags",),
    "UpdateWeightsFromTensorReqInput": (
        "serialized_named_tensors",
        "load_format",
        "flush_cache",
        "weight_version",
    ),
    "BeginWeightUpdateReqInput": (),
    "EndWeightUpdateReqInput": (),
}

#: the pause mode the backend pauses in around a weight update (requests go back to the
#: waiting queue, the KV cache may be flushed and is recomputed on continue)
PAUSE_MODE = "retract"

#: keys of the ``sampling_params`` dict (fields of sglang.srt.sampling.sampling_params.
#: SamplingParams) the backend sets
SAMPLING: tuple[str, ...] = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "sampling_seed",
    "stop_token_ids",
    "ignore_eos",
)
SAMPLING_MODULE = "sglang.srt.sampling.sampling_params"

#: ``Engine(**kwargs)`` keywords the backend passes: ServerArgs fields, declared in the
#: namespaces of ``sglang/srt/arg_groups/fields/``
SERVER_ARGS: tuple[str, ...] = (
    "model_path",
    "tp_size",
    "base_gpu_id",
    "dtype",
    "mem_fraction_static",
    "enable_memory_saver",
    "skip_tokenizer_init",
    "sampling_backend",
    "random_seed",
    "max_running_requests",
    "context_length",
    "enable_deterministic_inference",
    "log_level",
)
SERVER_ARGS_PACKAGE = "sglang.srt.arg_groups.fields"

#: string keys the backend reads from results, and the module whose source builds them
RESULT_KEYS: dict[str, tuple[str, ...]] = {
    # a generate_request chunk: {"output_ids": [...], "meta_info": {...}}
    _TM: (
        "output_ids",
        "meta_info",
        "finish_reason",
        "completion_tokens",
        "output_token_logprobs",
        "message",
    ),
    # finish_reason["type"]: what ended a request
    "sglang.srt.managers.schedule_batch": ("type", "stop", "length", "abort"),
    # get_internal_state()[0]
    "sglang.srt.managers.scheduler_components.internal_state": (
        "memory_usage",
        "effective_max_running_requests_per_dp",
    ),
    # get_internal_state()[0]["memory_usage"]
    "sglang.srt.managers.scheduler_components.memory_usage": (
        "weight",
        "kvcache",
        "graph",
        "token_capacity",
    ),
}

#: memory tags of release/resume_memory_occupation, by the constant naming each
MEMORY_TAGS: dict[str, str] = {
    "GPU_MEMORY_TYPE_KV_CACHE": "kv_cache",
    "GPU_MEMORY_TYPE_WEIGHTS": "weights",
    "GPU_MEMORY_TYPE_CUDA_GRAPH": "cuda_graph",
}
MEMORY_TAGS_MODULE = "sglang.srt.constants"

#: attributes the backend reads: (module, class) -> names assigned as ``self.name`` there
ATTRIBUTES: dict[tuple[str, str], tuple[str, ...]] = {
    (_ENGINE, "Engine"): ("tokenizer_manager",),
    # rid_to_state: the requests in flight (empty: the scheduler may release memory)
    (_TM, "TokenizerManager"): ("model_config", "context_len", "rid_to_state"),
    ("sglang.srt.configs.model_config", "ModelConfig"): ("vocab_size",),
}
