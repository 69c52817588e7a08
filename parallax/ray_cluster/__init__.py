"""Ray underneath the originals' asynchronous APIs: one place that starts or joins the
cluster (on loopback by default) and keeps Ray-backed names lazy.

``parallax.ps``, ``parallax.rpc`` and ``parallax.tf`` (its parameter-server strategy) all run
on Ray, an optional extra (``parallax[ps]``). They share, from here rather than from one of
them:

- ``connect.py``: ``init_cluster`` / ``shutdown_cluster``, a one-machine cluster bound to
  127.0.0.1 (``LOOPBACK``) or an existing cluster's address (public as ``px.ps.init_cluster``);
- ``lazy_names.py``: the PEP 562 loader that imports a Ray-backed name on first use, so that
  ``import parallax`` never imports ray.

This package's ``__init__`` imports nothing, so reading ``lazy_names`` loads no Ray.
"""
