"""A first run's kernels compiled ahead in worker processes: `compile_ahead` (the caller's side:
plan, queue, progress) and `compile_worker` (the worker process)."""
