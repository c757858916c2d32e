"""backend.weights.cuda_ipc: one owner process per weights file and device hands its tensors
to every worker that asks. On the CPU the owner hands out POSIX shared memory, so these tests
run the real owner process, its address, its handshake, its lifetime and the rebuilding of the
tensors everywhere; only the two CUDA calls (``_share_cuda_``, ``_new_shared_cuda``) need the
``gpu`` tests at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from backend.weights import cuda_ipc, load_from_owner
from backend.weights.cuda_ipc import OwnerError, owner_address, shared_state_dict

CPU = torch.device("cpu")
LINGER_S = 0.5


@pytest.fixture(autouse=True)
def _release() -> Iterator[None]:
    yield
    cuda_ipc.release_all()


MODEL = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.out = torch.nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight  # tied: one storage under two names
        self.norm = torch.nn.BatchNorm1d(16)

    def forward(self, ids):
        return self.norm(self.out(self.embed(ids)).mean(dim=1))
"""


def model_files(folder: Path) -> tuple[Path, Path, torch.nn.Module]:
    """The model file, its weights file, and the model as trained."""
    model_file = folder / "model.py"
    model_file.write_text(MODEL)
    namespace: dict[str, object] = {}
    exec(compile(MODEL, str(model_file), "exec"), namespace)
    torch.manual_seed(5)
    model: torch.nn.Module = namespace["Net"]()  # type: ignore[operator]
    with torch.no_grad():
        model(torch.randint(0, 16, (4, 3)))  # batch-norm statistics of its own
    weights = folder / "weights.pt"
    torch.save(model.state_dict(), weights)
    return model_file, weights, model.eval()


def predict(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model.eval()(torch.arange(12).reshape(4, 3))


def owner_pid() -> int:
    return cuda_ipc.peer_pid(cuda_ipc._held[-1])


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_until(predicate: object, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_workers_of_one_file_share_one_owner_which_leaves_after_the_last(
        tmp_path: Path) -> None:
    model_file, path, reference = model_files(tmp_path)
    with ThreadPoolExecutor(2) as pool:  # two models at once: one owner, its memory opened once
        models = list(pool.map(lambda _: load_from_owner(model_file, path, CPU, linger_s=LINGER_S),
                               range(2)))
    pids = {cuda_ipc.peer_pid(sock) for sock in cuda_ipc._held}
    assert len(pids) == 1
    (pid,) = pids
    assert pid != os.getpid()

    for model in models:
        assert torch.equal(predict(model), predict(reference))
    first, second = models
    # The parameters are the owner's memory, the same for both workers; the tied weight
    # stays one storage; the buffers are each worker's own.
    assert first.out.weight.untyped_storage().is_shared()  # type: ignore[union-attr]
    assert first.out.weight.data_ptr() == second.out.weight.data_ptr()  # type: ignore[union-attr]
    assert first.out.weight.data_ptr() == first.embed.weight.data_ptr()  # type: ignore[union-attr]
    assert first.norm.running_mean.data_ptr() != second.norm.running_mean.data_ptr()  # type: ignore[union-attr]
    state = shared_state_dict(path, CPU)  # strides, dtypes, 0-dim tensors as in the file
    for name, tensor in torch.load(path, weights_only=True).items():
        assert torch.equal(state[name], tensor) and state[name].stride() == tensor.stride()

    # A third worker, in a process of its own, gets the same owner and the same memory.
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import torch
            from pathlib import Path
            from backend.weights import cuda_ipc
            state = cuda_ipc.shared_state_dict(Path({str(path)!r}), torch.device("cpu"))
            print(cuda_ipc.peer_pid(cuda_ipc._held[0]), float(state["embed.weight"].sum()))
        """)], capture_output=True, text=True, timeout=120, check=True)
    their_pid, their_sum = child.stdout.split()
    assert int(their_pid) == pid
    assert float(their_sum) == float(state["embed.weight"].sum())

    # An owner started while this one is up says so and leaves.
    second = subprocess.run(
        [sys.executable, "-P", "-m", cuda_ipc.OWNER_MODULE, "--weights", str(path),
         "--device", "cpu", "--address", owner_address(path, CPU)],
        capture_output=True, text=True, timeout=120, check=True)
    assert second.stdout.strip() == "busy"
    assert not gone(pid)

    cuda_ipc.release_all()
    wait_until(lambda: gone(pid), "the owner to exit once no worker uses it")


def test_another_file_or_a_changed_one_has_another_owner(tmp_path: Path) -> None:
    _, path, _ = model_files(tmp_path)
    first = owner_address(path, CPU)
    other = tmp_path / "other.pt"
    other.write_bytes(path.read_bytes())
    assert owner_address(other, CPU) != first
    os.utime(path, ns=(0, 0))
    assert owner_address(path, CPU) != first
    assert owner_address(path, CPU).startswith("batchserve-weights-")


def test_a_file_the_owner_cannot_load_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    path.write_bytes(b"not weights at all")
    with pytest.raises(OwnerError, match=r"could not load weights\.pt: .*torch\.load"):
        shared_state_dict(path, CPU, linger_s=LINGER_S)


# ---- on a GPU ------------------------------------------------------------------------------

WORKER = """
import sys, torch
from pathlib import Path
from backend.weights import Sharing, load_eager
device = torch.device("cuda", 0)
model = load_eager(Path(sys.argv[1]), Path(sys.argv[2]), device, Sharing.CUDA_IPC).eval()
# The parameters are the owner's memory, mapped here: this process allocated none of them.
# Read before the forward pass: its first matmul allocates cuBLAS's workspace (32 MiB on a
# Hopper GPU) through the same allocator.
loaded = torch.cuda.memory_allocated(device)
torch.manual_seed(0)
with torch.inference_mode():
    out = model(torch.randn(4, 1024, device=device))
print(loaded, out.sum().item(), flush=True)
sys.stdin.read()  # stays up (using the weights) until the test lets it go
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_workers_on_one_gpu_share_one_copy_through_cuda_ipc(tmp_path: Path) -> None:
    model_file = tmp_path / "model.py"
    model_file.write_text(textwrap.dedent("""
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024)
                                                    for _ in range(16)])

            def forward(self, x):
                return self.layers(x)
        """))
    namespace: dict[str, object] = {}
    exec(compile(model_file.read_text(), str(model_file), "exec"), namespace)
    torch.manual_seed(1)
    reference = namespace["Net"]().eval()  # type: ignore[operator]
    weights = tmp_path / "weights.pt"
    torch.save(reference.state_dict(), weights)
    size = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    torch.manual_seed(0)
    with torch.inference_mode():
        expected = reference.cuda()(torch.randn(4, 1024, device="cuda")).sum().item()

    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(model_file), str(weights)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        for worker in workers:
            assert worker.stdout is not None
            allocated, total = worker.stdout.readline().split()
            assert int(allocated) < size / 4  # not a copy of the weights
            assert float(total) == pytest.approx(expected, rel=1e-4)
    finally:
        for worker in workers:
            worker.communicate("", timeout=60)
