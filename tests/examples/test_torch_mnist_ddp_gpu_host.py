"""examples/torch_mnist_ddp.py on GPU hosts: the CPU (gloo) run survives PyTorch's PowerSGD
hooks' ``torch.cuda.synchronize(bucket.device)`` on CPU buckets, and ``--device cuda`` needs a
GPU per process. Checked here by simulating a GPU host on the CPU."""

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch", reason="the DDP example needs torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example():
  spec = importlib.util.spec_from_file_location(
      "torch_mnist_ddp", os.path.join(ROOT, "examples", "torch_mnist_ddp.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_cpu_buckets_skip_cuda_synchronize_on_a_gpu_host(monkeypatch):
  calls = []

  def real_synchronize(device=None):  # what torch.cuda.synchronize does with a CPU device
    if device is not None and torch.device(device).type != "cuda":
      raise ValueError(f"Expected a cuda device, but got: {device}")
    calls.append(device)

  monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
  monkeypatch.setattr(torch.cuda, "synchronize", real_synchronize)
  with pytest.raises(ValueError, match="Expected a cuda device"):
    torch.cuda.synchronize(torch.device("cpu"))  # the crash the example hit
  _example().cpu_safe_cuda_synchronize()
  assert torch.cuda.synchronize(torch.device("cpu")) is None
  torch.cuda.synchronize(torch.device("cuda", 0))
  torch.cuda.synchronize()
  assert calls == [torch.device("cuda", 0), None]  # CUDA devices still synchronize
  patched = torch.cuda.synchronize
  _example().cpu_safe_cuda_synchronize()  # idempotent
  assert torch.cuda.synchronize is patched


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the refusal")
def test_device_cuda_needs_one_gpu_per_process(capsys):
  with pytest.raises(SystemExit) as e:
    _example().parse_args(["--device", "cuda", "--nprocs", "2"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--nprocs 2 needs 2 GPUs" in err and "--device cpu" in err
