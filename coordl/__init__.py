"""coordl: a drop-in torch DataLoader that stops training from waiting for data.

    from coordl import DataLoader   # instead of torch.utils.data.DataLoader
"""
__version__ = "0.1.0"

from . import transforms  # noqa: F401
from .datasets import DatasetFolder, ImageFolder
from .errors import SampleError, SkippedSampleWarning, StateError
from .loader import DataLoader
from .plan import EpochPlan, plan
from .protocol import TwoStageDataset, is_two_stage
from .stats import EpochStats, LoaderStats

__all__ = [
    "DataLoader", "ImageFolder", "DatasetFolder", "transforms", "plan", "EpochPlan", "TwoStageDataset", "is_two_stage",
    "LoaderStats", "EpochStats", "SampleError", "SkippedSampleWarning", "StateError",
]
