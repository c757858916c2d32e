"""TorchServe's dog_breed_classification workflow on TorchServe 0.12 and batchserve: same answers?

TorchServe's ``examples/Workflows/dog_breed_classification`` as a new user runs it, with
random weights instead of the trained ones (nothing can be downloaded): its files are read at
run time from a clone of pytorch/serve (``--serve-repo``: a work tree or a bare git dir; never
copied into this repository). The script

1. saves seeded random ``state_dict``s of the example's two architectures (ResNet-18
   cat/dog, ResNet-50 dog breed). The cat/dog head's bias is then shifted so that its decision
   splits the input images (computed here with TorchServe's ImageNet transform), so that both
   branches of the DAG, "It's a cat!" and the breed top 5, are exercised;
2. archives them with TorchServe's own ``torch-model-archiver`` 0.12 and the workflow with
   ``torch-workflow-archiver`` 0.2.15, with the README's commands;
3. serves the archives on TorchServe 0.12 (``--workflow-store``) and on batchserve, registers
   ``dog_breed_wf.war`` with ``POST /workflows?url=dog_breed_wf.war`` and sends every image to
   ``/wfpredict/dog_breed_wf``: one at a time, then all at once (the README's concurrent
   curls: the models batch them);
4. prints each server's answers and compares them: the same text, or the same labels in the
   same order with probabilities within ``--tolerance``.

batchserve decodes and resizes ImageNet-style images on its tensor path by default, which
agrees with Pillow's to within rounding (``backend/handlers/images.py``): the probabilities
then differ from TorchServe's in the 4th decimal. ``--image-decode pil`` archives both models
with a model-config.yaml that selects TorchServe's Pillow path (TorchServe ignores the key).

    .venv/bin/python -m benchmarks.dog_breed_workflow --serve-repo ~/src/serve \\
        --images ../shared/data/kitten.jpg ../shared/data/dog.jpg

Exits 1 when the answers differ.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import torchserve as ts

EXAMPLE = "examples/Workflows/dog_breed_classification"
FILES = ("cat_dog_classification_arch.py", "cat_dog_classification_handler.py",
         "dog_breed_classification_arch.py", "dog_breed_classification_handler.py",
         "index_to_name.json", "workflow_dog_breed_classification.yaml",
         "workflow_dog_breed_classification_handler.py")
IMAGES = ("model_input/Cat.jpg", "model_input/Dog1.jpg", "model_input/Dog2.jpg")
WORKFLOW = "dog_breed_wf"
SEEDS = {"cat_dog_classification": 0, "dog_breed_classification": 1}


def read_example(repo: Path, rev: str, into: Path) -> None:
    """The example's files from a pytorch/serve clone (work tree or git dir) at ``rev``."""
    git_dir = repo / ".git" if (repo / ".git").exists() else repo
    for name in (*FILES, *IMAGES):
        done = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{rev}:{EXAMPLE}/{name}"],
                              capture_output=True, check=False, timeout=60)
        if done.returncode != 0:
            raise SystemExit(f"cannot read {EXAMPLE}/{name} at {rev} from {repo}: "
                             f"{done.stderr.decode(errors='replace').strip()}")
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(done.stdout)


def _module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_weights(example: Path, images: Sequence[Path]) -> dict[str, Path]:
    """Seeded random weights of both architectures; the cat/dog decision splits ``images``."""
    import torch
    from PIL import Image
    from torchvision import transforms

    # TorchServe's ImageClassifier.image_processing (the ImageNet transform).
    transform = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    weights = {}
    for name, seed in SEEDS.items():
        torch.manual_seed(seed)
        model = _module(example / f"{name}_arch.py").ImageClassifier().eval()
        if name == "cat_dog_classification":
            batch = torch.stack([transform(Image.open(path)) for path in images])
            with torch.inference_mode():
                logits = model(batch)
            margins = sorted((logits[:, 1] - logits[:, 0]).tolist())  # dog minus cat
            # The threshold in the widest gap of the middle half: a clear call either way.
            quarter = max(1, len(margins) // 4)
            candidates = range(quarter - 1, len(margins) - quarter) if len(margins) > 1 else []
            low = max(candidates, key=lambda i: margins[i + 1] - margins[i], default=0)
            threshold = (margins[low] + margins[low + 1]) / 2 if len(margins) > 1 else 0.0
            with torch.no_grad():
                model.fc[-1].bias[1] -= threshold
        weights[name] = example / f"{name}.pth"
        torch.save(model.state_dict(), weights[name])
    return weights


def build_archives(bin_dir: Path, example: Path, weights: dict[str, Path],
                   model_store: Path, workflow_store: Path, image_decode: str | None) -> None:
    """The README's torch-model-archiver and torch-workflow-archiver commands; with
    ``image_decode``, both models also get a model-config.yaml that sets batchserve's
    ``handler.image_decode`` (TorchServe ignores it)."""
    config = None
    if image_decode is not None:
        config = example / "model-config.yaml"
        config.write_text(f"handler:\n  image_decode: {image_decode}\n")
    ts.archive(bin_dir, model_store, "cat_dog_classification",
               example / "cat_dog_classification_handler.py",
               model_file=example / "cat_dog_classification_arch.py",
               serialized_file=weights["cat_dog_classification"], config_file=config)
    ts.archive(bin_dir, model_store, "dog_breed_classification",
               example / "dog_breed_classification_handler.py",
               model_file=example / "dog_breed_classification_arch.py",
               serialized_file=weights["dog_breed_classification"],
               extra_files=[example / "index_to_name.json"], config_file=config)
    ts.workflow_archive(bin_dir, workflow_store, WORKFLOW,
                        example / "workflow_dog_breed_classification.yaml",
                        example / "workflow_dog_breed_classification_handler.py")


def predict(inference: str, image: bytes, timeout_s: float) -> str:
    """``curl http://.../wfpredict/dog_breed_wf -T image`` (a PUT with no Content-Type): the
    status and the answer's text."""
    parts = urllib.parse.urlsplit(inference)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                            timeout=timeout_s)
    try:
        connection.request("PUT", f"/wfpredict/{WORKFLOW}", body=image,
                           headers={"Accept": "*/*"})
        response = connection.getresponse()
        return f"{response.status} {response.read().decode(errors='replace')}"
    except OSError as error:  # a timeout, a reset
        return f"no answer in {timeout_s:g} s ({error!r})"
    finally:
        connection.close()


