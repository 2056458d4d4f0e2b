"""Parallelism applied from outside the model, one function per technique.

`titanlite.parallel.apply.parallelize` is the recipe: the one place the techniques' order is written,
each constraint stated at its call, and DATA_PARALLEL, each mode's wrapper. Beside it: what parallel/
is told (settings.py: typed records that titanlite.config builds), the mode table (modes.py), the
run-precision and mesh-layout policy (policy.py), the launcher's record (launch.py), the process
group, device and device mesh (dims.py), the wrappers (ddp.py, fsdp.py, with copy_engine.py's
gathers) and the gradients across them (grads.py: sync, release, clip). Import from those modules;
this package's face hands nothing on (the config checker imports launch.py, modes.py, policy.py
and settings.py, which need no torch).
"""
