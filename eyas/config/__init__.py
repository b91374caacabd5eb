"""The one typed configuration of an eyas run, loaded from YAML.

    cfg = load_config("configs/local-tiny.yaml")
    cfg = load_config("configs/local-tiny.yaml", {"training.max_steps": 50})

Every section forbids unknown keys, so a typo fails loudly instead of being ignored. Relative paths
are resolved against the directory of the YAML file, so a config means the same thing whatever the
current directory is. Paths on an SSH host must be absolute: they name files on that host.

One module per section (target, hosts, server, data, extraction, training, evaluation, plan) over
base.py's StrictModel; models.py assembles them into PipelineConfig and loading.py reads YAML.
"""

from eyas.config.base import ConfigError, StrictModel
from eyas.config.data import DataConfig, RegenerateConfig
from eyas.config.evaluation import BenchmarkConfig, EvaluationConfig, ExportConfig, SuiteConfig
from eyas.config.extraction import EndpointConfig, ExtractionConfig
from eyas.config.hosts import HostConfig
from eyas.config.loading import config_from_dict, load_config
from eyas.config.models import PipelineConfig
from eyas.config.plan import PlanConfig
from eyas.config.server import SensorConfig, ServerConfig
from eyas.config.target import TargetConfig
from eyas.config.training import DistributedConfig, DrafterShape, TrainingConfig

__all__ = [
    "ConfigError",
    "StrictModel",
    "TargetConfig",
    "HostConfig",
    "ServerConfig",
    "SensorConfig",
    "RegenerateConfig",
    "DataConfig",
    "EndpointConfig",
    "ExtractionConfig",
    "DrafterShape",
    "DistributedConfig",
    "TrainingConfig",
    "EvaluationConfig",
    "ExportConfig",
    "SuiteConfig",
    "BenchmarkConfig",
    "PlanConfig",
    "PipelineConfig",
    "config_from_dict",
    "load_config",
]
