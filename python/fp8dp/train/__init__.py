"""The fp8dp training demo: ``python -m fp8dp.train --config configs/demo.yaml`` under torchrun."""

from .config import TrainConfig, config_from_dict, load_config

__all__ = ["TrainConfig", "config_from_dict", "load_config"]
