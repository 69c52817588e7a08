"""The strategies: each a factory returning a small immutable ``Strategy`` value.

Each parallelism keeps its strategy and its mechanism together; the core (``layout``,
``grad``, ``step``) calls the mechanism through the strategy's fields and never imports
this package.

parallelism            strategy file     mechanism                          tests
---------------------  ----------------  ---------------------------------  ------------------
data parallel          ``data.py``       ``psum`` in ``parallax.grad``;     test_equivalence.py
(DDP, Horovod)         ``sync.py``       DDP buckets: ``comm.bucket``       test_sync.py
ZeRO 1/2/3, FSDP,      ``zero.py``       ``ZeroSharding``: shard dimension, test_zero.py
HSDP                                     all-gather, reduce-scatter         test_layout.py
tensor and sequence    ``tensor.py``     rules, ``MegatronCheck``; layers:  test_tensor_parallel.py
(Megatron)                               ``parallax.nn``; traffic:          nn/
                                         ``analysis.tensor_traffic``
gradient accumulation  ``accumulate.py`` ``parallax.microbatch``            test_equivalence.py
pipeline (GPipe, 1F1B, ``pipeline.py``   ``parallax.pipeline``: schedules,  test_pipeline_strategy
interleaved)                             runtime, partitioning              pipeline/
"""

from parallax.strategies.accumulate import GradientAccumulation as GradientAccumulation
from parallax.strategies.data import DataParallel as DataParallel
from parallax.strategies.pipeline import Pipeline as Pipeline
from parallax.strategies.sync import BucketedSync as BucketedSync
from parallax.strategies.tensor import TensorParallel as TensorParallel
from parallax.strategies.zero import FSDP as FSDP
from parallax.strategies.zero import HSDP as HSDP
from parallax.strategies.zero import ZeRO as ZeRO
