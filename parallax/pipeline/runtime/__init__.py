"""The SPMD pipeline runtime: one ``lax.scan`` over a schedule's ticks inside ``shard_map``.

Modules: ``plan`` (the runtime's per-cell plan and buffer slots, from the schedule),
``chunk`` (one model chunk as ``F``, ``B``, ``W``), ``rings`` (the buffers the scan
carries), ``actions`` (each action run in place under its guard), ``ticks`` (the scan),
``layer_moves`` (moving stacked layers to the stages that run them), ``gradients``
(``px.pipeline.value_and_grad``, the checks at the boundary) and ``gpipe`` (GPipe by
autodiff, the simple pipeline to compare with).
"""
