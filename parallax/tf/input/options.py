"""``tf.distribute.InputOptions``: how a distributed dataset is fetched and replicated.

TensorFlow's four options and their meaning in parallax (``docs/tf.md``, "Input options"):

* ``experimental_fetch_to_device`` (default True): batches go to the replicas' devices as the
  dataset splits them. ``False`` (TF: keep them in host memory, for sparse or ragged
  tensors or host-side work) is refused: a ``PerReplica`` value is one array sharded over the
  devices, so the split *is* the transfer; host-side work belongs in the iterable itself.
* ``experimental_replication_mode``: ``PER_WORKER`` (default), one input pipeline per
  worker process; ``PER_REPLICA``, one per replica, calling ``dataset_fn`` once per replica
  with ``InputContext(num_replicas, replica_id, num_replicas)``: honoured by
  ``MirroredStrategy.distribute_datasets_from_function``, refused elsewhere exactly where
  TensorFlow refuses it (``experimental_distribute_dataset``; any method of
  ``MultiWorkerMirroredStrategy``).
* ``experimental_place_dataset_on_device`` (default False): TF runs the pipeline's ops on
  the accelerator. A parallax pipeline is a Python iterable on the host, so ``True`` is
  refused (after TensorFlow's own validity rules, which are checked first).
* ``experimental_per_replica_buffer_size`` (default 1): how many steps ahead the dataset
  splits and transfers batches. JAX's transfers are asynchronous, so a buffer of ``n``
  overlaps the next ``n`` steps' host-to-device copies with the running step; ``0`` splits
  each batch when it is asked for (the behaviour with ``options=None``).

References:
  TensorFlow ``tensorflow/python/distribute/distribute_lib.py`` (``InputOptions``,
  ``InputReplicationMode``), ``input_util.py`` (``get_distributed_datasets_from_function``:
  the placement rules), ``mirrored_strategy.py`` and ``collective_all_reduce_strategy.py``
  (where ``PER_REPLICA`` is refused).
"""

from __future__ import annotations

import dataclasses
import enum


class InputReplicationMode(enum.Enum):
    """How many input pipelines a dataset function builds (TF's ``InputReplicationMode``).

    Members:
      PER_WORKER: one pipeline per worker process; its replicas take turns reading it.
      PER_REPLICA: one pipeline per replica (``MirroredStrategy``'s
        ``distribute_datasets_from_function``).

    Example:
      >>> InputReplicationMode["PER_REPLICA"].value
      'PER_REPLICA'

    References:
      TensorFlow, ``tf.distribute.InputReplicationMode``.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options of ``experimental_distribute_dataset`` / ``distribute_datasets_from_function``.

    Attributes:
      experimental_fetch_to_device: put batches on the replicas' devices (only ``True``;
        see the module docstring).
      experimental_replication_mode: an :class:`InputReplicationMode` (or its name).
      experimental_place_dataset_on_device: run the pipeline on the device (only ``False``).
      experimental_per_replica_buffer_size: steps split and transferred ahead (``>= 0``).

    Example:
      >>> import numpy as np, parallax as px
      >>> strategy = px.tf.MirroredStrategy()
      >>> options = px.tf.InputOptions(experimental_per_replica_buffer_size=2)
      >>> batches = [np.full((8,), i, np.float32) for i in range(3)]
      >>> distributed = strategy.experimental_distribute_dataset(batches, options)
      >>> [float(b.values[0][0]) for b in distributed]
      [0.0, 1.0, 2.0]

    References:
      TensorFlow, ``tf.distribute.InputOptions``.
    """

    experimental_fetch_to_device: bool | None = None
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self):
        api = "px.tf.InputOptions"
        if self.experimental_fetch_to_device is None:  # TF's default: fetch to the device
            object.__setattr__(self, "experimental_fetch_to_device", True)
        mode = self.experimental_replication_mode
        if not isinstance(mode, InputReplicationMode):
            try:
                mode = InputReplicationMode[str(mode).upper()]
            except KeyError:
                raise ValueError(
                    f"{api}: experimental_replication_mode={mode!r} must be "
                    "px.tf.InputReplicationMode.PER_WORKER or PER_REPLICA.") from None
            object.__setattr__(self, "experimental_replication_mode", mode)
        size = self.experimental_per_replica_buffer_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(
                f"{api}: experimental_per_replica_buffer_size={size!r} must be an int >= 0 "
                "(0: no prefetching; TF's default is 1).")
        for name in ("experimental_fetch_to_device", "experimental_place_dataset_on_device"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{api}: {name} must be a bool; got {getattr(self, name)!r}.")


def check_options(api: str, options, *, from_function: bool,
                  multi_worker: bool) -> InputOptions | None:
    """``options`` validated for one distribute method: TF's rules first, then parallax's.

    Args:
      api: the API to name.
      options: ``None`` or an :class:`InputOptions`.
      from_function: whether the method is ``distribute_datasets_from_function``.
      multi_worker: whether the strategy is ``MultiWorkerMirroredStrategy``.

    Returns:
      ``options`` (``None`` stays ``None``).

    Raises:
      TypeError: not an ``InputOptions``.
      NotImplementedError: ``PER_REPLICA`` where TensorFlow refuses it.
      ValueError: TF's placement rules; a value parallax cannot honour.
    """
    if options is None:
        return None
    if not isinstance(options, InputOptions):
        raise TypeError(f"{api}: options must be a px.tf.InputOptions (TF's "
                        f"tf.distribute.InputOptions) or None; got {type(options).__name__}.")
    per_replica = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
    if per_replica and (multi_worker or not from_function):
        where = ("`distribute_datasets_from_function` of tf.distribute.MirroredStrategy"
                 if multi_worker else "`distribute_datasets_from_function`")
        raise NotImplementedError(
            f"{api}: InputReplicationMode.PER_REPLICA is only supported in {where} "
            "(TensorFlow's rule); use PER_WORKER, the default.")
    if from_function and options.experimental_place_dataset_on_device and not per_replica:
        raise ValueError(
            f"{api}: when `experimental_place_dataset_on_device` is set for dataset "
            "placement, you must also specify `PER_REPLICA` for the replication mode "
            "(TensorFlow's rule).")
    if (from_function and per_replica and options.experimental_fetch_to_device
            and options.experimental_place_dataset_on_device):
        raise ValueError(
            f"{api}: `experimental_place_dataset_on_device` can not be set to True when "
            "experimental_fetch_to_device is True and replication mode is set to "
            "`PER_REPLICA` (TensorFlow's rule).")
    if options.experimental_place_dataset_on_device:
        raise ValueError(
            f"{api}: experimental_place_dataset_on_device=True is not supported: TensorFlow "
            "then runs the tf.data pipeline's ops on the accelerator, and a parallax input "
            "pipeline is a Python iterable that runs on the host. Leave it False (the "
            "default); the batches still reach the devices when they are split.")
    if not options.experimental_fetch_to_device:
        raise ValueError(
            f"{api}: experimental_fetch_to_device=False is not supported: a PerReplica value "
            "is one array sharded over the replicas' devices, so splitting a batch is "
            "putting it on the devices; there is no host-resident per-replica value. Do "
            "host-side work (sparse or ragged inputs, Python preprocessing) in the iterable "
            "itself, which runs on the host, and leave the option True (the default).")
    return options