def ask(inference: str, images: Sequence[Path], timeout_s: float) -> dict[str, str]:
    """Every image alone, then all of them at once; answers keyed "<image> alone|together"."""
    answers = {f"{path.name} alone": predict(inference, path.read_bytes(), timeout_s)
               for path in images}
    with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        futures = {path.name: pool.submit(predict, inference, path.read_bytes(), timeout_s)
                   for path in images}
        answers.update({f"{name} together": future.result() for name, future in futures.items()})
    return answers


@contextlib.contextmanager
def serving(server_name: str, model_store: Path, workflow_store: Path) -> Iterator[str]:
    """A server with the workflow registered as the README does; yields its inference URL."""
    if server_name == "torchserve":
        with ts.TorchServe(model_store, quiet=True, workflow_store=workflow_store) as server:
            server.register_workflow(f"{WORKFLOW}.war")
            yield server.inference
    else:
        from benchmarks.servers import Batchserve

        with Batchserve(model_store, workflow_store=workflow_store) as bs:
            bs.register_workflow(f"{WORKFLOW}.war")
            yield bs.inference


def same(a: str, b: str, tolerance: float) -> bool:
    """The same status and text, or the same JSON object keys in the same order with numbers
    within ``tolerance``."""
    if a == b:
        return True
    status_a, _, text_a = a.partition(" ")
    status_b, _, text_b = b.partition(" ")
    try:
        json_a, json_b = json.loads(text_a), json.loads(text_b)
    except ValueError:
        return False
    if status_a != status_b or not isinstance(json_a, dict) or not isinstance(json_b, dict):
        return False
    return list(json_a) == list(json_b) and all(
        abs(float(json_a[key]) - float(json_b[key])) <= tolerance for key in json_a)


def max_difference(a: str, b: str) -> float:
    try:
        json_a, json_b = json.loads(a.partition(" ")[2]), json.loads(b.partition(" ")[2])
        return max(abs(float(json_a[key]) - float(json_b[key])) for key in json_a)
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--serve-repo", type=Path, required=True,
                        help="a clone of pytorch/serve (work tree or bare git dir)")
    parser.add_argument("--rev", default="HEAD", help="its revision to read (default HEAD)")
    parser.add_argument("--images", type=Path, nargs="*", default=[],
                        help="more images, after the example's Cat.jpg, Dog1.jpg, Dog2.jpg")
    parser.add_argument("--servers", nargs="+", default=["torchserve", "batchserve"],
                        choices=["torchserve", "batchserve"])
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for one answer")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest difference between two probabilities called the same")
    parser.add_argument("--image-decode", choices=["tensor", "pil"],
                        help="archive the models with a model-config.yaml that sets batchserve's "
                             "handler.image_decode (default: none, as the README archives them, "
                             "so batchserve decodes on its tensor path)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="dog-breed-"))
    example, model_store, workflow_store = scratch / "example", scratch / "model_store", \
        scratch / "wf_store"
    for folder in (example, model_store, workflow_store):
        folder.mkdir()
    try:
        read_example(args.serve_repo, args.rev, example)
        images = [example / name for name in IMAGES] + [path.resolve() for path in args.images]
        names = [path.name for path in images]
        if len(set(names)) != len(names):
            raise SystemExit(f"two images have the same name: {names}")
        weights = save_weights(example, images)
        bin_dir = ts.ensure_venv()
        build_archives(bin_dir, example, weights, model_store, workflow_store,
                       args.image_decode)
        print(f"archives: {sorted(p.name for p in model_store.iterdir())} "
              f"{sorted(p.name for p in workflow_store.iterdir())} (in {scratch})", flush=True)
        answers: dict[str, dict[str, str]] = {}
        for server_name in args.servers:
            started = time.monotonic()
            with serving(server_name, model_store, workflow_store) as inference:
                answers[server_name] = ask(inference, images, args.timeout)
            print(f"\n{server_name} ({time.monotonic() - started:.0f} s):", flush=True)
            for key, answer in answers[server_name].items():
                print(f"  {key}: {' '.join(answer.split())}")
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    if len(answers) < 2:
        return 0
    (first, a), (second, b) = list(answers.items())[:2]
    differing = [key for key in a if not same(a[key], b.get(key, ""), args.tolerance)]
    largest = max((max_difference(a[key], b.get(key, "")) for key in a), default=0.0)
    exact = sum(a[key] == b.get(key) for key in a)
    print(f"\n{first} vs {second}: {len(a) - len(differing)}/{len(a)} answers the same "
          f"({exact} byte for byte; largest probability difference {largest:.2e}, "
          f"tolerance {args.tolerance:g})")
    for key in differing:
        print(f"  DIFFERENT {key}:\n    {first}: {a[key]}\n    {second}: {b.get(key)}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
