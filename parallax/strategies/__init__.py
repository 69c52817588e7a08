"""The strategies: each a factory returning a small immutable ``Strategy`` value.

Each parallelism keeps its strategy and its mechanism together; the core (``layout``,
``grad``, ``step``) calls the mechanism through the strategy's fields and never imports
this package.

=======================  ====================  ============================  ==================
parallelism              strategy files        mechanism                     tests
=======================  ====================  ============================  ==================
data parallel (DDP,      data.py, sync.py,     the backend's sum in          test_equivalence,
Horovod, PyTorch DP)     reduce_to_one.py      parallax.grad.default_sync    test_sync,
                                               (tree exchange across CPU     test_reduce_to_one
                                               processes, else XLA's psum);  (distributed/)
                                               DDP buckets over comm.bucket  test_default_sync
ZeRO 1/2/3, FSDP, HSDP   zero.py               ZeroSharding: shard dim,      test_zero,
                                               all-gather, reduce-scatter    test_layout
tensor and sequence      tensor.py,            rules and MegatronCheck;      test_tensor_parallel,
(Megatron)               tensor_plan.py,       parallax.nn layers; traffic   nn/, byom/
                         tensor_sequence.py    in analysis.tensor_traffic
gradient accumulation    accumulate.py         parallax.grad.microbatches           test_equivalence
expert (GShard, Switch)  expert.py,            ExpertExchange: two           test_expert
                         expert_dispatch.py    all-to-alls per MoE layer
pipeline (GPipe, 1F1B,   pipeline.py           parallax.pipeline: schedules, test_pipeline_strategy,
interleaved, ZB, V)                            runtime, weight versions      pipeline/
context parallel (ring   context_parallel/:    ContextSplit: zigzag order;   test_context_parallel,
attention, Llama 3's     strategy, ring,       ring or all-gather attention  test_context_pipeline
all-gather)              zigzag, stage_groups  in a shard_map over the axis
mixed precision          precision.py          casts in parallax.grad;       test_precision
                                               parallax.loss_scale
float8 matmuls (torchao, float8/: scaling,     dense layers' dot_general     test_float8,
Transformer Engine)      recipe, matmul,       swapped in the trace; ZeRO 3  test_float8_step
                         modules, fsdp_gather  gathers weights in float8
=======================  ====================  ============================  ==================

The tests named are in ``tests/strategies/``, the folders and ``test_layout`` in ``tests/``.
"""

from parallax.strategies.sync import AllReduceSync as AllReduceSync
from parallax.strategies.accumulate import GradientAccumulation as GradientAccumulation
from parallax.strategies.context_parallel import ContextParallel as ContextParallel
from parallax.strategies.data import DataParallel as DataParallel
from parallax.strategies.expert import ExpertParallel as ExpertParallel
from parallax.strategies.float8 import Float8 as Float8
from parallax.strategies.float8 import add_float8_histories as add_float8_histories
from parallax.strategies.pipeline import Pipeline as Pipeline
from parallax.strategies.precision import MixedPrecision as MixedPrecision
from parallax.strategies.reduce_to_one import ReduceToOne as ReduceToOne
from parallax.strategies.sync import BucketedSync as BucketedSync
from parallax.strategies.tensor import TensorParallel as TensorParallel
from parallax.strategies.zero import FSDP as FSDP
from parallax.strategies.zero import HSDP as HSDP
from parallax.strategies.zero import ZeRO as ZeRO
