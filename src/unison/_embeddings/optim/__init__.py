"""Row optimizers: updates of only the rows a sparse gradient touched, with their state beside each
row, and the mapping from a ``torch.optim`` optimizer's param group to the row update that equals it.
Run where the rows live (this process, or a ps task)."""

__all__: list[str] = []
