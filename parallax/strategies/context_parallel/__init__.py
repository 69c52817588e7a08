"""Context parallelism: one sequence's positions split over a mesh axis, attention by a ring
or an all-gather of K/V (``px.ContextParallel``).

A folder of its own, like every parallelism with more than one idea, so that the word
``context`` alone keeps one meaning in parallax (the step's scope, :mod:`parallax.context`):

- ``strategy.py``: ``ContextParallel`` and ``ContextSplit``, its mechanism (the rule table,
  the zigzag order's checks, attention in a ``shard_map`` over the axis);
- ``ring.py``: ring attention, K/V round the axis with the online softmax, its backward;
- ``gather.py``: all-gather attention, the gathered K/V walked block by block both ways;
- ``zigzag.py``: the zigzag split of a sequence (chunks ``i`` and ``2n-1-i``) and the way back;
- ``stage_groups.py``: the point-to-point messages inside pipeline stages, as all-to-alls.

See ``docs/context_parallel.md``.
"""

from parallax.strategies.context_parallel.strategy import ContextParallel as ContextParallel
from parallax.strategies.context_parallel.strategy import ContextSplit as ContextSplit
