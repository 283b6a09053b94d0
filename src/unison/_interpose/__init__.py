"""Everything unison changes in PyTorch, in one package, and the registry that lists it.

``every_change.INTERPOSITIONS`` lists every change (a literal tuple; the kinds of change
are in ``registry``): what, on which torch class or instances, why, and whether it is in
effect. Each is installed on first use, never at import, with
the handlers of the package whose behaviour it runs, so the code that touches torch is
here and the behaviour stays with its owner:

- ``optimizer_hooks``: one optimizer step hook dispatching to its owners (gradient sync,
  row updates, a replica's step redirected to its shadow optimizer), an optimizer's own
  ``zero_grad`` inside replicas, and the ps state-dict wrappers;
- ``module_hooks``: registration hooks and ``nn.Parameter.__deepcopy__``;
- ``grad_scaler``, ``once_per_step``: one GradScaler, LR scheduler, ``AveragedModel`` and
  ``add_param_group`` shared by several replica threads behave as on one device;
- ``replica_parameters``: the per-module dicts that answer a replica with its component;
- ``initial_draws``: the torch-function mode that draws a GPU scope's weights on the CPU;
- ``torch_private``: the private torch functions the synchronisers read;
- ``eager_under_compile``: the tables' forwards run eagerly under ``torch.compile`` (no change to
  torch: a decorator that imports Dynamo only once it is in use).

It sits below the gradient synchronisers, collectives, strategies and ps (which all use
it) and above the values and contexts (which its handlers for shared objects read).
"""

__all__: list[str] = []
