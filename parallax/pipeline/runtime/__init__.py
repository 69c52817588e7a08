"""The SPMD pipeline runtime: one ``lax.scan`` over a schedule's ticks inside ``shard_map``.

Modules: ``lowering`` (the schedule lowered to per-cell codes, flags and buffer slots),
``chunk`` (one model chunk as ``F``, ``B``, ``W``), ``rings`` (the buffers the scan
carries), ``guarded`` (conditionals that update them in place), ``actions`` (each action a
function of one environment value, run under its guard), ``ticks`` (the scan),
``layer_moves`` (moving stacked layers to the stages that run them), ``checks`` (the checks
at the boundary), ``gradients`` (``px.pipeline.value_and_grad``, which runs the checked
:class:`parallax.pipeline.runtime.settings.PipelineSettings`) and ``gpipe`` (GPipe by autodiff,
the simple pipeline to compare with).
"""
