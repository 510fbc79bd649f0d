"""The daemon's configuration: one tree of frozen dataclasses, loaded and validated once.

    schema.py  the tree (a docstring per field), its flat tables, ConfigError, config_to_dict
               and redact_url (secrets out of what operators see)
    rules.py   every rule a value must satisfy, with the fix it names
    load.py    defaults < YAML file < KVSTORE_* environment < flags; sizes parsed once

Import from here: `from kvstore.daemon.config import Config, load_config`.
"""

from kvstore.daemon.config.load import (
    ENV_CLIENT_NAMES,
    ENV_CONFIG_FILE,
    ENV_NAMES,
    ENV_PREFIX,
    add_arguments,
    config_from_args,
    load_config,
)
from kvstore.daemon.config.schema import (
    DEFAULTS,
    KINDS,
    LOG_LEVELS,
    SECTIONS,
    ClientConfig,
    Config,
    ConfigError,
    DramConfig,
    EventsConfig,
    HbmConfig,
    LeaseConfig,
    MetricsConfig,
    MoverConfig,
    NvmeConfig,
    RemoteConfig,
    ServerConfig,
    config_to_dict,
    redact_url,
)
from kvstore.units import format_size, parse_size

__all__ = [
    "DEFAULTS",
    "ENV_CLIENT_NAMES",
    "ENV_CONFIG_FILE",
    "ENV_NAMES",
    "ENV_PREFIX",
    "KINDS",
    "LOG_LEVELS",
    "SECTIONS",
    "ClientConfig",
    "Config",
    "ConfigError",
    "DramConfig",
    "HbmConfig",
    "LeaseConfig",
    "EventsConfig",
    "MetricsConfig",
    "MoverConfig",
    "NvmeConfig",
    "RemoteConfig",
    "ServerConfig",
    "add_arguments",
    "config_from_args",
    "config_to_dict",
    "format_size",
    "load_config",
    "parse_size",
    "redact_url",
]
