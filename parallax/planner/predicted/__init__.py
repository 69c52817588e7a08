"""What a training step should hold, send and compute, predicted from the published formulas.

One file per thing predicted, each read from a :class:`parallax.planner.setting.StepSetting`:

=======================  ==================================================================
``memory.py``            bytes per device: ZeRO's state, activations, temporaries
``zero.py``              the ZeRO paper's model-state bytes (``zero_state_bytes``, ...)
``traffic.py``           collectives per step: data parallel, ZeRO, Megatron, pipeline
``compute.py``           matmul FLOPs, bytes through memory, the pipeline's bubble
``pipeline.py``          a pipeline stage's rings and accumulators, from the runtime's plan
``context_parallel.py``  context parallelism's messages, gradient sum, activations at T/n
``expert_parallel.py``   expert parallelism's all-to-alls, expert weights, gradient axes
=======================  ==================================================================

``px.explain`` sets them next to what the compiled program does; ``px.plan`` ranks
candidates by them before compiling any.
"""

from parallax.planner.predicted import compute as compute
from parallax.planner.predicted import context_parallel as context_parallel
from parallax.planner.predicted import expert_parallel as expert_parallel
from parallax.planner.predicted import memory as memory
from parallax.planner.predicted import pipeline as pipeline
from parallax.planner.predicted import traffic as traffic
from parallax.planner.predicted import zero as zero
