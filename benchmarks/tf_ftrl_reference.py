"""TensorFlow's FTRL on fixed inputs: the reference numbers ``tests/optim/test_ftrl.py`` hard-codes.

TensorFlow is a peer here, never a dependency of unison or its tests: run this script where
``tensorflow-cpu`` is installed (e.g. ``python -m venv /tmp/tf && /tmp/tf/bin/pip install
tensorflow-cpu==2.21.0``, then ``/tmp/tf/bin/python benchmarks/tf_ftrl_reference.py``) and
copy what it prints into the test when the inputs change.

Three cases, every hyper-parameter away from its default:

- ``dense``: ``tf.keras.optimizers.Ftrl`` (Keras 3, the ``tf.keras`` of TF 2.21) on a
  ``[2, 3]`` variable for four steps, once with ``learning_rate_power=-0.5`` (the kernels'
  square-root path) and once with ``-0.7``;
- ``sparse``: ``tf.raw_ops.ResourceSparseApplyFtrlV2`` on a ``[5, 2]`` table for four steps
  of ids with repeats, each step's gradient first summed per id (``tf.unique`` and
  ``unsorted_segment_sum``, as TF's optimizers do before a sparse apply: the kernel itself
  would apply a repeated index twice in a row). The kernel has no ``beta``: it is folded
  into the L2 strength as ``l2 + beta / (2 * lr)``, as ``tf.keras`` does;
- for the record, whether Keras 3's ``Ftrl`` given the same ``tf.IndexedSlices`` moves the
  rows no id touched (it densifies the gradient, so with shrinkage or a nonzero starting
  row it does): the reason the sparse reference is the kernel, as the legacy
  ``tf.compat.v1.train.FtrlOptimizer`` and ``tf.keras`` optimizers before Keras 3 used it.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

HYPER = {"learning_rate": 0.05, "initial_accumulator_value": 0.2, "l1_regularization_strength": 0.01,
         "l2_regularization_strength": 0.03, "l2_shrinkage_regularization_strength": 0.02, "beta": 0.5}
DENSE_START = np.array([[0.5, -0.3, 0.02], [-1.2, 0.8, 0.0]], dtype=np.float32)
DENSE_GRADS = [np.array([[0.3, -0.7, 0.05], [1.1, 0.2, -0.4]], dtype=np.float32),
               np.array([[-0.2, 0.4, 0.0], [0.9, -0.6, 0.3]], dtype=np.float32),
               np.array([[0.6, 0.1, -0.02], [-0.5, 0.25, 0.7]], dtype=np.float32),
               np.array([[0.05, -0.3, 0.4], [0.2, 0.0, -0.9]], dtype=np.float32)]
SPARSE_START = np.array([[0.4, -0.6], [0.1, 0.9], [-0.25, 0.3], [0.7, -0.05], [0.0, 0.2]], dtype=np.float32)
SPARSE_STEPS = [([0, 2, 2], [[0.5, -0.2], [0.3, 0.4], [-0.1, 0.6]]),
                ([3, 0], [[-0.8, 0.1], [0.2, 0.2]]),
                ([2, 4, 2, 2], [[0.1, -0.3], [0.9, -0.7], [0.05, 0.05], [-0.4, 0.2]]),
                ([0, 3, 3], [[-0.6, 0.35], [0.25, -0.15], [0.5, 0.45]])]


def dense(lr_power: float) -> list[np.ndarray]:
    """The variable after each step of ``tf.keras.optimizers.Ftrl``."""
    var = tf.Variable(DENSE_START)
    opt = tf.keras.optimizers.Ftrl(learning_rate_power=lr_power, **HYPER)
    out = []
    for grad in DENSE_GRADS:
        opt.apply_gradients([(tf.constant(grad), var)])
        out.append(var.numpy().copy())
    return out


def sparse(lr_power: float) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The table after each step of ``ResourceSparseApplyFtrlV2`` on per-id summed gradients,
    and the accumulator and linear terms at the end."""
    lr = HYPER["learning_rate"]
    var = tf.Variable(SPARSE_START)
    accum = tf.Variable(np.full_like(SPARSE_START, HYPER["initial_accumulator_value"]))
    linear = tf.Variable(np.zeros_like(SPARSE_START))
    out = []
    for ids, grads in SPARSE_STEPS:
        unique, position = tf.unique(tf.constant(ids, dtype=tf.int64))
        summed = tf.math.unsorted_segment_sum(tf.constant(grads, dtype=tf.float32), position, tf.size(unique))
        tf.raw_ops.ResourceSparseApplyFtrlV2(
            var=var.handle, accum=accum.handle, linear=linear.handle, grad=summed, indices=unique,
            lr=tf.constant(lr), l1=tf.constant(HYPER["l1_regularization_strength"]),
            l2=tf.constant(HYPER["l2_regularization_strength"] + HYPER["beta"] / (2 * lr)),
            l2_shrinkage=tf.constant(HYPER["l2_shrinkage_regularization_strength"]),
            lr_power=tf.constant(lr_power), use_locking=False, multiply_linear_by_lr=False)
        out.append(var.numpy().copy())
    return out, accum.numpy(), linear.numpy()


def keras_on_indexed_slices(lr_power: float) -> np.ndarray:
    """The table after Keras 3's ``Ftrl`` applied the same steps as ``tf.IndexedSlices``."""
    var = tf.Variable(SPARSE_START)
    opt = tf.keras.optimizers.Ftrl(learning_rate_power=lr_power, **HYPER)
    for ids, grads in SPARSE_STEPS:
        slices = tf.IndexedSlices(tf.constant(grads, dtype=tf.float32), tf.constant(ids, dtype=tf.int64),
                                  tf.constant(SPARSE_START.shape, dtype=tf.int64))
        opt.apply_gradients([(slices, var)])
    return var.numpy()


def _show(name: str, value: np.ndarray) -> None:
    print(f"{name} = {np.array2string(value, precision=9, separator=', ', floatmode='unique')}")


def main() -> None:
    np.set_printoptions(suppress=False)
    print(f"# TensorFlow {tf.__version__}, Keras {tf.keras.__version__}; hyper-parameters {HYPER}")
    for lr_power in (-0.5, -0.7):
        print(f"\n# learning_rate_power={lr_power}")
        for step, value in enumerate(dense(lr_power), 1):
            _show(f"dense step {step}", value)
        steps, accum, linear = sparse(lr_power)
        for step, value in enumerate(steps, 1):
            _show(f"sparse step {step}", value)
        _show("sparse accumulator", accum)
        _show("sparse linear", linear)
        keras = keras_on_indexed_slices(lr_power)
        untouched = 1  # row 1 is in no step's ids
        others_equal = np.allclose(np.delete(keras, untouched, 0), np.delete(steps[-1], untouched, 0), rtol=1e-5)
        print(f"# Keras 3 Ftrl on tf.IndexedSlices moves the untouched row {untouched}: "
              f"{SPARSE_START[untouched].tolist()} -> {keras[untouched].tolist()}; "
              f"the other rows equal the kernel's: {bool(others_equal)}")


if __name__ == "__main__":
    main()
