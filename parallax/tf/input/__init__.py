"""tf.distribute's input: what both strategy families read their batches through.

- ``distributed.py``: ``experimental_distribute_dataset``'s and
  ``distribute_datasets_from_function``'s datasets, ``InputContext``, ``ValueContext``;
- ``options.py``: ``InputOptions``, ``InputReplicationMode`` (TF's rules, what is honoured);
- ``dataset.py``: ``px.tf.Dataset``, a pipeline that knows its files, so it can be auto-sharded;
- ``auto_shard.py``: ``AutoShardPolicy``, which files, elements and mini-batches a worker gets;
- ``workers.py``: feeding several workers' replicas by DATA or FILE / OFF / HINT;
- ``partial_batches.py``: TF's split of a global batch over replicas, padding a partial one.
"""
