"""Planning a pipeline: measuring layers (``profile``) and splitting them into stages
(``partition``: uniform, torchgpipe's balancers, PipeDream's planner)."""
