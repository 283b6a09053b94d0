"""The bucketed synchroniser: one replica per worker, gradients all-reduced in buckets while backward runs.

``buckets``: ``BucketedGradientSync``, which registers the parameters, lays out the
buckets (in an order every worker agrees on) and launches each bucket from autograd hooks
as it fills, through the bucket transport the cross-worker transport names;
``bucket_gradients``: how gradients get into a bucket and the sums back out.
"""

from unison._gradient_sync.bucketed.buckets import DEFAULT_BUCKET_BYTES, BucketedGradientSync

__all__ = ["BucketedGradientSync", "DEFAULT_BUCKET_BYTES"]
