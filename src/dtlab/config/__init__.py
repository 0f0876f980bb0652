"""One config schema for everything dtlab runs.

Precedence: ``--set key=value`` > the YAML file > the defaults. Every cross-field rule lives in
:func:`dtlab.config.schema.cross_checks` (rules that need only the config, with the larger ones in
:mod:`dtlab.config.checks`) or :func:`check_world` (rules that also need the world size), so there is
one place to read what is allowed. ``parallel.strategy`` maps onto parallel degrees in
:mod:`dtlab.dims`, which both ask.

The parts: :mod:`~dtlab.config.values` (strict value coercion, the section base),
:mod:`~dtlab.config.sections` (one model per YAML section), :mod:`~dtlab.config.schema` (the whole
config), :mod:`~dtlab.config.checks` (cross-field rules), :mod:`~dtlab.config.yamlio` (YAML 1.2
scalars) and :mod:`~dtlab.config.loading` (files, overrides, error messages).
"""

import dtlab.config.context_checks
import dtlab.config.float8_checks  # noqa: F401  (registers its rule)
from dtlab.config.checks import (
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    check_batch_split,
    check_pipeline_schedule,
    check_world,
    config_warnings,
    pipeline_microbatches,
    schedule_refusal,
)
from dtlab.config.loading import (
    apply_override,
    config_from_dict,
    describe_fields,
    load_config,
    yaml_scalar,
)
from dtlab.config.options import (
    CompressionOptions,
    DemoOptions,
    DiLoCoOptions,
    FaultToleranceOptions,
    Float8Options,
)
from dtlab.config.schema import Config
from dtlab.config.sections import (
    AlertsConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from dtlab.config.values import (
    EXACT_FLOAT_INT,
    INT64_MAX,
    NAME_MAX_BYTES,
    RUN_NAME_MAX_BYTES,
    TOKENIZER_VOCAB,
    TOKENIZERS,
    show,
)
from dtlab.config.yamlio import ValueRangeError, dump_yaml, parse_yaml
from dtlab.errors import ConfigError

__all__ = [
    "EXACT_FLOAT_INT",
    "INT64_MAX",
    "NAME_MAX_BYTES",
    "RUN_NAME_MAX_BYTES",
    "SINGLE_STAGE_SCHEDULES",
    "TOKENIZERS",
    "TOKENIZER_VOCAB",
    "V_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "AlertsConfig",
    "CheckpointConfig",
    "CompressionOptions",
    "Config",
    "ConfigError",
    "DataConfig",
    "DemoOptions",
    "DiLoCoOptions",
    "EvalConfig",
    "FaultToleranceOptions",
    "Float8Options",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "ValueRangeError",
    "apply_override",
    "check_batch_split",
    "check_pipeline_schedule",
    "check_world",
    "config_from_dict",
    "config_warnings",
    "describe_fields",
    "dump_yaml",
    "load_config",
    "parse_yaml",
    "pipeline_microbatches",
    "schedule_refusal",
    "show",
    "yaml_scalar",
]
