"""Planning a pipeline: measuring layers (``profile_layers``) and splitting them into stages
(``partition``: uniform, torchgpipe's balancers, PipeDream's planner)."""
