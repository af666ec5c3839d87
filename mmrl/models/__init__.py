"""Model families behind one adapter (`family_of`), loading from folders or hub ids, and tiny builds.

Each family module registers its adapter on import.
"""

from mmrl.models import (
    flow_expert,  # noqa: F401  (the "flow" action head)
    gemma3,  # noqa: F401
    glm4v,  # noqa: F401  (registers the family: glm4v and glm4v_moe)
    internvl,  # noqa: F401
    llava_onevision,  # noqa: F401
    mistral3,  # noqa: F401
    qwen2_5_vl,  # noqa: F401
    qwen2_vl,  # noqa: F401
    qwen3_5,  # noqa: F401  (qwen3_5 and qwen3_5_moe)
    qwen3_vl,  # noqa: F401
    qwen3_vl_moe,  # noqa: F401
    text,  # noqa: F401
)
from mmrl.models.action_head import (
    ActionHead,
    GaussianActionHead,
    HeadSpec,
    action_head_of,
    attach_action_head,
    head_spec,
    load_head_weights,
    read_policy_file,
)
from mmrl.models.cpu_attention import fp32_attention_on_cpu
from mmrl.models.family import FAMILIES, Family, Grid, UnsupportedModelError, family_of, register
from mmrl.models.loading import (
    ACTION_TOKENIZER_FILE,
    ACTION_TOKENS,
    SHARDED_MARKER,
    attention_implementation,
    autocast_for,
    load_config,
    load_policy,
    load_processor,
    model_folder,
    never_generated_ids,
    resolve_dtype,
    save_model,
    tokenizer_of,
)
from mmrl.models.reduced_attention import attention_fails_in, attention_refusal, sdpa
from mmrl.models.tiny import CHAT_TEMPLATE, DEFAULT_FAMILY, build_tiny, build_tokenizer

__all__ = [
    "ACTION_TOKENIZER_FILE",
    "ACTION_TOKENS",
    "CHAT_TEMPLATE",
    "DEFAULT_FAMILY",
    "FAMILIES",
    "SHARDED_MARKER",
    "ActionHead",
    "Family",
    "GaussianActionHead",
    "Grid",
    "HeadSpec",
    "UnsupportedModelError",
    "action_head_of",
    "attach_action_head",
    "attention_fails_in",
    "attention_implementation",
    "attention_refusal",
    "autocast_for",
    "build_tiny",
    "build_tokenizer",
    "family_of",
    "fp32_attention_on_cpu",
    "head_spec",
    "load_config",
    "load_head_weights",
    "load_policy",
    "load_processor",
    "model_folder",
    "never_generated_ids",
    "read_policy_file",
    "register",
    "resolve_dtype",
    "save_model",
    "sdpa",
    "tokenizer_of",
]
