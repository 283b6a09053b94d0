"""Real model definitions on one GPU: torchvision's ResNet-18 and a GPT-2 trained under
MultiWorkerMirroredStrategy in an NCCL group of one, eager and ``torch.compile``d
(inductor, Triton kernels), against plain PyTorch on the same GPU.

Skipped without a CUDA device and NCCL (CI has neither); ``benchmarks/gpu_check.sh`` runs
it where a GPU is lent. One worker process trains every case (compilation dominates).
"""

from __future__ import annotations

import pytest
import torch

from unison._testing import run_workers

from tests.gpu import _cuda_workers as w
from tests.real_models import _harness as h

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                                 reason="needs a CUDA device and NCCL"),
              h.requires("torchvision", "transformers"),
              pytest.mark.timeout(200)]

CASES = [("resnet18", False), ("resnet18", True), ("gpt2", False), ("gpt2", True)]
EAGER_TOLERANCE = 1e-5
COMPILED_TOLERANCE = 1e-3  # inductor fuses and reorders float32 sums


@pytest.fixture(scope="module")
def results():
    (result,) = run_workers(w.real_models_on_cuda, 1, args=(CASES,), timeout=180)
    return result


@pytest.mark.parametrize("name,compiled", CASES, ids=[f"{n}-{'compiled' if c else 'eager'}" for n, c in CASES])
def test_real_model_on_the_gpu_trains_as_plain_pytorch(results, name, compiled):
    case = results[f"{name}-{'compiled' if compiled else 'eager'}"]
    print(f"\n{name} {'compiled' if compiled else 'eager'}: max |unison - plain| {case['diff']:.3g}, "
          f"training moved {case['moved']:.3g}")
    assert case["devices"] == ["cuda:0"], case
    assert case["moved"] > 1e-3, case  # training did something to compare
    assert case["diff"] <= (COMPILED_TOLERANCE if compiled else EAGER_TOLERANCE), case
