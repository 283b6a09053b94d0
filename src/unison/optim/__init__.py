"""``unison.optim``: optimizers that ``torch.optim`` lacks and TensorFlow users bring.

- :class:`Ftrl`: FTRL-Proximal with ``tf.keras.optimizers.Ftrl``'s
  arguments and update, for dense parameters, sparse gradients and the rows of a
  ``DynamicEmbedding``.

The row updates of ``DynamicEmbedding`` tables (``torch.optim.SGD``, ``Adagrad``,
``SparseAdam`` and :class:`Ftrl` over a table's handle) are in
``unison._embeddings.optim``.
"""

from unison._optim.ftrl import Ftrl

__all__ = ["Ftrl"]
