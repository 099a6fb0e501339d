"""reviewer_kernels/argmax.py: the drafter head's argmax and confidence (Triton under the interpreter in a subprocess,
the PyTorch expression off Triton, bf16 at the Qwen3.6 vocabulary on CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from reviewer_kernels.argmax import argmax_confidence
from tests import interpreter


def expected(logits):
    best, choice = logits.max(-1)
    return choice, torch.exp(best.float() - torch.logsumexp(logits.float(), -1))


def test_pytorch_path_is_argmax_and_softmax_probability():
    logits = torch.randn(5, 300)
    choice, conf = argmax_confidence(logits)
    assert torch.equal(choice, logits.argmax(-1))
    torch.testing.assert_close(conf, logits.softmax(-1).max(-1).values)


def test_rejects_non_matrix_logits():
    with pytest.raises(ValueError, match="rows, vocab"):
        argmax_confidence(torch.randn(10))


INTERPRETER_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from reviewer_kernels.argmax import argmax_confidence
torch.manual_seed(0)
logits = torch.randn(3, 10000)          # three chunks of 4096, the last one partial
logits[1, 9000] = logits[1, 5000] = 9.0  # a tie across chunks: the first index wins
logits[2, 4095] = logits[2, 4096] = 9.0  # and across a chunk boundary
choice, conf = argmax_confidence(logits)
best, ref = logits.max(-1)
ref_conf = torch.exp(best - torch.logsumexp(logits, -1))
print(json.dumps({"choice": choice.tolist(), "ref": ref.tolist(),
                  "conf_err": float((conf - ref_conf).abs().max()), "dtype": str(choice.dtype)}))
"""


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    done = interpreter.run(INTERPRETER_SCRIPT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["choice"] == r["ref"] == [r["ref"][0], 5000, 4095] and r["dtype"] == "torch.int64", r
    assert r["conf_err"] < 1e-6, r


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_at_the_qwen_vocabulary():
    logits = torch.randn(15, 248320, device="cuda").bfloat16()
    choice, conf = argmax_confidence(logits)
    ref_choice, ref_conf = expected(logits)
    assert torch.equal(choice, ref_choice)
    torch.testing.assert_close(conf, ref_conf, rtol=1e-5, atol=1e-7)
