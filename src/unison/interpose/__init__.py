"""Torch classes that several replica threads share in one step, made to behave as on one device.

A strategy with several local replicas runs the user's step once per replica thread, on
the same process-wide objects: one ``torch.amp.GradScaler`` (``grad_scaler``), the
learning-rate schedulers, ``AveragedModel`` and ``Optimizer.add_param_group``
(``once_per_step``). Each module wraps methods of those torch classes, once, as an
``Interposition`` listed in ``unison._once.INTERPOSITIONS`` (the registry stays in that
lowest layer: values, strategies and ps define interpositions too). These are no part
of gradient synchronisation: they decide what a replica's call of a shared object does.
"""

__all__: list[str] = []
