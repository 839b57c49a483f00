"""Typed configuration for a training run, validated in one place.

Four groups, each a dataclass whose fields carry their help text: `DataConfig`, `ModelConfig`,
`MemoryConfig`, `TrainConfig`, gathered in `RunConfig`. The CLI turns every field into a flag
(`--lora-r` for `lora_r`), a YAML file (`--config`) fills the same fields, flags override it, and
`RunConfig.validate()` is the only place that rejects illegal combinations. The resolved
configuration is written next to every saved model as `whisper-train.yaml`.

options  the four groups of options (dataclasses with their help) and their choices
values   reading values: YAML 1.2, coercion to a field's type, named sets, one-line errors
run      `RunConfig`: building, the one `validate`, and the choices derived from options
"""

from whisper_train.config.options import (
    DEFAULT_LEARNING_RATES,
    GROUPS,
    MODES,
    OPTIMIZERS,
    PRECISIONS,
    SCHEDULERS,
    TASKS,
    DataConfig,
    MemoryConfig,
    ModelConfig,
    TrainConfig,
    field_owners,
)
from whisper_train.config.run import RunConfig
from whisper_train.config.values import (
    LONG_FORM,
    NONSPEECH,
    long_form_sets,
    named_paths,
    named_sets,
    nonspeech_sets,
    read_yaml,
    require_positive,
)

__all__ = [
    "DEFAULT_LEARNING_RATES",
    "LONG_FORM",
    "NONSPEECH",
    "GROUPS",
    "MODES",
    "OPTIMIZERS",
    "PRECISIONS",
    "SCHEDULERS",
    "TASKS",
    "DataConfig",
    "MemoryConfig",
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "field_owners",
    "long_form_sets",
    "named_paths",
    "named_sets",
    "nonspeech_sets",
    "read_yaml",
    "require_positive",
]
