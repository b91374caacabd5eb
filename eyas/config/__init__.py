"""The one typed configuration of an eyas run, loaded from YAML.

    cfg = load_config("configs/local-tiny.yaml")
    cfg = load_config("configs/local-tiny.yaml", {"training.max_steps": 50})

Every section forbids unknown keys, so a typo fails loudly instead of being ignored. Relative paths
are resolved against the directory of the YAML file, so a config means the same thing whatever the
current directory is. Paths on an SSH host must be absolute: they name files on that host.
"""

from eyas.config.loading import config_from_dict, load_config  # noqa: F401
from eyas.config.models import (  # noqa: F401
    ConfigError,
    StrictModel,
    TargetConfig,
    HostConfig,
    ServerConfig,
    SensorConfig,
    RegenerateConfig,
    DataConfig,
    EndpointConfig,
    ExtractionConfig,
    DrafterShape,
    DistributedConfig,
    TrainingConfig,
    EvaluationConfig,
    ExportConfig,
    BenchmarkConfig,
    PlanConfig,
    PipelineConfig,
)
