"""How a run trains: optim.py (optimizers, schedules), steps.py (the pure train and eval steps), losses.py,
checks.py (every config check, before any work), loop.py (setup, the loop, resume), warm_start.py (init_from),
divergence.py (a diverging run's stop and its advice), metrics.py, memory.py
(the step's memory before any step), mfu.py (device peaks, train/mfu), profiler.py (the traced window and
the per-kernel table), evaluation.py (a checkpoint evaluated without training);
tasks/ holds one file per objective behind the Task protocol."""
