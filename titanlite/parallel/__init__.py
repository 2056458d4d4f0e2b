"""Parallelism applied from outside the model, one function per technique.

`titanlite.parallel.apply.parallelize` is the recipe: the one place the techniques' order is written,
each constraint stated at its call. Beside it: the mode table (modes.py), the run-precision policy
(policy.py), the data-parallel wrappers (data_parallel.py) and the process-group setup (dims.py).
Import from those modules; this package's face hands nothing on (the config checker imports
modes.py and policy.py, which need no torch).
"""
