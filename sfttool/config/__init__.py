"""Locate, load, override and validate configs."""
from .loader import (ConfigError, builtin_config_dir, find_config, list_configs,
                     load_config)
from .validate import validate_config

__all__ = ["ConfigError", "builtin_config_dir", "find_config", "list_configs",
           "load_config", "validate_config"]
