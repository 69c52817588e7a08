"""tf.distribute's mirrored strategies: every replica holds every variable, and gradients
are all-reduced inside one compiled program.

- ``strategy.py``: ``MirroredStrategy`` (and ``get_strategy``);
- ``multi_worker.py``: ``MultiWorkerMirroredStrategy`` over every process's devices;
- ``one_device.py``: ``OneDeviceStrategy``, the mirrored API on one device;
- ``replica_program.py``: the one program behind ``strategy.run``;
- ``divergence.py``: refusing a mirrored variable the replicas wrote differently;
- ``extended.py``: ``strategy.extended`` (``reduce_to``, ``batch_reduce_to``, ``update``);
- ``cross_device_ops.py``: ``NcclAllReduce``, ``HierarchicalCopyAllReduce``,
  ``ReductionToOneDevice``.

``from parallax.tf.mirrored import MirroredStrategy`` reads as it did when this was one
module; ``px.tf.MirroredStrategy`` is the public name.
"""

from parallax.tf.mirrored.strategy import MirroredStrategy as MirroredStrategy
from parallax.tf.mirrored.strategy import get_strategy as get_strategy
