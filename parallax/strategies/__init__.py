"""The strategies: each a factory returning a small immutable ``Strategy`` value."""

from parallax.strategies.accumulate import GradientAccumulation as GradientAccumulation
from parallax.strategies.data import DataParallel as DataParallel
from parallax.strategies.pipeline import Pipeline as Pipeline
from parallax.strategies.sync import BucketedSync as BucketedSync
from parallax.strategies.tensor import TensorParallel as TensorParallel
from parallax.strategies.zero import FSDP as FSDP
from parallax.strategies.zero import HSDP as HSDP
from parallax.strategies.zero import ZeRO as ZeRO
