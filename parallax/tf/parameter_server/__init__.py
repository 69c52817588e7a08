"""tf.distribute's parameter-server strategy (V2) and its ``ClusterCoordinator``, on Ray.

- ``strategy.py``: ``ParameterServerStrategy``;
- ``variable.py``, ``sharded_variable.py``, ``key_layout.py``, ``embedding.py``: variables on
  the servers, sharded by ``partitioners.py``'s rules, as keys of :mod:`parallax.ps`;
- ``server_model.py``: an NNX model's parameters on the servers;
- ``cluster_resolver.py``, ``tf_config_resolver.py``: the cluster, from Ray or ``TF_CONFIG``;
- ``coordinator.py``, ``worker_actor.py``, ``remote_value.py``: ``ClusterCoordinator``
  scheduling functions on worker processes, and the values it returns.

Ray is an optional extra: this package's ``__init__`` imports none of it (``px.tf`` loads
the partitioners and resolvers at once), and ``ParameterServerStrategy`` loads on first use,
so ``from parallax.tf.parameter_server import ParameterServerStrategy`` reads as it did when
this was one module.
"""

from parallax.ray_cluster.lazy_names import loader as _loader

__getattr__ = _loader("parallax.tf.parameter_server",
                      {"ParameterServerStrategy": "parallax.tf.parameter_server.strategy"})
