"""In-process strategy fixtures (``tests/strategies/_fixtures.py``): strategies on logical CPU devices."""

from tests.strategies._fixtures import _one_intra_op_thread, central2, mirrored2, one_device, thread_baseline

__all__ = ["_one_intra_op_thread", "central2", "mirrored2", "one_device", "thread_baseline"]
