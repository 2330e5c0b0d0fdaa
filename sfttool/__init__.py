"""sfttool: config-driven supervised fine-tuning of large language models."""

__version__ = "0.1.0"
